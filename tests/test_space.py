"""Space: --max-store (a capture past it fails with ENOSPC and leaves the
file untouched), --max-layers (the oldest layers merge into the base, undo
to the base is kept), usage in status, commit and gc freeing space."""

from __future__ import annotations

import errno
import os

import lmdb

from cowfs.layers import treesnap
from cowfs.storage import schema as S

CHUNK = 64 << 10


def usage(ws) -> dict:
    return ws.json("status")["usage"]


def test_max_store_fails_the_write_that_would_exceed_it_and_leaves_the_file(workspace):
    ws = workspace
    original = os.urandom(64 * CHUNK)  # 4 MiB
    (ws / "big").write_bytes(original)
    ws.mount("--max-store", "1M")
    ws.checkpoint()
    expected = bytearray(original)
    fd = os.open(ws / "big", os.O_WRONLY)
    try:
        written = 0
        for k in range(64):
            block = os.urandom(CHUNK)
            try:
                os.pwrite(fd, block, k * CHUNK)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                break
            expected[k * CHUNK : (k + 1) * CHUNK] = block
            written += 1
    finally:
        os.close(fd)
    assert 4 <= written < 16  # about 1 MiB of pre-images, not more
    assert (ws / "big").read_bytes() == bytes(expected)  # the refused write changed nothing
    u = usage(ws)
    assert u["max_store"] == 1 << 20 and u["bytes"] <= (1 << 20) + CHUNK
    assert "of at most 1.0 MiB" in ws.cowfs("status").stdout
    # a rollback still works, and commits free the space for more changes
    ws.rollback()
    assert (ws / "big").read_bytes() == original
    ws.checkpoint()
    with open(ws / "big", "r+b") as f:
        f.write(os.urandom(8 * CHUNK))
    ws.commit()  # into the base: still undoable
    ws.commit()  # the base: permanent, freed
    assert usage(ws)["data"] < 200 << 10
    with open(ws / "big", "r+b") as f:
        f.seek(32 * CHUNK)
        f.write(os.urandom(8 * CHUNK))  # fits again


def test_limits_are_kept_in_the_store_and_can_be_cleared(workspace):
    ws = workspace
    ws.mount("--max-store", "2G", "--max-layers", "4")
    ws.unmount()
    ws.mount()
    u = usage(ws)
    assert (u["max_store"], u["max_layers"]) == (2 << 30, 4)
    ws.unmount()
    assert ws.json("status")["usage"]["max_layers"] == 4  # offline too
    ws.mount("--max-store", "0")
    assert (usage(ws)["max_store"], usage(ws)["max_layers"]) == (None, 4)
    r = ws.cowfs("mount", "--max-layers", "many", ws.path, check=False)
    assert r.returncode == 2 and "not a number of layers" in r.stderr


def test_max_layers_merges_the_oldest_into_the_base(workspace):
    ws = workspace
    (ws / "f").write_text("at mount\n")
    at_mount = ws.snapshot()
    ws.mount("--max-layers", "2")
    base = ws.log()[0]["id"]
    for i in range(5):
        ws.checkpoint(f"step {i}")
        (ws / "f").write_text(f"step {i}\n")
        (ws / f"new{i}").write_text(f"{i}\n")
    layers = ws.log()
    assert len(layers) == 3 and layers[0]["id"] == base
    assert [layer["message"] for layer in layers[1:]] == ["step 3", "step 4"]
    ws.rollback(to=base)  # undo back to the base is never lost
    treesnap.assert_same(at_mount, ws.snapshot())


def test_gc_frees_what_nothing_needs(mounted):
    ws = mounted
    ws.checkpoint()
    (ws / "a.txt").write_text("changed\n")
    ws.unmount()
    env = lmdb.open(str(ws / ".cowfs" / "db"), max_dbs=16, subdir=True)
    try:
        chunks, refs = env.open_db(S.DB_CHUNKS, create=False), env.open_db(S.DB_REFS, create=False)
        with env.begin(write=True) as txn:
            for i in range(20):
                data = os.urandom(CHUNK)
                h = bytes([i + 1]) * 16
                txn.put(h, data, db=chunks)
                txn.put(h, S.u64(1), db=refs)
    finally:
        env.close()
    (ws / ".cowfs" / "grave" / "4242").write_bytes(os.urandom(CHUNK))
    res = ws.json("gc")  # offline
    assert res["freed_bytes"] >= 20 * CHUNK and res["problems"] == []
    assert any("20 chunks" in d for d in res["done"])
    assert not (ws / ".cowfs" / "grave" / "4242").exists()
    ws.mount()
    ws.rollback()  # what was needed is still there
    assert (ws / "a.txt").read_text() == "alpha\n"
    assert ws.json("gc")["done"] == []  # nothing left to free
