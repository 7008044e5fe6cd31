"""`cowfs check [--repair]` against injected corruption (flipped bytes in a
chunk, a removed chunk, a damaged record, a removed grave object, wrong
reference counts, unused chunks and grave files), and rollbacks that meet
corrupt pre-images: skipped by path, the rest restored, exit non-zero."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import lmdb
import pytest

from cowfs.errors import PARTIAL, STORE_ERROR
from cowfs.layers import treesnap
from cowfs.storage import schema as S

from .helpers import COWFS

CHUNK = 64 << 10


@contextmanager
def raw_store(ws):
    """The unmounted workspace's LMDB, opened directly to damage it."""
    env = lmdb.open(str(ws / ".cowfs" / "db"), max_dbs=16, subdir=True)
    try:
        dbs = {name: env.open_db(name, create=False) for name in S.ALL_DBS}
        with env.begin(write=True) as txn:
            yield txn, dbs
    finally:
        env.close()


def records(txn, dbs) -> list[tuple[int, S.Change]]:
    return [(S.from_u64(k), S.decode_record(v)) for k, v in txn.cursor(db=dbs[S.DB_JOURNAL])]


def chunk_of(txn, dbs, path: bytes) -> bytes:
    """The digest of the first non-zero pre-image chunk recorded for *path*."""
    for _, rec in records(txn, dbs):
        if isinstance(rec, S.Chunk) and rec.loc == path and rec.digest:
            return rec.digest
    raise AssertionError(f"no chunk recorded for {path!r}")


def store_state(ws) -> dict:
    """Every byte and mtime of the store's files."""
    out = {}
    for dirpath, _, names in os.walk(ws / ".cowfs"):
        for n in names:
            p = Path(dirpath) / n
            if n in ("lock", "daemon.log", "lock.mdb"):
                continue
            out[str(p)] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


@pytest.fixture
def damaged(mounted):
    """A layer that changed a.txt (one chunk), big (one chunk of a
    multi-chunk file) and removed dir/b.txt (a grave object); unmounted.
    Returns (ws, the layer id, the tree before the layer)."""
    ws = mounted
    (ws / "big").write_bytes(os.urandom(3 * CHUNK))
    ws.commit()
    before = ws.snapshot()
    layer = ws.checkpoint("to damage")
    (ws / "a.txt").write_text("changed\n")
    with open(ws / "big", "r+b") as f:
        f.seek(CHUNK + 10)
        f.write(b"changed")
    os.unlink(ws / "dir" / "b.txt")
    ws.unmount()
    return ws, layer, before


def check(ws, *args):
    r = ws.cowfs("--json", "check", *args, check=False)
    return r.returncode, json.loads(r.stdout), r.stderr


def test_a_consistent_store_checks_clean_and_check_writes_nothing(damaged):
    ws, _, _ = damaged
    state = store_state(ws)
    code, res, _ = check(ws)
    assert (code, res["ok"], res["problems"]) == (0, True, [])
    assert res["chunks"] >= 2 and res["records"] >= 4 and res["graves"] == 1
    assert store_state(ws) == state
    ws.mount()
    code, res, _ = check(ws)  # through the daemon too
    assert (code, res["ok"]) == (0, True)


def test_flipped_bytes_in_a_chunk_are_found_and_the_rollback_skips_that_file(damaged):
    ws, layer, before = damaged
    with raw_store(ws) as (txn, dbs):
        h = chunk_of(txn, dbs, b"big")
        data = bytearray(txn.get(h, db=dbs[S.DB_CHUNKS]))
        data[100] ^= 0xFF
        txn.put(h, bytes(data), db=dbs[S.DB_CHUNKS])
    state = store_state(ws)
    code, res, _ = check(ws)
    assert code == STORE_ERROR and not res["ok"]
    [p] = res["problems"]
    assert "corrupt" in p["problem"] and p["layers"] == [layer] and p["paths"] == ["big (chunk 1)"]
    assert store_state(ws) == state  # a read-only check never writes
    # offline, on the store directly
    rollback_skips(ws, before, b"big", "big: not restored: its pre-image (chunk 1) is corrupt")


def rollback_skips(ws, before, skipped: bytes, message: str) -> None:
    """A rollback reports *skipped* (left exactly as it is now, not torn)
    and restores everything else."""
    live = ws.snapshot()
    r = ws.cowfs("rollback", check=False)
    assert r.returncode == PARTIAL and message in r.stderr
    after = ws.snapshot()
    assert after[skipped] == live[skipped]
    for path in (b"a.txt", b"big", b"dir", b"dir/b.txt"):
        if path != skipped:
            assert after[path] == before[path]


def test_a_removed_chunk_is_found_and_skipped_in_a_mounted_rollback(damaged):
    ws, layer, before = damaged
    with raw_store(ws) as (txn, dbs):
        h = chunk_of(txn, dbs, b"a.txt")
        txn.delete(h, db=dbs[S.DB_CHUNKS])
    code, res, _ = check(ws)
    assert code == STORE_ERROR
    assert [(p["layers"], p["paths"]) for p in res["problems"] if "missing" in p["problem"]] == [
        ([layer], ["a.txt (chunk 0)"])
    ]
    ws.mount()
    rollback_skips(ws, before, b"a.txt", "a.txt: not restored: its pre-image (chunk 0) is missing")


def test_a_damaged_record_and_a_removed_grave_object_are_named(damaged):
    ws, layer, before = damaged
    with raw_store(ws) as (txn, dbs):
        recs = records(txn, dbs)
        meta_seq = next(seq for seq, rec in recs if isinstance(rec, S.Meta) and rec.loc == b"a.txt")
        txn.put(S.u64(meta_seq), b"\x06garbage", db=dbs[S.DB_JOURNAL])
        gid = next(rec.grave for _, rec in recs if isinstance(rec, S.Grave))
    os.unlink(ws / ".cowfs" / "grave" / str(gid))
    code, res, _ = check(ws)
    assert code == STORE_ERROR
    texts = [p["text"] for p in res["problems"]]
    assert any(f"record {meta_seq} is damaged" in t and f"layer {layer}" in t for t in texts)
    assert any("dir/b.txt" in t and "missing" in t for t in texts)
    assert any(
        f"record {meta_seq} is damaged" in p["text"] and p["paths"] == ["a.txt"]
        for p in res["problems"]
    )
    r = ws.cowfs("rollback", check=False)
    assert r.returncode == PARTIAL
    assert "a.txt: not restored: its undo record" in r.stderr and "dir/b.txt" in r.stderr
    assert (ws / "a.txt").read_text() == "changed\n"  # skipped whole, not torn
    assert ws.snapshot()[b"big"] == before[b"big"]


def test_repair_fixes_what_it_can_and_asks_first(damaged):
    ws, layer, before = damaged
    with raw_store(ws) as (txn, dbs):
        h = chunk_of(txn, dbs, b"a.txt")
        txn.put(h, S.u64(7), db=dbs[S.DB_REFS])  # wrong count
        orphan = b"\x01" * 16
        txn.put(orphan, b"unused", db=dbs[S.DB_CHUNKS])  # used by nothing
        txn.put(orphan, S.u64(1), db=dbs[S.DB_REFS])
    (ws / ".cowfs" / "grave" / "999").write_text("stray\n")  # held by nothing
    code, res, _ = check(ws)
    assert code == STORE_ERROR and len(res["problems"]) == 3
    assert all(p["repairable"] for p in res["problems"])
    state = store_state(ws)
    r = ws.cowfs("check", "--repair", check=False)  # no terminal: refused
    assert r.returncode == STORE_ERROR and "--yes" in r.stderr
    assert store_state(ws) == state
    r = ws.cowfs("check", "--repair", "--yes")
    assert "repaired:" in r.stdout and "now consistent" in r.stdout
    code, res, _ = check(ws)
    assert (code, res["ok"]) == (0, True)
    assert not (ws / ".cowfs" / "grave" / "999").exists()
    ws.rollback()  # nothing was lost
    treesnap.assert_same(before, ws.snapshot())


def test_check_of_a_copied_workspace_names_the_store_of_another(mounted, tmp_path):
    """`cp -a ws ws2` copies the store too: it belongs to ws.  `check`
    says so, as `status` does (exit 6), not that a descriptor was bad."""
    ws = mounted
    ws.checkpoint()
    ws.unmount()
    copy = tmp_path / "ws2"
    subprocess.run(["cp", "-a", str(ws.path), str(copy)], check=True)
    for args in (["check"], ["status"]):
        r = subprocess.run([*COWFS, "-C", str(copy), *args], capture_output=True, text=True)
        assert r.returncode == STORE_ERROR, (args, r.stderr)
        assert f"belongs to another workspace ({ws.path})" in r.stderr, (args, r.stderr)


@pytest.mark.parametrize("loss", ["emptied", "removed"])
def test_a_store_that_lost_its_database_is_refused_not_started_afresh(workspace, loss):
    """The grave holds the only copy of a removed file; with db/data.mdb
    emptied or removed, neither an offline command nor a mount may start
    a fresh store over it (which would sweep the grave)."""
    ws = workspace
    (ws / "precious").write_text("the only copy\\n")
    ws.mount()
    ws.checkpoint()
    os.unlink(ws / "precious")
    ws.unmount()
    data = ws / ".cowfs" / "db" / "data.mdb"
    graves = sorted(os.listdir(ws / ".cowfs" / "grave"))
    assert graves
    if loss == "emptied":
        os.truncate(data, 0)
    else:
        os.unlink(data)
    for args in (["-C", str(ws.path), "status"], ["mount", str(ws.path)]):
        r = subprocess.run([*COWFS, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == STORE_ERROR, (args, r.stdout, r.stderr)
        assert "lost its database" in r.stderr or "not initialised" in r.stderr, r.stderr
    assert not ws.path.is_mount()
    assert sorted(os.listdir(ws / ".cowfs" / "grave")) == graves


def refused(ws, *commands: str, says: str) -> None:
    """Each command (offline, and a mount) exits 6 naming the problem, and
    no mount is left."""
    for args in [["-C", str(ws.path), c] for c in commands] + [["mount", str(ws.path)]]:
        r = subprocess.run([*COWFS, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == STORE_ERROR, (args, r.stdout, r.stderr)
        assert says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert not ws.path.is_mount()


def test_a_database_put_back_from_an_older_copy_or_another_store_is_refused(workspace, tmp_path):
    ws = workspace
    (ws / "f").write_text("one\n")
    ws.mount()
    ws.checkpoint()
    (ws / "f").write_text("two\n")
    ws.unmount()
    db = ws / ".cowfs" / "db"
    subprocess.run(["cp", "-a", str(db), str(tmp_path / "old")], check=True)
    ws.mount()
    layer = ws.checkpoint()
    os.unlink(ws / "f")  # (the grave holds the only copy now)
    ws.unmount()
    current = tmp_path / "current"
    os.rename(db, current)
    subprocess.run(["cp", "-a", str(tmp_path / "old"), str(db)], check=True)
    refused(ws, "status", "check", "rollback", says="is an older copy")
    # the store's own database back: all is well, nothing was lost
    shutil.rmtree(db)
    os.rename(current, db)
    assert ws.json("log")[-1]["id"] == layer
    # another store's database (of the same workspace)
    os.rename(ws / ".cowfs", tmp_path / "store")
    ws.mount()
    ws.unmount()
    shutil.rmtree(ws / ".cowfs" / "db")
    subprocess.run(["cp", "-a", str(tmp_path / "store" / "db"), str(db)], check=True)
    refused(ws, "status", says="belongs to another store")
    # to use a database anyway, its identity file goes (and is made again)
    os.unlink(ws / ".cowfs" / "identity")
    assert ws.json("log")[-1]["id"] == layer
    assert (ws / ".cowfs" / "identity").exists()


def test_a_truncated_database_is_an_error_never_sigbus(workspace):
    ws = workspace
    (ws / "big").write_bytes(os.urandom(4 << 20))
    ws.mount()
    ws.checkpoint()
    with open(ws / "big", "r+b") as f:
        f.write(os.urandom(4 << 20))  # (4 MiB of chunks in LMDB)
    ws.unmount()
    data = ws / ".cowfs" / "db" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    refused(ws, "status", "check", "rollback", "log", says="database is truncated")
    view = ws.path.parent / "view"
    view.mkdir()
    r = subprocess.run(
        [*COWFS, "-C", str(ws.path), "view", "1", str(view)], capture_output=True, text=True
    )
    assert r.returncode == STORE_ERROR and "truncated" in r.stderr, r.stderr
    assert not view.is_mount()


def test_a_store_with_no_removed_files_that_lost_its_database_is_refused(workspace):
    """Its identity file says it was used, even with no grave and no log."""
    ws = workspace
    ws.mount()
    ws.checkpoint()
    ws.unmount()
    store = ws / ".cowfs"
    assert not os.listdir(store / "grave")
    os.unlink(store / "daemon.log")
    os.truncate(store / "db" / "data.mdb", 0)
    refused(ws, "status", says="lost its database")
