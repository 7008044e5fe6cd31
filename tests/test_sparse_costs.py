"""Hostile sizes cost what files hold, not the size an agent claims: a file
of TiBs holding a few bytes (sparse) is hashed when it is removed, verified
by `cowfs check` and a rollback, hashed by the commit's audit, truncated and
rolled back, by reading and recording what it holds.  Each test measures
what the daemon read (``rchar`` in /proc/PID/io: every byte a read or pread
returned, holes included), never how long anything took."""

from __future__ import annotations

import json
import os
import time

import pytest
import xxhash

from cowfs import backing as B
from cowfs import datahash, gravesum, treesnap
from cowfs import schema as S
from cowfs.errors import PARTIAL, STORE_ERROR
from cowfs.store import Store

from .test_gravehash import bitrot, check, ext4_workspace, graves

TIB = 1 << 40
FAR = 5 * TIB  # ext4 with 4 KiB blocks takes files up to 16 TiB
BOUND = 64 << 20  # what any of these steps may read: a fraction of a TiB's zeros


@pytest.fixture
def on_ext4_4k(tmp_path):
    """An empty, unmounted workspace on an ext4 of its own with 4 KiB
    blocks (files up to 16 TiB), on a loop device, so that a test can flip
    bytes on the device beneath a file."""
    with ext4_workspace(tmp_path, "-b", "4096") as ws:
        yield ws


def rchar(pid: int) -> int:
    """Bytes the process has read so far (holes read as zeros count)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def make_sparse(path, pieces: dict[int, bytes], size: int | None = None) -> bytes:
    """A file holding *pieces* (offset -> bytes) and holes elsewhere;
    returns its digest (``datahash``)."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        for off, data in pieces.items():
            os.pwrite(fd, data, off)
        if size is not None:
            os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    return expected_digest(pieces, size)


def expected_digest(pieces: dict[int, bytes], size: int | None = None) -> bytes:
    """The digest of a content holding *pieces* and zeros elsewhere,
    computed without any file."""
    end = max(off + len(data) for off, data in pieces.items())
    size = end if size is None else size
    blocks: dict[int, bytearray] = {}
    for off, data in pieces.items():
        for i, b in enumerate(data):
            k, r = divmod(off + i, datahash.BLOCK)
            blocks.setdefault(k, bytearray(min(datahash.BLOCK, size - k * datahash.BLOCK)))[r] = b
    d = datahash.Digest(size)
    for k in sorted(blocks):
        d.update(k * datahash.BLOCK, bytes(blocks[k]))
    return d.digest()


def wait_hashed_within(ws, pid: int, start: int, timeout: float = 120) -> dict:
    """Poll `cowfs check` until no removed file waits for its hash, failing
    as soon as the daemon has read more than BOUND since *start*."""
    deadline = time.monotonic() + timeout
    while True:
        _, res = check(ws)
        read = rchar(pid) - start
        assert read < BOUND, f"the daemon read {read} bytes hashing removed files"
        if res["graves_pending"] == 0:
            return res
        assert time.monotonic() < deadline, f"removed files still pending: {res}"
        time.sleep(0.05)


PIECES = {0: b"head of the file\n", 3 * TIB + 12345: b"in the middle", FAR: b"at 5 TiB"}


def test_a_removed_sparse_file_is_hashed_checked_and_rolled_back_by_what_it_holds(on_ext4_4k):
    """Two files of 5 TiB holding a few bytes are removed: the background
    pass hashes them, `cowfs check` verifies them and a rollback puts them
    back, reading kilobytes.  A bit flipped on the device beneath one of
    them (in its data at 3 TiB) is still found: check names it, the
    rollback skips it and puts the other back, sparse."""
    ws = on_ext4_4k
    digest = make_sparse(ws / "rotten", PIECES)
    assert make_sparse(ws / "sound", PIECES) == digest
    ws.mount()
    pid = ws.daemon_pid()
    assert pid is not None
    layer = ws.checkpoint("remove two huge sparse files")
    start = rchar(pid)
    os.unlink(ws / "rotten")
    os.unlink(ws / "sound")
    res = wait_hashed_within(ws, pid, start)
    assert res["ok"] and res["graves_hashed"] == 2
    start = rchar(pid)
    code, res = check(ws)  # mounted: the daemon verifies both hashes
    assert code == 0 and res["graves_hashed"] == 2
    assert rchar(pid) - start < BOUND
    ws.unmount()

    gids = graves(ws)
    store = Store.open(str(ws / ".cowfs"), str(ws.path), create=False, readonly=True)
    try:
        for name in (b"rotten", b"sound"):
            s = gravesum.read_sum(store, gids[name])
            assert s is not None and s.state == S.SUM_HASHED
            assert s.form == S.SUM_FORM_DATA and s.digest == digest
    finally:
        store.close()
    bitrot(ws, ws / ".cowfs" / "grave" / str(gids[b"rotten"]), 3 * TIB + 12345 + 3)
    code, res = check(ws)
    assert code == STORE_ERROR and not res["ok"]
    [p] = res["problems"]
    assert p["layers"] == [layer] and p["paths"] == ["rotten"]
    assert "rotten is corrupt in the store" in p["problem"]

    ws.mount()
    pid = ws.daemon_pid()
    assert pid is not None
    start = rchar(pid)
    r = ws.cowfs("rollback", check=False)
    assert rchar(pid) - start < BOUND
    assert r.returncode == PARTIAL
    assert "rotten: not restored: the removed file kept in the store is corrupt" in r.stderr
    assert not (ws / "rotten").exists()
    st = os.stat(ws / "sound")
    assert st.st_size == FAR + len(PIECES[FAR]) and st.st_blocks * 512 < 1 << 20
    fd = os.open(ws / "sound", os.O_RDONLY)
    try:
        for off, data in PIECES.items():
            assert os.pread(fd, len(data), off) == data
        assert datahash.of_file(fd) == digest
    finally:
        os.close(fd)


def test_grave_hashes_of_both_forms_verify_and_the_new_one_reads_only_data(tmp_path):
    """The pass records the data digest (form byte 1) of a removed file of
    5 TiB, reading what it holds (it is stopped after BOUND bytes
    otherwise); a hash entry an older cowfs wrote (xxh3-128 of every byte,
    no form byte) still verifies; a changed byte fails either."""
    root = tmp_path / "ws"
    root.mkdir()
    store = Store.open(str(root / ".cowfs"), str(root))
    try:
        huge = {7: b"new form", FAR: b"far away"}
        digest = make_sparse(root / "new", huge)
        st = os.stat(root / "new")
        with store.write() as w:
            new = w.new_grave(st.st_ino, st)
        os.link(root / "new", str(new), dst_dir_fd=store.grave_fd)
        pending = gravesum.read_sum(store, new)
        assert pending is not None and pending.state == S.SUM_PENDING
        start = rchar(os.getpid())
        done, raw = gravesum.hash_pending(
            store, new, pending, lambda: rchar(os.getpid()) - start > BOUND
        )
        assert done and raw is not None
        hashed = S.decode_sum(raw)
        assert hashed is not None and hashed.state == S.SUM_HASHED
        assert hashed.form == S.SUM_FORM_DATA and hashed.digest == digest
        assert len(raw) == len(S.encode_sum(pending)) + 17
        with store.write() as w:
            w.put_grave_sum(new, raw)
        start = rchar(os.getpid())
        assert gravesum.verify(store, new) is None
        assert rchar(os.getpid()) - start < BOUND

        pieces = {5: b"old form", (48 << 20) + 3: b"further on"}
        make_sparse(root / "old", pieces, size=64 << 20)
        st = os.stat(root / "old")
        with store.write() as w:
            old = w.new_grave(st.st_ino, st)
            os.link(root / "old", str(old), dst_dir_fd=store.grave_fd)
            with open(root / "old", "rb") as f:
                every_byte = xxhash.xxh3_128_digest(f.read())
            st = os.stat(root / "old")
            w.put_grave_sum(  # (as older cowfs encoded it: 16 bytes of digest, no form)
                old,
                b"h"
                + st.st_ino.to_bytes(8, "big")
                + st.st_size.to_bytes(8, "big")
                + st.st_mtime_ns.to_bytes(8, "big")
                + st.st_ctime_ns.to_bytes(8, "big")
                + every_byte,
            )
        s = gravesum.read_sum(store, old)
        assert s is not None and s.state == S.SUM_HASHED and s.form == S.SUM_FORM_ALL
        assert gravesum.verify(store, old) is None

        for gid, path, off in ((old, root / "old", (48 << 20) + 5), (new, root / "new", FAR + 1)):
            with open(path, "r+b") as f:
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ 1]))
            why = gravesum.verify(store, gid)
            assert why is not None and "do not hash to the digest taken" in why
    finally:
        store.close()


def test_the_commit_audit_hashes_sparse_files_by_what_they_hold(workspace):
    """At the "hashes" audit level a commit hashes both sides of a changed
    file of 5 TiB and of a new one: each sparse side gets the digest of
    what it holds (``xxh3_data``), and the commit reads kilobytes."""
    ws = workspace
    before = make_sparse(ws / "big", {0: b"first", FAR: b"last"})
    ws.mount()
    pid = ws.daemon_pid()
    assert pid is not None
    ws.checkpoint("change a huge sparse file, make another")
    with open(ws / "big", "r+b") as f:
        f.seek(2 * TIB)
        f.write(b"written in the layer")
    made = make_sparse(ws / "made", {3 * TIB: b"a new one"})
    start = rchar(pid)
    ws.commit()
    assert rchar(pid) - start < BOUND
    events = [json.loads(x) for x in ws.cowfs("audit", "--jsonl").stdout.splitlines()]
    changes = {e["path"]: e for e in events if e["event"] == "change"}
    big, new = changes["big"], changes["made"]
    assert big["before"]["sparse"] and big["after"]["sparse"]
    assert big["before"]["xxh3_data"] == before.hex()
    after = expected_digest({0: b"first", 2 * TIB: b"written in the layer", FAR: b"last"})
    assert big["after"]["xxh3_data"] == after.hex()
    assert new["kind"] == "A" and new["after"]["xxh3_data"] == made.hex()


CUT = 64 << 30  # (the old capture recorded a chunk per 64 KiB of it: a million)


def records(ws) -> int:
    return check(ws)[1]["records"]


def test_truncating_a_sparse_file_records_and_rolls_back_what_it_holds(workspace):
    """Truncating a sparse file away records what it held, not a record per
    chunk of its size; the rollback puts it back (sparse) and keeps for a
    redo only what the redo needs; likewise a file extended to TiBs in a
    layer, rolled back and redone.  Holes cut, grown, written and punched
    again in the same layer roll back and redo exactly."""
    ws = workspace
    pieces = {100: b"kept", CUT: b"the end"}
    digest = make_sparse(ws / "cut", pieces)
    (ws / "grown").write_bytes(b"small\n")
    make_sparse(ws / "mixed", {0: b"a" * 5000, 200_000: b"b" * 70_000, 700_000: b"c" * 9})
    mixed = (ws / "mixed").read_bytes()
    ws.mount()
    pid = ws.daemon_pid()
    assert pid is not None
    ws.checkpoint("truncate one, extend the other")
    base = records(ws)
    start = rchar(pid)
    os.truncate(ws / "cut", 0)
    assert records(ws) - base < 10
    with open(ws / "grown", "r+b") as f:
        f.seek(FAR)
        f.write(b"far out")
    assert records(ws) - base < 20
    # holes and data cut, grown, written and punched again in one layer
    fd = os.open(ws / "mixed", os.O_RDWR)
    try:
        os.ftruncate(fd, 300_000)
        os.ftruncate(fd, 2 << 20)
        os.pwrite(fd, b"d" * 3000, 500_000)  # (a hole when the layer was opened)
        B.punch_hole(fd, 150_000, 110_000)
        os.ftruncate(fd, 180_000)
        os.pwrite(fd, b"e" * 10, 900_000)
    finally:
        os.close(fd)
    changed = (ws / "mixed").read_bytes()
    ws.rollback()
    assert (ws / "mixed").read_bytes() == mixed
    assert rchar(pid) - start < BOUND
    fd = os.open(ws / "cut", os.O_RDONLY)
    try:
        assert datahash.of_file(fd) == digest and os.fstat(fd).st_blocks * 512 < 1 << 20
    finally:
        os.close(fd)
    assert (ws / "grown").read_bytes() == b"small\n"
    start = rchar(pid)
    ws.json("redo")
    assert rchar(pid) - start < BOUND
    assert os.stat(ws / "cut").st_size == 0
    assert (ws / "mixed").read_bytes() == changed
    st = os.stat(ws / "grown")
    assert st.st_size == FAR + 7 and st.st_blocks * 512 < 1 << 20
    with open(ws / "grown", "rb") as f:
        assert f.read(6) == b"small\n"
        f.seek(FAR)
        assert f.read() == b"far out"
    ws.rollback()
    assert (ws / "grown").read_bytes() == b"small\n"
    assert (ws / "mixed").read_bytes() == mixed
    fd = os.open(ws / "cut", os.O_RDONLY)
    try:
        assert datahash.of_file(fd) == digest
    finally:
        os.close(fd)


@pytest.mark.parametrize("commit", [True, False], ids=["committed", "two-layers"])
def test_holes_a_truncation_cut_read_as_holes_again_across_layers(workspace, commit):
    """A truncation in one layer records only the cut chunks that hold
    data; the next layer writes where the cut holes were, at or past the
    size it was opened with (so without capturing: its rollback cuts the
    file to that size first).  Rolled back to the first layer -- the two
    layers one after the other, or merged by a commit -- every file is as
    it was, holes and all, and redone and rolled back again likewise.
    (The merge kept only the lower layer's size record, so the upper
    layer's writes in the holes stayed: the crash soak's "kill while
    commit" trials that came out with a file's content changed.)"""
    ws = workspace
    C = 64 << 10  # (the store's chunk size)
    make_sparse(ws / "cut", {0: b"a" * C, 2 * C: b"c" * C})  # chunk 1 a hole
    make_sparse(ws / "through", {0: b"b" * 100, 3 * C: b"d" * 100})  # chunks 1, 2 holes
    make_sparse(ws / "ragged", {0: b"e" * 10, 2 * C: b"f" * 10})  # chunk 1 a hole
    ws.mount()
    first = ws.checkpoint("truncations")
    expected = ws.snapshot()
    # (sizes the crash soak's writers truncate to: 10, CHUNK - 1, ...)
    os.truncate(ws / "cut", 10)
    os.truncate(ws / "through", C - 1)
    os.truncate(ws / "ragged", C + 5)  # (the upper layer opens inside the hole)
    ws.checkpoint("writes in the holes")
    for name, off, data in (
        ("cut", C + 100, b"X" * 100),
        ("through", 2 * C - 3, b"Y" * (C + 7)),
        ("ragged", C + 1, b"Z" * 3),  # (before its size then: captured)
        ("ragged", C + 1000, b"W" * 100),
    ):
        fd = os.open(ws / name, os.O_WRONLY)
        try:
            os.pwrite(fd, data, off)
        finally:
            os.close(fd)
    changed = ws.snapshot()
    if commit:
        ws.commit()
    ws.rollback(first)
    assert treesnap.compare(expected, ws.snapshot()) == []
    ws.json("redo")
    assert treesnap.compare(changed, ws.snapshot()) == []
    ws.rollback(first)
    assert treesnap.compare(expected, ws.snapshot()) == []
