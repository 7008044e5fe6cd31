"""Hostile sizes cost what files hold, not the size an agent claims: a file
of TiBs holding a few bytes (sparse) is hashed when it is removed, verified
by `cowfs check` and a rollback, hashed by the commit's audit, truncated and
rolled back, by reading and recording what it holds.  Each test measures
what the daemon read (``rchar`` in /proc/PID/io: every byte a read or pread
returned, holes included), never how long anything took."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time

import pytest
import xxhash

from cowfs.errors import PARTIAL, STORE_ERROR
from cowfs.layers import treesnap
from cowfs.storage import datahash, gravesum
from cowfs.storage import schema as S
from cowfs.storage.store import Store
from cowfs.system import backing as B

from .helpers import COWFS
from .test_gravehash import bitrot, check, ext4_workspace, graves

TIB = 1 << 40
FAR = 5 * TIB  # ext4 with 4 KiB blocks takes files up to 16 TiB
BOUND = 64 << 20  # what any of these steps may read: a fraction of a TiB's zeros


@pytest.fixture
def on_ext4_4k(tmp_path, fuse):
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


# -- files written through passthrough: captured whole, by what they hold --------------

FEW = 40  # records a whole capture of these files may take (the old capture: ~80 million)


def tree(ws) -> dict:
    """The tree as these tests compare it, at a cost that follows what the
    files hold: every entry's kind, mode, owner, size, mtime, xattrs and
    links (treesnap, without content), and each regular file's digest of
    what it holds (``datahash``: data-aware, holes read as zeros) and
    whether it is still sparse (allocated: under 64 MiB)."""
    out = {}
    for rel, e in ws.snapshot(content=False).items():
        side: tuple = (e,)
        if e.kind == "file":
            fd = os.open(os.path.join(ws.path, os.fsdecode(rel)), os.O_RDONLY)
            try:
                side += (datahash.of_file(fd), os.fstat(fd).st_blocks * 512 < 64 << 20)
            finally:
                os.close(fd)
        out[rel] = side
    return out


def mount_with_sparse(ws, *names: str) -> int:
    """Make a sparse file of 5 TiB holding PIECES under each of *names*,
    mount (the kernel engine: passthrough) and return the daemon's pid."""
    for name in names:
        make_sparse(ws / name, PIECES)
    ws.mount("--engine", "kernel")
    pid = ws.daemon_pid()
    assert pid is not None
    return pid


def write_after_reader(ws, name: str, writes: dict[int, bytes]) -> None:
    """Open *name* for reading (passthrough), then for writing (passthrough
    too: captured whole first), write *writes* (offset -> bytes), close."""
    reader = os.open(ws / name, os.O_RDONLY)
    try:
        writer = os.open(ws / name, os.O_RDWR)
        try:
            for off, data in writes.items():
                os.pwrite(writer, data, off)
        finally:
            os.close(writer)
    finally:
        os.close(reader)


def written(ws) -> int:
    """WRITE requests the daemon has served (none reach it through passthrough)."""
    return ws.json("status")["engine"]["requests"].get("write", 0)


def test_a_far_sparse_file_open_through_passthrough_across_a_checkpoint_costs_what_it_holds(
    workspace,
):
    """A file made in a layer, written at 5 TiB through passthrough and
    kept open across a checkpoint, is captured whole by the checkpoint in a
    few records (a record per chunk that holds data, one per run of
    holes), reading what it holds.  The agent then writes into the holes,
    over its data and past its end: a rollback puts the tree back exactly
    (still sparse), a redo brings the writes back exactly, `diff` and
    `show` of it read what it holds, and `check` finds the store sound."""
    ws = workspace
    ws.mount("--engine", "kernel")
    pid = ws.daemon_pid()
    assert pid is not None
    ws.checkpoint("made")
    fd = os.open(ws / "far", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"head of the file\n", 0)
        os.pwrite(fd, b"in the middle", 3 * TIB + 12345)
        os.pwrite(fd, b"at 5 TiB", FAR)
        before = tree(ws)
        base, start = records(ws), rchar(pid)
        layer = ws.checkpoint("across")
        assert records(ws) - base < FEW
        assert rchar(pid) - start < BOUND
        sent = written(ws)
        os.pwrite(fd, b"into a hole", 2 * TIB)
        os.pwrite(fd, b"x" * 200_000, 10)  # over the head, across chunks
        os.pwrite(fd, b"over", 3 * TIB + 12340)
        os.pwrite(fd, b"past the end", FAR + 100_000)
        assert written(ws) == sent  # (all through passthrough: the daemon saw none)
    finally:
        os.close(fd)
    after = tree(ws)
    assert after != before

    start = rchar(pid)
    changes = ws.json("diff", "--", "far")
    assert [c["path"] for c in changes["changes"]] == ["far"]
    res = control_show(ws, layer, "far", 2 * TIB)
    assert res["size"] == FAR + 8 and not base64.b64decode(res["data"]).strip(b"\0")
    res = control_show(ws, layer, "far", 3 * TIB + 12288)
    assert base64.b64decode(res["data"])[57:70] == b"in the middle"
    assert rchar(pid) - start < BOUND
    code, res = check(ws)
    assert code == 0 and res["ok"], res

    start = rchar(pid)
    ws.rollback()
    assert tree(ws) == before
    ws.json("redo")
    assert tree(ws) == after
    assert rchar(pid) - start < BOUND
    code, res = check(ws)
    assert code == 0 and res["ok"], res
    ws.rollback(to=layer)
    assert tree(ws) == before


def control_show(ws, layer: int, path: str, offset: int) -> dict:
    """One page of `show` LAYER:PATH at *offset* (as the CLI asks for each)."""
    from cowfs.interface.api import Workspace

    return Workspace.attach(ws.path).call("show", layer=layer, path=path, offset=offset)


def test_a_writer_after_a_passthrough_reader_captures_a_sparse_file_by_what_it_holds(workspace):
    """A sparse file of 5 TiB that was there before the layer, opened for
    reading (passthrough: it is large) and then for writing: the writer
    gets passthrough too, the file captured whole first -- in a few
    records.  The writes roll back exactly and redo exactly."""
    ws = workspace
    pid = mount_with_sparse(ws, "big")
    ws.checkpoint("read, then write")
    before = tree(ws)
    base, start = records(ws), rchar(pid)
    reader = os.open(ws / "big", os.O_RDONLY)
    writer = -1
    try:
        writer = os.open(ws / "big", os.O_RDWR)
        assert records(ws) - base < FEW
        assert rchar(pid) - start < BOUND
        sent = written(ws)
        os.pwrite(writer, b"into a hole", TIB)
        os.pwrite(writer, b"over the head", 5)
        os.pwrite(writer, b"past the end", FAR + 1000)
        assert written(ws) == sent
    finally:
        os.close(reader)
        if writer >= 0:
            os.close(writer)
    after = tree(ws)
    ws.rollback()
    assert tree(ws) == before
    ws.json("redo")
    assert tree(ws) == after
    code, res = check(ws)
    assert code == 0 and res["ok"], res


def test_a_commit_merges_ranges_of_zeros_over_what_the_layer_below_recorded(workspace):
    """Two sparse files of 5 TiB: the first layer records some of their
    chunks (one through the daemon's own writes, one captured whole for a
    writer after a reader, then written), the second captures both whole
    (held open through passthrough across the checkpoint) and is written
    into.  The commit merging the second into the first costs the
    records, and a rollback of the merged layer puts back what the first
    layer started with, exactly; `check` finds the store sound."""
    ws = workspace
    pid = mount_with_sparse(ws, "some", "whole")
    first = ws.checkpoint("record some chunks")
    before = tree(ws)
    with open(ws / "some", "r+b") as f:  # (through the daemon: chunk by chunk)
        for off in (TIB, 3 * TIB + 12345 - 10, 2):
            f.seek(off)
            f.write(b"first layer")
    reader = os.open(ws / "some", os.O_RDONLY)
    readers = [reader, os.open(ws / "whole", os.O_RDONLY)]
    writers = []
    try:
        writers.append(os.open(ws / "whole", os.O_RDWR))  # (captured whole here)
        os.pwrite(writers[0], b"first layer", 4 * TIB + 3)
        # (its data at 3 TiB punched out: the second layer's range of
        # zeros from its head runs past the first one's)
        B.punch_hole(writers[0], 3 * TIB, 1 << 20)
        writers.append(os.open(ws / "some", os.O_RDWR))  # (captured whole: the rest)
        base = records(ws)
        ws.checkpoint("captured whole again")
        assert records(ws) - base < 2 * FEW
        for w in writers:
            os.pwrite(w, b"second layer", TIB + 70_000)
            os.pwrite(w, b"second layer", 4 * TIB)
            os.pwrite(w, b"second layer", 2 * TIB + 5)
            os.pwrite(w, b"second layer", 0)
    finally:
        for fd in readers + writers:
            os.close(fd)
    after = tree(ws)
    base, start = records(ws), rchar(pid)
    ws.commit()
    assert records(ws) <= base
    assert rchar(pid) - start < BOUND
    assert [layer["id"] for layer in ws.log()][-1] == first
    code, res = check(ws)
    assert code == 0 and res["ok"], res
    assert tree(ws) == after
    ws.rollback()
    assert tree(ws) == before


def test_check_finds_a_forged_range_of_zeros(workspace):
    """`check` names a CHUNK record whose range of zeros ends past any
    file's end (or that claims bytes longer than a chunk), and a rollback
    leaves that file as it is, reporting it, while it puts back the rest."""
    ws = workspace
    (ws / "small").write_bytes(b"small\n")
    mount_with_sparse(ws, "big")
    layer = ws.checkpoint("capture whole")
    write_after_reader(ws, "big", {TIB: b"written"})
    (ws / "small").write_bytes(b"changed\n")
    code, res = check(ws)
    assert code == 0 and res["ok"], res
    ws.unmount()
    store = Store.open(str(ws / ".cowfs"), str(ws.path), create=False)
    try:
        C = store.chunk_size
        ranges = [
            (seq, rec)
            for seq, rec in store.records(0, store.next_seq)
            if isinstance(rec, S.Chunk) and not rec.digest and rec.length > C
        ]
        assert ranges
        seq, rec = ranges[0]
        with store.write() as w:
            forged = rec._replace(length=(1 << 63) - rec.chunk * C + 1)
            w.txn.put(S.u64(seq), S.encode_record(forged), db=store.db_journal)
    finally:
        store.close()
    code, res = check(ws)
    assert code == STORE_ERROR and not res["ok"]
    [p] = res["problems"]
    assert f"record {seq} (chunk of big) is invalid" in p["problem"]
    assert p["layers"] == [layer] and p["paths"] == ["big"]
    ws.mount("--engine", "kernel")
    r = ws.cowfs("rollback", check=False)
    assert r.returncode == PARTIAL
    assert "big: not restored: its pre-image record is invalid" in r.stderr
    assert (ws / "small").read_bytes() == b"small\n"


def test_restore_puts_back_a_file_captured_whole_by_what_it_holds(workspace):
    """`cowfs restore` of a sparse file of 5 TiB captured whole (a writer
    after a passthrough reader) and written into its holes punches out
    what was written there and writes back what it held, reading and
    writing what it holds; the restore itself rolls back exactly."""
    ws = workspace
    pid = mount_with_sparse(ws, "big")
    layer = ws.checkpoint("write into the holes")
    before = tree(ws)
    write_after_reader(
        ws, "big", {TIB: b"into a hole", 3: b"over the head", 4 * TIB + 99: b"into another"}
    )
    after = tree(ws)
    start = rchar(pid)
    ws.cowfs("restore", "--from", str(layer), "big")
    assert rchar(pid) - start < BOUND
    restored = tree(ws)
    assert restored[b"big"][1:] == before[b"big"][1:] != after[b"big"][1:]  # (its mtime: now)
    ws.rollback()
    assert tree(ws) == before
    ws.json("redo")
    assert tree(ws) == restored


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
    was = {name: (ws / name).read_bytes() for name in ("cut", "through", "ragged")}
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
    # reading the past says the same: the holes held zeros then
    for name, data in was.items():
        shown = subprocess.run(
            [*COWFS, "-C", str(ws.path), "show", f"{first}:{name}"], capture_output=True, check=True
        ).stdout
        assert shown == data, name
        (old,) = ws.json("diff", str(first), "--", name)["changes"]
        assert old["old"]["xxh3"] == xxhash.xxh3_128_hexdigest(data), name
    ws.rollback(first)
    assert treesnap.compare(expected, ws.snapshot()) == []
    ws.json("redo")
    assert treesnap.compare(changed, ws.snapshot()) == []
    ws.rollback(first)
    assert treesnap.compare(expected, ws.snapshot()) == []


def test_restore_puts_back_as_holes_what_a_truncation_cut_and_a_later_layer_wrote(workspace):
    """As above, with `cowfs restore` of the same files (the very objects
    they held then): what `show` reads -- holes where the later layer
    wrote past the size it was opened with -- is what the restore puts
    back, not the later layer's bytes left in the holes."""
    ws = workspace
    C = 64 << 10
    make_sparse(ws / "cut", {0: b"a" * C, 2 * C: b"c" * C})
    make_sparse(ws / "far", {15 * C: b"t" * C})
    (ws / "void").touch()
    os.truncate(ws / "void", 16 * C)  # (no data: its truncation records no chunk)
    ws.mount()
    first = ws.checkpoint("truncations")
    was = {name: (ws / name).read_bytes() for name in ("cut", "far", "void")}
    os.truncate(ws / "cut", 10)
    os.truncate(ws / "far", 0)
    os.truncate(ws / "void", 0)
    ws.checkpoint("writes in the holes")
    for name, off, data in (
        ("cut", C + 100, b"X" * 100),
        ("cut", 2 * C, b"c" * C),
        ("far", 0, b"X" * C),
        ("far", 15 * C, b"u" * C),
        ("void", C, b"V" * 100),
    ):
        fd = os.open(ws / name, os.O_WRONLY)
        try:
            os.pwrite(fd, data, off)
        finally:
            os.close(fd)
    for name, data in was.items():
        shown = subprocess.run(
            [*COWFS, "-C", str(ws.path), "show", f"{first}:{name}"], capture_output=True, check=True
        ).stdout
        assert shown == data, name
    ws.cowfs("restore", "--from", str(first), "cut", "far", "void")
    for name, data in was.items():
        assert (ws / name).read_bytes() == data, name
    # what was written in the holes is punched out, not overwritten with zeros
    assert os.stat(ws / "far").st_blocks * 512 < 2 * C
    assert os.stat(ws / "void").st_blocks == 0
