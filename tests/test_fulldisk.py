"""A full disk under the store: every change that needs a record the store
cannot take fails with ENOSPC (never EIO) before it touches the tree; once
space is freed the same changes succeed without a remount, the store checks
consistent, and a rollback is exact.  On a small ext4 on a loop device,
filled to its last block."""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from cowfs.layers import treesnap

from .helpers import backing_dir, managed_workspace


@pytest.fixture
def small_ext4(tmp_path):
    """A 48 MiB ext4 on a loop device, always unmounted afterwards."""
    image, mp = tmp_path / "fs.img", tmp_path / "small"
    mp.mkdir()
    subprocess.run(["truncate", "-s", "48M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mp)], check=True)
    try:
        yield mp
    finally:
        subprocess.run(["umount", "-l", str(mp)], check=False)


def fill(root: Path) -> None:
    """Fill the filesystem at *root* to its last block."""
    for size in (1 << 20, 4096, 512):
        n = 0
        while True:
            try:
                with open(root / f"filler-{size}-{n}", "wb") as f:
                    while True:
                        f.write(b"\xff" * size)
                        f.flush()
                        os.fsync(f.fileno())
            except OSError as e:
                assert e.errno == errno.ENOSPC
                if n > 50:
                    break
                n += 1
                if size == (1 << 20):
                    break


def make_socket(path: str) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)


def changes(ws: Path) -> dict:
    """One change of each kind a capture guards, by name."""
    p = lambda name: str(ws / name)  # noqa: E731
    return {  # (in an order in which each one, carried out, leaves the next possible)
        "create": lambda: os.close(os.open(p("new"), os.O_CREAT | os.O_WRONLY, 0o644)),
        "mkdir": lambda: os.mkdir(p("newdir")),
        "mknod fifo": lambda: os.mkfifo(p("fifo")),
        "mknod socket": lambda: make_socket(p("sock")),
        "symlink": lambda: os.symlink("a.txt", p("sym")),
        "link": lambda: os.link(p("a.txt"), p("hard")),
        "chmod": lambda: os.chmod(p("a.txt"), 0o600),
        "chown": lambda: os.chown(p("a.txt"), 1234, 1234),
        "utime": lambda: os.utime(p("a.txt"), ns=(10**18, 10**18)),
        "write to an uncaptured chunk": lambda: write_at(p("big"), 300_000, b"changed"),
        "truncate": lambda: os.truncate(p("big"), 1000),
        "open O_TRUNC": lambda: os.close(os.open(p("big"), os.O_WRONLY | os.O_TRUNC)),
        "setxattr": lambda: os.setxattr(p("x.txt"), "user.new", b"1"),
        "removexattr": lambda: os.removexattr(p("x.txt"), "user.tag"),
        "rename": lambda: os.rename(p("a.txt"), p("moved.txt")),
        "rename over": lambda: os.rename(p("x.txt"), p("dir/b.txt")),
        "unlink": lambda: os.unlink(p("dir/b.txt")),
        "rmdir": lambda: os.rmdir(p("empty")),
    }


def write_at(path: str, off: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, off)
    finally:
        os.close(fd)


def test_a_full_disk_fails_each_change_with_enospc_before_it_touches_anything(small_ext4, fuse):
    with managed_workspace(small_ext4 / "ws") as ws:
        (ws / "a.txt").write_text("alpha\n")
        (ws / "x.txt").write_text("x\n")
        os.setxattr(ws / "x.txt", "user.tag", b"kept")
        (ws / "big").write_bytes(os.urandom(1 << 20))
        (ws / "dir").mkdir()
        (ws / "dir" / "b.txt").write_text("beta\n")
        (ws / "empty").mkdir()
        (ws / "burn").mkdir()
        for i in range(2000):
            (ws / "burn" / str(i)).write_text("")
        ws.mount()
        at_start = ws.snapshot()
        ws.checkpoint("before the disk filled up")
        fill(small_ext4)
        # what LMDB had free in its file is used up by captures that fit
        for i in range(2000):
            try:
                os.chmod(ws / "burn" / str(i), 0o600)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                break
        else:
            pytest.fail("the store never ran out of room")

        for name, change in changes(ws.path).items():
            before, underneath = ws.snapshot(), treesnap.snapshot(backing_dir(ws))
            with pytest.raises(OSError) as e:
                change()
            assert e.value.errno == errno.ENOSPC, (name, e.value)
            treesnap.assert_same(before, ws.snapshot())  # nothing half-done
            treesnap.assert_same(underneath, treesnap.snapshot(backing_dir(ws)))

        # a little room: captures fit until one is written in part (LMDB
        # calls a short write EIO); that one still fails with ENOSPC, before
        # the bytes it protects change
        for f in sorted(small_ext4.glob("filler-4096-*"))[:40]:
            f.unlink()
        big = (ws / "big").read_bytes()
        for k in range(len(big) // (64 << 10)):
            try:
                write_at(str(ws / "big"), k * (64 << 10) + 100, b"changed")
            except OSError as e:
                assert e.errno == errno.ENOSPC, (k, e)
                assert (ws / "big").read_bytes()[k * (64 << 10) :] == big[k * (64 << 10) :]
                break
        else:
            pytest.fail("every capture fitted")

        for f in small_ext4.glob("filler-*"):  # room again
            f.unlink()
        for change in changes(ws.path).values():
            change()  # no remount needed
        assert stat.S_IMODE(os.stat(ws / "moved.txt").st_mode) == 0o600
        assert ws.json("check")["ok"]
        ws.rollback()
        treesnap.assert_same(at_start, ws.snapshot())
        assert ws.json("check")["ok"]


def punch(path: Path) -> None:
    """Punch a hole over the whole file (its blocks are freed)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        fallocate = __import__("ctypes").CDLL(None, use_errno=True).fallocate
        size = os.fstat(fd).st_size
        assert fallocate(fd, 0x03, 0, __import__("ctypes").c_long(size)) == 0  # PUNCH_HOLE|KEEP
    finally:
        os.close(fd)


def fill_file(path: Path) -> None:
    """Write *path* until the disk is full."""
    with open(path, "ab") as f:
        try:
            while True:
                f.write(b"\xee" * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_a_rollback_on_a_full_disk_first_removes_what_the_layer_made(small_ext4, fuse):
    """The disk is full of a file the layer created (before the pre-images
    of a file it emptied): the rollback removes it first, then restores."""
    with managed_workspace(small_ext4 / "ws") as ws:
        (ws / "big").write_bytes(os.urandom(12 << 20))
        ws.mount()
        before = ws.snapshot()
        ws.checkpoint()
        os.close(os.open(ws / "filler", os.O_CREAT | os.O_WRONLY, 0o644))  # made first
        punch(ws / "big")
        fill_file(ws / "filler")  # then it fills the disk
        fill(small_ext4)
        r = ws.cowfs("rollback", "--no-redo", check=False)
        assert r.returncode == 0, r.stderr
        treesnap.assert_same(before, ws.snapshot())
        assert ws.json("check")["ok"]


@pytest.mark.parametrize(
    "redo, killed",
    [(True, False), (False, False), (False, True)],
    ids=["keeping redo", "no redo", "no redo, daemon killed after"],
)
def test_a_rollback_on_a_full_disk_stops_keeps_everything_and_the_same_command_finishes(
    small_ext4, redo, killed, fuse
):
    """*killed*: what the stopped rollback kept is in the store for good --
    the daemon is killed (no clean unmount) right after it stopped and the
    workspace mounted again before the same command finishes the job."""
    with managed_workspace(small_ext4 / "ws") as ws:
        (ws / "big").write_bytes(os.urandom(12 << 20))
        (ws / "keep.txt").write_text("kept\n")
        ws.mount()
        before = ws.snapshot()
        layer = ws.checkpoint()
        (ws / "keep.txt").write_text("changed\n")
        (ws / "new.txt").write_text("new\n")
        punch(ws / "big")
        fill(small_ext4)  # full, of files outside the workspace
        command = ["rollback", "--to", str(layer)] + ([] if redo else ["--no-redo"])
        r = ws.cowfs(*command, check=False)
        assert r.returncode == 10, r.stderr
        assert "rollback did not finish" in r.stderr and "No space left" in r.stderr
        assert "of free space" in r.stderr and "run the same command again" in r.stderr
        assert "Traceback" not in r.stderr
        # what it could not undo is still in the store, and the layer is still there
        assert [entry["id"] for entry in ws.json("log")][-1] == layer
        assert ws.json("check")["ok"]
        assert ws.json("status")["redo"]["available"] is False
        if killed:
            ws.kill()
            ws.mount()
            assert [entry["id"] for entry in ws.json("log")][-1] == layer
            assert ws.json("check")["ok"]
        # the agent goes on meanwhile: what it changes is undone too
        (ws / "keep.txt").write_text("meanwhile\n")
        for f in small_ext4.glob("filler-*"):  # room again
            f.unlink()
        ws.cowfs(*command)
        treesnap.assert_same(before, ws.snapshot())
        assert ws.json("check")["ok"]
        assert layer not in [entry["id"] for entry in ws.json("log")]


@pytest.mark.parametrize("give_up", [False, True], ids=["finish", "give-up"])
def test_a_step_that_fails_keeps_its_record_until_the_same_command_takes_it(
    tmp_path, give_up, fuse
):
    """An undo step that fails for a cause that is no full disk (here: the
    file the layer made is immutable, so removing it fails with EPERM even
    for root) is named, the other steps are taken, and the failed step's
    record stays with its layer -- the same command, once the cause is
    gone, takes it and the tree is as it was; or ``--skip-damaged`` gives
    it up and drops the layer, leaving the file."""
    with managed_workspace(tmp_path / "ws") as ws:
        (ws / "keep.txt").write_text("kept\n")
        ws.mount()
        before = ws.snapshot()
        layer = ws.checkpoint()
        (ws / "keep.txt").write_text("changed\n")
        (ws / "new.txt").write_text("new\n")
        stuck = backing_dir(ws) / "new.txt"
        subprocess.run(["chattr", "+i", str(stuck)], check=True)
        try:
            command = ["rollback", "--to", str(layer)]
            r = ws.cowfs(*command, check=False)
            assert r.returncode == 10, r.stderr
            assert "new.txt" in r.stderr and "Operation not permitted" in r.stderr
            assert "Traceback" not in r.stderr
            assert (ws / "keep.txt").read_text() == "kept\n"  # (the other steps were taken)
            assert [entry["id"] for entry in ws.json("log")][-1] == layer
            assert ws.json("check")["ok"]
            if give_up:
                ws.cowfs(*command, "--skip-damaged", check=False)
                assert layer not in [entry["id"] for entry in ws.json("log")]
                assert (ws / "new.txt").read_text() == "new\n"
                assert ws.json("check")["ok"]
                return
        finally:
            subprocess.run(["chattr", "-i", str(stuck)], check=False)
        ws.cowfs(*command)
        treesnap.assert_same(before, ws.snapshot())
        assert layer not in [entry["id"] for entry in ws.json("log")]
        assert ws.json("check")["ok"]
