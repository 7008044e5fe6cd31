"""A workspace whose directory is on an overlay filesystem (a container's
root filesystem, or a fork: cowfs over an overlay whose lower is frozen).

The objects of the lower layer are served through the overlay: reads of
large files go through FUSE passthrough to overlay files (the mount must
say it stacks 2 deep), the overlay numbers lower objects with the layer in
the top bits when the layers are on different filesystems (records hold
integers past 2**63), and each mount of the overlay gets a new device
number (the store knows its workspace again by inode number and file
handle).  Every test compares whole trees before and after.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cowfs.layers import treesnap

from .helpers import Overlay, Workspace, mount, run, unmount_all

pytestmark = pytest.mark.usefixtures("each_engine")

BIG = 1 << 20  # (passthrough serves files from 256 KiB on)


@contextlib.contextmanager
def overlay_over(base: Path, lower_on: str) -> Iterator[Overlay]:
    """An overlay whose lower is on *lower_on*: "same" (the upper's
    filesystem, as a container's image layers are), "tmpfs" (another
    filesystem: lower objects are numbered past 2**63), or "overlay" (the
    lower is itself an overlay: the mount is as deep as the kernel
    allows, and nothing can pass through to its files)."""
    lower = base / "lower"
    lower.mkdir()
    held: list[Path] = []
    try:
        if lower_on == "tmpfs":
            mount("-t", "tmpfs", "-o", "mode=0755", "cowfs-test", str(lower))
            held.append(lower)
        elif lower_on == "overlay":
            inner = overlay_over_parts(base / "inner")
            held.append(inner.merged)
            lower = inner.merged
        ov = Overlay(base, lower)
        populate(lower / "ws")
        (lower / "other").mkdir()
        ov.mount()
        held.append(ov.merged)
        yield ov
    finally:
        for path in reversed(held):
            unmount_all(path)


def overlay_over_parts(base: Path) -> Overlay:
    base.mkdir()
    (base / "lower").mkdir()
    ov = Overlay(base, base / "lower")
    ov.mount()
    return ov


def populate(root: Path) -> None:
    """A tree with what an overlay copies up in its own ways: hard links,
    a symlink, xattrs, large and sparse files, nested and empty
    directories, explicit times and modes."""
    root.mkdir(parents=True)
    (root / "src").mkdir()
    (root / "src" / "a.txt").write_text("alpha\n")
    os.link(root / "src" / "a.txt", root / "src" / "a.hard")
    (root / "src" / "b.txt").write_text("beta\n")
    os.symlink("a.txt", root / "src" / "link")
    os.setxattr(root / "src" / "b.txt", "user.color", b"blue")
    (root / "big.bin").write_bytes(os.urandom(BIG))
    (root / "mid.bin").write_bytes(os.urandom(300 * 1024))
    with open(root / "sparse.bin", "wb") as f:
        f.truncate(64 << 20)
        f.seek(32 << 20)
        f.write(b"middle")
    (root / "deep" / "er" / "est").mkdir(parents=True)
    (root / "deep" / "er" / "est" / "f").write_text("deep\n")
    (root / "empty").mkdir()
    os.chmod(root / "src" / "b.txt", 0o640)
    for i, rel in enumerate(["src/a.txt", "src/b.txt", "big.bin", "deep/er", "src"]):
        os.utime(root / rel, ns=(10**18 + i, 10**18 + i * 1_000_001))


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def workspace_on(ov: Overlay) -> Iterator[Workspace]:
    """The workspace merged/ws, its store beside it on the overlay, always
    unmounted afterwards."""
    ws = Workspace(ov.merged / "ws")
    ws.store = ov.merged / "store"
    try:
        yield ws
    finally:
        ws.teardown()
    errors = ws.daemon_errors()
    assert not errors, "the daemon logged errors:\n" + "\n".join(errors)


def work_on_lower_objects(ws: Path) -> None:
    """Changes to objects of the lower layer, each copied up its own way."""
    with open(ws / "src" / "a.hard", "a") as f:  # data, through the second name
        f.write("more\n")
    with open(ws / "big.bin", "r+b") as f:  # a write inside a large file
        f.seek(300_000)
        f.write(b"X" * 10_000)
    with open(ws / "mid.bin", "wb"):  # O_TRUNC
        pass
    with open(ws / "sparse.bin", "r+b") as f:
        f.seek(50 << 20)
        f.write(b"late")
    os.chmod(ws / "src" / "b.txt", 0o600)  # metadata only
    os.setxattr(ws / "src" / "b.txt", "user.color", b"red")
    os.rename(ws / "deep", ws / "deeper")  # a lower directory
    os.unlink(ws / "src" / "link")
    os.symlink("b.txt", ws / "src" / "link")
    os.link(ws / "src" / "b.txt", ws / "b.again")
    (ws / "new").mkdir()
    (ws / "new" / "file").write_text("new\n")
    os.rmdir(ws / "empty")
    os.truncate(ws / "deeper" / "er" / "est" / "f", 2)
    os.rename(ws / "src" / "b.txt", ws / "src" / "a.txt")  # over a hard-linked name


@pytest.mark.parametrize("lower_on", ["same", "tmpfs"])
def test_a_workspace_on_an_overlay_reads_its_files_and_rolls_back_exactly(tmp_path, fuse, lower_on):
    with overlay_over(tmp_path, lower_on) as ov, workspace_on(ov) as ws:
        lower_ws = ov.lower / "ws"
        ws.mount("--store", ws.store)
        if lower_on == "tmpfs":
            assert os.stat(ws / "big.bin").st_ino >= 1 << 63  # (what records must hold)
        # read through passthrough (large files) and through the daemon
        assert md5(ws / "big.bin") == md5(lower_ws / "big.bin")
        assert md5(ws / "mid.bin") == md5(lower_ws / "mid.bin")
        assert (ws / "src" / "a.hard").read_text() == "alpha\n"
        before = ws.snapshot()
        layer = ws.checkpoint("work")
        work_on_lower_objects(ws.path)
        assert md5(ws / "big.bin") != md5(lower_ws / "big.bin")
        assert (ws / "src" / "a.txt").read_text() == "beta\n"
        changed = {c["path"] for c in ws.status()}
        assert {"big.bin", "mid.bin", "src/a.txt", "new/file", "deeper/er/est/f"} <= changed
        ws.rollback(layer)
        assert treesnap.compare(before, ws.snapshot()) == []
        # the lower layer was never written
        assert md5(lower_ws / "big.bin") == md5(ov.merged / "ws" / "big.bin")
        # and the same again after the daemon lets go of every object
        ws.unmount()
        ws.mount("--store", ws.store)
        assert treesnap.compare(before, ws.snapshot()) == []


def test_the_store_knows_its_workspace_when_the_overlay_comes_back_on_another_device(
    tmp_path, fuse
):
    with overlay_over(tmp_path, "tmpfs") as ov, workspace_on(ov) as ws:
        ws.mount("--store", ws.store)
        before = ws.snapshot()
        layer = ws.checkpoint("work")
        work_on_lower_objects(ws.path)
        ws.unmount()
        old_dev = os.stat(ws.path).st_dev
        ov.unmount()
        # (a mount made meanwhile takes the freed device number)
        placeholder = tmp_path / "placeholder"
        placeholder.mkdir()
        mount("-t", "tmpfs", "cowfs-test", str(placeholder))
        try:
            ov.mount()
            assert os.stat(ws.path).st_dev != old_dev
            ws.mount("--store", ws.store)
            assert [row["id"] for row in ws.log()] == [1, layer]
            ws.rollback(layer)
            assert treesnap.compare(before, ws.snapshot()) == []
            ws.unmount()
            # another directory of the same overlay is not its workspace
            r = run("-C", ov.merged / "other", "--store", ws.store, "status", check=False)
            assert r.returncode != 0 and "belongs to another workspace" in r.stderr, r.stderr
        finally:
            ov.unmount()
            unmount_all(placeholder)
            ov.mount()  # (for the fixtures' teardown, which unmounts it)


def test_a_file_the_kernel_will_not_pass_through_is_served_by_the_daemon(tmp_path, fuse):
    """On an overlay over an overlay the kernel refuses passthrough (the
    stack would be 3 deep): the open is served through the daemon, the
    program never sees the refusal, and its writes are captured."""
    with overlay_over(tmp_path, "overlay") as ov, workspace_on(ov) as ws:
        ws.mount("--store", ws.store)
        expected = md5(ov.lower / "ws" / "big.bin")
        assert md5(ws / "big.bin") == expected
        with open(ws / "big.bin", "rb") as a, open(ws / "big.bin", "rb") as b:
            assert a.read(100) == b.read(100)
        before = ws.snapshot()
        layer = ws.checkpoint("write")
        with open(ws / "big.bin", "r+b") as f:
            f.seek(BIG - 10)
            f.write(b"0123456789ABCDEF")
        new = ws.path / "made.bin"
        new.write_bytes(b"n" * (400 * 1024))
        assert md5(new) == hashlib.md5(b"n" * (400 * 1024)).hexdigest()
        assert os.stat(ws / "big.bin").st_size == BIG + 6
        ws.rollback(layer)
        assert treesnap.compare(before, ws.snapshot()) == []
        assert md5(ws / "big.bin") == expected


def test_a_file_whose_metadata_alone_was_copied_up_keeps_its_times_through_a_rollback(
    tmp_path, fuse
):
    """An overlay with metacopy copies up only the attributes of a file that
    is renamed or chmod-ed; its data follows at its first open for writing,
    and that copy gives the file the time of the copy as its mtime, before
    anything is written.  The pre-image is taken before that open."""
    with overlay_over(tmp_path, "tmpfs") as ov, workspace_on(ov) as ws:
        ws.mount("--store", ws.store)
        os.rename(ws / "src" / "b.txt", ws / "b.moved")  # (metadata copied up, a redirect)
        os.chmod(ws / "big.bin", 0o600)  # (metadata copied up)
        os.utime(ws / "b.moved", ns=(10**18, 2 * 10**18))
        before = ws.snapshot()
        layer = ws.checkpoint("write")
        for name in ("b.moved", "big.bin"):
            fd = os.open(ws / name, os.O_WRONLY)
            try:
                os.fstat(fd)
                os.pwrite(fd, b"written", 3)
            finally:
                os.close(fd)
        os.truncate(ws / "src" / "a.txt", 1)
        ws.rollback(layer)
        assert treesnap.compare(before, ws.snapshot()) == []
        assert os.stat(ws / "b.moved").st_mtime_ns == 2 * 10**18
