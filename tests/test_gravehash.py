"""Removed files kept whole in the grave are hashed (xxh3-128) off the
request path, by the daemon's background pass: a flipped byte in one is
found by `cowfs check` (layer and path named, exit 6) and a rollback skips
that file, restores everything else exactly and exits 10; a redo likewise.
A file changed in the grave — legitimately, through a descriptor kept open
or another name, or not — is never blessed with a hash of the changed
bytes; stores without hashes (older cowfs, or a kill -9 before the pass)
are verified by identity and roll back as before."""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import struct
import subprocess
import time
from collections.abc import Iterator

import lmdb
import pytest

from cowfs.errors import PARTIAL, STORE_ERROR
from cowfs.layers import redo, treesnap
from cowfs.storage import gravesum
from cowfs.storage import schema as S
from cowfs.storage.store import Store

from .helpers import Workspace, managed_workspace

CHUNK = 64 << 10
FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 1
PAGE = 4096


@contextlib.contextmanager
def ext4_workspace(tmp_path, *mkfs: str) -> Iterator[Workspace]:
    """An empty, unmounted workspace on an ext4 of its own (a loop device;
    *mkfs*: options for mkfs.ext4), so that a test can change bytes on the
    device beneath a file: bit rot, which changes no size, mtime or ctime."""
    image, fs = tmp_path / "ext4.img", tmp_path / "fs"
    fs.mkdir()
    with open(image, "wb") as f:
        f.truncate(256 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", *mkfs, str(image)], check=True)
    dev = subprocess.run(
        ["losetup", "-f", "--show", str(image)], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        subprocess.run(["mount", dev, str(fs)], check=True)
        try:
            with managed_workspace(fs / "ws") as ws:
                ws.device = dev
                yield ws
        finally:
            if subprocess.run(["umount", str(fs)]).returncode != 0:
                subprocess.run(["umount", "-l", str(fs)])
    finally:
        subprocess.run(["losetup", "-d", dev])


@pytest.fixture
def on_ext4(tmp_path, fuse):
    """An empty, unmounted workspace on an ext4 of its own (see
    ``ext4_workspace``)."""
    with ext4_workspace(tmp_path) as ws:
        yield ws


def bitrot(ws, path, offset: int) -> None:
    """Flip one bit of *path* at *offset* on the device beneath it: what a
    failing disk does.  Its stat stays exactly as it was."""
    st = os.stat(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(struct.pack("=QQIIII", offset, 1, FIEMAP_FLAG_SYNC, 0, 1, 0) + bytes(56))
        fcntl.ioctl(fd, FS_IOC_FIEMAP, buf)
        assert struct.unpack_from("=I", buf, 20)[0] == 1, "no extent there"
        logical, physical = struct.unpack_from("=QQ", buf, 32)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    where = physical + offset - logical
    dev = os.open(ws.device, os.O_RDWR | os.O_DIRECT)
    try:
        page = mmap.mmap(-1, PAGE)  # (aligned, as O_DIRECT wants)
        os.preadv(dev, [page], where - where % PAGE)
        page[where % PAGE] ^= 0x01
        os.pwritev(dev, [page], where - where % PAGE)
    finally:
        os.close(dev)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # (read from the device again)
        assert os.pread(fd, 1, offset)[0] == page[where % PAGE]  # the file has it now
    finally:
        os.close(fd)
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == (
        st.st_size,
        st.st_mtime_ns,
        st.st_ctime_ns,
    )


def check(ws) -> tuple[int, dict]:
    r = ws.cowfs("--json", "check", check=False)
    return r.returncode, json.loads(r.stdout)


def wait_hashed(ws, timeout: float = 120) -> dict:
    """Poll `cowfs check` until the background pass has no removed file
    left to hash; returns that check's result."""
    deadline = time.monotonic() + timeout
    while True:
        _, res = check(ws)
        if res["graves_pending"] == 0:
            return res
        assert time.monotonic() < deadline, f"removed files still pending: {res}"
        time.sleep(0.05)


def graves(ws) -> dict[bytes, int]:
    """Workspace path -> grave id of every removed object the store keeps
    (GRAVE records, and files a rollback kept for a redo); unmounted."""
    store = Store.open(str(ws / ".cowfs"), str(ws.path), create=False, readonly=True)
    try:
        out = {
            rec.path: rec.grave
            for _, rec in store.records(0, store.next_seq)
            if isinstance(rec, S.Grave)
        }
        with store.read() as txn:
            for kind, rec in redo.references(store, txn):
                held = redo.held_grave(kind, rec)
                if held is not None and isinstance(rec, S.Rename) and kind == S.REDO_INVERSE:
                    out[rec.src] = held[0]
        return out
    finally:
        store.close()


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def without(snap: treesnap.Snapshot, *paths: bytes) -> treesnap.Snapshot:
    return treesnap.Snapshot({k: v for k, v in snap.items() if k not in paths})


def rm_rf(*paths) -> None:
    subprocess.run(["rm", "-rf", *map(str, paths)], check=True)


def hashed_all(res: dict) -> bool:
    """Every regular file make_tree's src/ and big.bin hold was hashed in
    the grave: 40 + empty + data.bin + big.bin, and the hard-linked file
    once more under its second name.  (Its first grave entry is marked
    changed instead if the pass reached it only after the second removal
    had changed the inode's ctime, and a second had passed.)"""
    return res["graves_hashed"] + min(res["graves_changed"], 1) == 44


def make_tree(root) -> None:
    """Files of many sizes (empty, small, multi-chunk, several MiB) in
    nested directories, a symlink, a hard link pair, a fifo."""
    (root / "src" / "pkg" / "sub").mkdir(parents=True)
    for i in range(40):
        (root / "src" / "pkg" / f"m{i}.py").write_text(f"value = {i}\n" * (i + 1))
    (root / "src" / "pkg" / "sub" / "empty").write_bytes(b"")
    (root / "src" / "data.bin").write_bytes(os.urandom(3 * CHUNK + 123))
    (root / "big.bin").write_bytes(os.urandom(5 << 20))
    os.symlink("pkg/m1.py", root / "src" / "link")
    os.link(root / "src" / "pkg" / "m2.py", root / "src" / "hard")
    os.mkfifo(root / "src" / "fifo")
    (root / "keep.txt").write_text("kept\n")


def mounted_tree(ws) -> tuple[int, treesnap.Snapshot]:
    """make_tree in *ws*, mounted, a layer opened: (its id, the tree then)."""
    make_tree(ws.path)
    ws.mount()
    layer = ws.checkpoint("remove a tree")
    return layer, ws.snapshot()


def test_bit_rot_in_a_removed_file_is_found_and_the_rollback_skips_only_it(on_ext4):
    ws = on_ext4
    layer, before = mounted_tree(ws)
    rm_rf(ws / "src", ws / "big.bin")
    (ws / "keep.txt").write_text("changed\n")
    (ws / "new.txt").write_text("new\n")
    assert not (ws / "src").exists() and not (ws / "big.bin").exists()
    res = wait_hashed(ws)
    assert res["ok"] and hashed_all(res)
    ws.unmount()

    gid = graves(ws)[b"big.bin"]
    bitrot(ws, ws / ".cowfs" / "grave" / str(gid), 3_000_000)
    code, res = check(ws)
    assert code == STORE_ERROR and not res["ok"]
    [p] = res["problems"]
    assert p["layers"] == [layer] and p["paths"] == ["big.bin"] and not p["repairable"]
    assert "big.bin is corrupt in the store" in p["problem"]
    r = ws.cowfs("check", "--repair", "--yes", check=False)  # no data is invented
    assert r.returncode == STORE_ERROR and "nothing here can be repaired" in r.stdout

    ws.mount()
    r = ws.cowfs("rollback", check=False)
    assert r.returncode == PARTIAL
    assert "big.bin: not restored: the removed file kept in the store is corrupt" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 2  # the heading and big.bin
    treesnap.assert_same(without(before, b"big.bin"), ws.snapshot())
    assert not (ws / "big.bin").exists()


def test_removed_files_written_afterwards_keep_no_stale_hash(workspace):
    """A removed file written through a descriptor kept open, and a hard
    link written through its other name after the removed name was hashed,
    change legitimately: their hashes are dropped before the bytes change,
    the check stays clean and the rollback is exact."""
    ws = workspace
    (ws / "open.bin").write_bytes(os.urandom(2 * CHUNK))
    (ws / "a").write_bytes(os.urandom(3 * CHUNK))
    os.link(ws / "a", ws / "b")
    ws.mount()
    ws.checkpoint("write removed files")
    before = ws.snapshot()
    os.unlink(ws / "b")
    assert wait_hashed(ws)["graves_hashed"] == 1  # b, hashed in the grave
    with open(ws / "a", "r+b") as f:  # the same object
        f.seek(CHUNK + 5)
        f.write(b"through the other name")
    with open(ws / "open.bin", "r+b") as f:
        os.unlink(ws / "open.bin")
        f.seek(10)
        f.write(b"after the removal")
        f.truncate(CHUNK + 7)
    res = wait_hashed(ws)
    assert res["ok"] and res["graves_hashed"] == 0 and res["graves_changed"] == 2
    ws.unmount()  # (and through a remount)
    code, res = check(ws)
    assert code == 0 and res["graves_changed"] == 2
    ws.mount()
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def test_a_file_changed_in_the_grave_before_it_was_hashed_is_never_blessed(workspace):
    """A removed file still open is hashed once closed; kill -9 first, then
    a byte changed in its grave copy: the next mount's pass sees that it is
    not the file that was removed and records no hash (verified by identity
    only, as before hashes existed)."""
    ws = workspace
    (ws / "f.bin").write_bytes(os.urandom(3 * CHUNK))
    (ws / "g.bin").write_bytes(os.urandom(3 * CHUNK))
    ws.mount()
    ws.checkpoint("remove")
    f = open(ws / "f.bin", "rb")
    try:
        os.unlink(ws / "f.bin")
        os.unlink(ws / "g.bin")
        res = wait_hashed_except(ws, pending=1)  # f is open: not yet
        assert res["graves_hashed"] == 1
        ws.kill()
    finally:
        try:
            f.close()
        except OSError:
            pass
    ws.cowfs("status")  # offline: clears the dead mount
    code, res = check(ws)  # the file left pending: identity only
    assert code == 0 and res["graves_pending"] == 1
    gid = graves(ws)[b"f.bin"]
    flip(ws / ".cowfs" / "grave" / str(gid), 100)
    ws.mount()
    res = wait_hashed(ws)
    assert res["ok"] and res["graves_hashed"] == 1 and res["graves_changed"] == 1


def wait_hashed_except(ws, pending: int, timeout: float = 120) -> dict:
    """Poll until exactly *pending* removed files are left unhashed (those
    held open) and the pass is done with the rest."""
    deadline = time.monotonic() + timeout
    while True:
        _, res = check(ws)
        if res["graves_pending"] == pending:
            return res
        assert res["graves_pending"] > pending and time.monotonic() < deadline, res
        time.sleep(0.05)


def test_kill_9_with_unhashed_removed_files_then_remount_and_rollback_is_exact(workspace):
    ws = workspace
    _, before = mounted_tree(ws)
    held = [open(ws / "src" / "pkg" / f"m{i}.py", "rb") for i in range(10, 15)]
    try:
        rm_rf(ws / "src", ws / "big.bin")
        wait_hashed_except(ws, pending=5)
        ws.kill()
    finally:
        for f in held:
            try:
                f.close()
            except OSError:
                pass
    ws.mount()  # clears the dead mount
    res = wait_hashed(ws)  # the new pass hashes what was left
    assert res["ok"] and hashed_all(res)
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def test_a_store_from_before_hashes_is_verified_by_identity_and_rolls_back(workspace):
    ws = workspace
    layer, before = mounted_tree(ws)
    rm_rf(ws / "src")
    ws.unmount()
    env = lmdb.open(str(ws / ".cowfs" / "db"), max_dbs=16, subdir=True)
    try:  # as older cowfs made it: no hash database
        with env.begin(write=True) as txn:
            txn.drop(env.open_db(S.DB_GRAVESUMS, txn=txn), delete=True)
    finally:
        env.close()
    code, res = check(ws)  # read-only: the database is absent
    assert code == 0 and res["graves_hashed"] == 0 and res["graves"] > 40
    ws.mount()
    second = ws.checkpoint("remove more")
    os.unlink(ws / "big.bin")  # removed by this cowfs: hashed
    res = wait_hashed(ws)
    assert res["ok"] and res["graves_hashed"] == 1
    ws.rollback(to=layer)
    assert second > layer
    treesnap.assert_same(before, ws.snapshot())
    assert check(ws)[0] == 0


def test_redo_skips_a_kept_file_that_is_corrupt_and_keeps_hashes_through_redo(on_ext4):
    """(A change of a kept file that shows in its stat refuses the redo
    before anything happens: see test_redo.py.  Bit rot shows only in the
    bytes.)"""
    ws = on_ext4
    (ws / "old.bin").write_bytes(os.urandom(2 * CHUNK))
    ws.mount()
    ws.checkpoint("make and remove")
    start = ws.snapshot()
    (ws / "made.bin").write_bytes(os.urandom(2 * CHUNK))  # kept in the grave for a redo
    (ws / "other.txt").write_text("other\n")
    os.unlink(ws / "old.bin")  # removed: a GRAVE
    done = ws.snapshot()
    assert wait_hashed(ws)["graves_hashed"] == 1
    ws.rollback()
    treesnap.assert_same(start, ws.snapshot())
    res = wait_hashed(ws)  # made.bin and other.txt, kept for the redo
    assert res["ok"] and res["graves_hashed"] == 2
    ws.json("redo")  # old.bin goes back into the grave
    treesnap.assert_same(done, ws.snapshot())
    res = wait_hashed(ws)
    assert res["ok"] and res["graves_hashed"] == 1
    ws.rollback()
    treesnap.assert_same(start, ws.snapshot())
    ws.unmount()  # the redo is kept across a remount

    gid = graves(ws)[b"made.bin"]
    bitrot(ws, ws / ".cowfs" / "grave" / str(gid), 5)
    code, res = check(ws)
    assert code == STORE_ERROR and [p["paths"] for p in res["problems"]] == [
        ["made.bin (kept for a redo)"]
    ]
    ws.mount()
    r = ws.cowfs("redo", check=False)
    assert r.returncode == PARTIAL
    assert "made.bin: not redone: the file kept in the store is corrupt" in r.stderr
    treesnap.assert_same(without(done, b"made.bin"), ws.snapshot())


def test_removed_files_are_hashed_while_requests_never_pause(workspace):
    """Files removed while requests keep coming are hashed once they have
    waited long enough (the pass does not wait for a pause for ever), and
    those still open are passed over without holding up the others."""
    ws = workspace
    mounted_tree(ws)
    held = [open(ws / "src" / "pkg" / f"m{i}.py", "rb") for i in range(10, 13)]
    try:
        rm_rf(ws / "src", ws / "big.bin")
        deadline = time.monotonic() + 60
        while True:
            for i in range(25):  # a request every few ms, no pause
                os.chmod(ws / "keep.txt", 0o600 if i % 2 else 0o644)  # (SETATTR: never cached)
                time.sleep(0.002)
            _, res = check(ws)
            if res["graves_pending"] == len(held):
                break
            assert res["graves_pending"] > len(held) and time.monotonic() < deadline, res
    finally:
        for f in held:
            f.close()
    res = wait_hashed(ws)
    assert res["ok"] and hashed_all(res)


def test_a_hash_read_before_a_rollback_changed_the_file_is_not_recorded(tmp_path):
    """The pass reads a grave file in a worker thread and records its hash
    afterwards, on the daemon's thread.  A rollback may run in between (on
    that thread, file requests held off, so nothing marks the entry): it
    changes a hard-linked file through its other name and sets its mtime
    back.  What is recorded then is no hash -- a redo would find the bytes
    changed and leave the file out -- but a change; a file left alone is
    hashed."""
    root = tmp_path / "ws"
    root.mkdir()
    store = Store.open(str(root / ".cowfs"), str(root))
    try:
        gids = {}
        for name in ("linked", "alone"):
            (root / name).write_bytes(os.urandom(3 * CHUNK))
            st = os.stat(root / name)
            with store.write() as w:
                gids[name] = w.new_grave(st.st_ino, st)
            os.link(root / name, str(gids[name]), dst_dir_fd=store.grave_fd)
        hasher = gravesum.Hasher(store)
        results = hasher._hash(hasher._batch(everything=True), everything=True)
        assert [S.decode_sum(new).state for _, _, new in results] == [S.SUM_HASHED] * 2
        st = os.stat(root / "linked")
        with open(root / "linked", "r+b") as f:  # (the rollback's undo step)
            f.write(b"the bytes before the layer")
        os.utime(root / "linked", ns=(st.st_atime_ns, st.st_mtime_ns))
        hasher._record(results)
        linked = gravesum.read_sum(store, gids["linked"])
        assert linked is not None and linked.state == S.SUM_CHANGED
        assert gravesum.verify(store, gids["linked"]) is None  # (by identity only)
        alone = gravesum.read_sum(store, gids["alone"])
        assert alone is not None and alone.state == S.SUM_HASHED
        assert gravesum.verify(store, gids["alone"]) is None
    finally:
        store.close()


def test_hashing_waits_while_a_control_operation_runs(tmp_path):
    """A rollback or redo runs on the daemon's thread: a hash pass in a
    worker thread meanwhile would take turns with it at every system call.
    While one runs, the pass takes nothing and stops before the next file,
    however long the files have waited; the unmount's drain does not wait."""
    root = tmp_path / "ws"
    root.mkdir()
    store = Store.open(str(root / ".cowfs"), str(root))
    try:
        for name in ("a", "b"):
            (root / name).write_bytes(os.urandom(CHUNK))
            st = os.stat(root / name)
            with store.write() as w:
                gid = w.new_grave(st.st_ino, st)
            os.link(root / name, str(gid), dst_dir_fd=store.grave_fd)
        operating = [True]
        hasher = gravesum.Hasher(store, quiet=lambda: 60.0, operating=lambda: operating[0])
        assert hasher._batch() == []
        batch = hasher._batch(everything=True)
        assert len(batch) == 2 and hasher._hash(batch) == []
        operating[0] = False
        assert hasher._batch() == batch
        assert [S.decode_sum(new).state for _, _, new in hasher._hash(batch)] == [S.SUM_HASHED] * 2
        operating[0] = True
        assert len(hasher._hash(batch, everything=True)) == 2  # (the drain)
    finally:
        store.close()
