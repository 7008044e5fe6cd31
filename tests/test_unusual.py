"""Unusual input, captured and restored exactly: names with newlines and
non-UTF-8 bytes, 255-byte names, trees deeper than PATH_MAX, sparse files,
a file over 4 GiB, mode-000 files, setuid/setgid/sticky bits, fifos,
sockets, device nodes, hard links across directories, empty files."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import subprocess
import sys

import pytest

from cowfs.layers import treesnap

NEWLINE = b"new\nline"
NON_UTF8 = b"\xff\xfe-latin1-\xe9"
LONG = b"L" * 255
DEPTH, SEGMENT = 24, b"d" * 200  # 24 * 201 bytes: deeper than PATH_MAX (4096)
BIG_SIZE = (4 << 30) + (256 << 10)  # just over 4 GiB, sparse
BIG_AT = (4 << 30) + (64 << 10)  # data beyond the 4 GiB boundary


def deep_dir_fd(root: bytes, create: bool) -> int:
    """An fd of the deepest directory (paths that long cannot be used)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(DEPTH):
        if create:
            os.mkdir(SEGMENT, dir_fd=fd)
        nxt = os.open(SEGMENT, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        os.close(fd)
        fd = nxt
    return fd


def write_at(dir_fd: int, name: bytes, data: bytes, flags: int = os.O_CREAT) -> None:
    fd = os.open(name, os.O_WRONLY | flags, 0o644, dir_fd=dir_fd)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def build(root: bytes) -> None:
    """Every unusual kind of object, under *root*."""
    d = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        write_at(d, NEWLINE, b"newline name\n")
        write_at(d, NON_UTF8, b"bytes name\n")
        write_at(d, LONG, b"long name\n")
        os.mkdir(b"sub\nwith\xffodd", dir_fd=d)
        write_at(d, b"sub\nwith\xffodd/" + LONG, b"nested\n")
        write_at(d, b"empty", b"")
        write_at(d, b"mode000", b"secret\n")
        os.chmod(b"mode000", 0, dir_fd=d)
        write_at(d, b"setuid", b"#!/bin/sh\n")
        os.chmod(b"setuid", 0o6755, dir_fd=d)
        os.mkdir(b"sticky", dir_fd=d)
        os.chmod(b"sticky", 0o1777, dir_fd=d)
        os.mkfifo(b"fifo", dir_fd=d)
        os.mknod(b"null", 0o640 | stat.S_IFCHR, os.makedev(1, 3), dir_fd=d)
        os.mkdir(b"links", dir_fd=d)
        os.mkdir(b"links2", dir_fd=d)
        write_at(d, b"links/one", b"linked\n")
        os.link(b"links/one", b"links2/two", src_dir_fd=d, dst_dir_fd=d)
        os.link(b"links/one", b"three", src_dir_fd=d, dst_dir_fd=d)
        fd = os.open(b"sparse", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d)
        os.ftruncate(fd, 32 << 20)
        os.pwrite(fd, b"middle", 16 << 20)
        os.close(fd)
        deep = deep_dir_fd(root, create=True)
        write_at(deep, b"bottom", b"deeper than PATH_MAX\n")
        os.close(deep)
    finally:
        os.close(d)
    cwd = os.getcwd()
    os.chdir(root)  # a socket's path must be short
    try:
        s = socket.socket(socket.AF_UNIX)
        s.bind(b"sock")
        s.close()
    finally:
        os.chdir(cwd)


def change_everything(root: bytes) -> None:
    """Modify content and attributes of every object in place."""
    d = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        write_at(d, NEWLINE, b"X", 0)
        write_at(d, NON_UTF8, b"", os.O_TRUNC)
        os.rename(LONG, LONG[:-1] + b"M", src_dir_fd=d, dst_dir_fd=d)
        write_at(d, b"empty", b"not empty any more")
        os.chmod(b"mode000", 0o644, dir_fd=d)
        write_at(d, b"mode000", b"exposed", os.O_TRUNC)
        os.chmod(b"setuid", 0o755, dir_fd=d)
        os.chmod(b"sticky", 0o755, dir_fd=d)
        os.chmod(b"fifo", 0o600, dir_fd=d)
        os.unlink(b"sock", dir_fd=d)
        os.unlink(b"links2/two", dir_fd=d)
        write_at(d, b"three", b"through another link\n", os.O_APPEND)
        fd = os.open(b"sparse", os.O_WRONLY, dir_fd=d)
        for off in range(0, 32 << 20, 8 << 20):
            os.pwrite(fd, b"y" * 4096, off)
        os.close(fd)
        deep = deep_dir_fd(root, create=False)
        write_at(deep, b"bottom", b"changed", os.O_TRUNC)
        write_at(deep, b"new-at-the-bottom", b"new")
        os.close(deep)
    finally:
        os.close(d)


def blocks(path) -> int:
    return os.stat(path).st_blocks


def test_unusual_objects_round_trip(mounted):
    """Created in a layer (rollback removes them), changed in place,
    removed altogether (rm -rf): each rollback is exact."""
    ws = mounted
    root = os.fsencode(ws.path)
    empty = ws.snapshot()
    ws.checkpoint("create")
    build(root)
    ws.rollback()
    treesnap.assert_same(empty, ws.snapshot())

    build(root)
    ws.commit()  # into the base layer
    before = ws.snapshot()
    sparse_blocks = blocks(ws / "sparse")
    ws.checkpoint("change")
    change_everything(root)
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())
    assert blocks(ws / "sparse") <= sparse_blocks + 16  # still sparse

    ws.checkpoint("remove")
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)  # fd-based: copes with the deep tree
        else:
            os.unlink(path)
    assert os.listdir(root) == []
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())
    assert blocks(ws / "sparse") <= sparse_blocks + 16
    deep = deep_dir_fd(root, create=False)
    try:
        assert os.stat(b"bottom", dir_fd=deep).st_size == len(b"deeper than PATH_MAX\n")
    finally:
        os.close(deep)


def test_name_of_256_bytes_is_refused_like_ext4(mounted):
    with pytest.raises(OSError) as e:
        open(os.path.join(os.fsencode(mounted.path), b"n" * 256), "w")
    assert e.value.errno == errno.ENAMETOOLONG


def region(path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def test_file_over_4_gib(mounted):
    """Offsets past 4 GiB are captured and restored (sparse, so cheap); the
    store keeps only the touched chunk."""
    ws = mounted
    big = ws / "big"
    with open(big, "wb") as f:
        f.truncate(BIG_SIZE)
        f.seek(BIG_AT)
        f.write(b"beyond 4 GiB")
    ws.commit()
    st = os.stat(big)
    ws.checkpoint("big")
    with open(big, "r+b") as f:
        f.seek(BIG_AT)
        f.write(b"CHANGED")
        f.seek(BIG_SIZE)
        f.write(b"appended past the end")
    assert region(big, BIG_AT, 12) == b"CHANGED4 GiB"
    assert ws.log()[-1]["bytes"] < 1 << 20
    ws.rollback()
    after = os.stat(big)
    assert (after.st_size, after.st_mtime_ns, after.st_mode) == (
        st.st_size,
        st.st_mtime_ns,
        st.st_mode,
    )
    assert region(big, BIG_AT, 12) == b"beyond 4 GiB"
    assert region(big, BIG_AT - 4096, 4096) == bytes(4096)
    assert after.st_blocks <= st.st_blocks + 16
    ws.checkpoint("truncate")
    os.truncate(big, 100)
    ws.rollback()
    assert os.stat(big).st_size == BIG_SIZE and region(big, BIG_AT, 12) == b"beyond 4 GiB"


def deep_tree(root, depth: int, name: str = "a") -> None:
    """a/a/.../a (*depth* directories, each *name*) with a file f at the
    bottom, made through descriptors (the path is longer than PATH_MAX)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        with open("f", "w", opener=lambda p, f: os.open(p, f, 0o644, dir_fd=fd)) as f:
            f.write("deep\n")
    finally:
        os.close(fd)


def clear_deep(ws, name: str) -> None:
    """Remove the deep tree at *name* (pytest removes its old directories
    recursively: none this deep), and what the store keeps of deep trees
    removed through the mount (its grave), the workspace unmounted."""
    subprocess.run(["rm", "-rf", str(ws / name)], check=False)
    if ws.mounted:
        ws.unmount()
    subprocess.run(["rm", "-rf", str(ws.path / ".cowfs" / "grave")], check=False)


def test_a_tree_deeper_than_pythons_recursion_limit_is_listed_and_rolled_back(mounted):
    """Paths of 1,500 directories (3 KB): status, log, diff and a rollback
    walk them without recursion."""
    ws = mounted
    before = ws.snapshot()
    ws.checkpoint("deep")
    deep_tree(ws.path, 1500)
    deep = "/".join(["a"] * 1500) + "/f"
    try:
        changes = {c["path"]: c["kind"] for c in ws.json("status", "-u")["changes"]}
        assert len(changes) == 1501 and changes[deep] == "A"
        assert ws.json("diff", "--", deep)["changes"][0]["added"] == 1
        assert [x["changes"] for x in ws.json("log")][-1] == 1501
        ws.rollback()
        treesnap.assert_same(before, ws.snapshot())
    finally:  # (pytest removes its old directories recursively: none this deep)
        subprocess.run(["rm", "-rf", str(ws / "a")], check=False)


def test_a_tree_deeper_than_pythons_recursion_limit_is_restored(mounted):
    """`cowfs restore` of a tree 600 directories deep (1,200 calls deep
    when it recursed: past Python's limit) that was removed, with another
    made since in its place: walked without recursion, exact (but the
    workspace root's time: restore puts back the paths it is given)."""
    ws = mounted
    deep_tree(ws.path, 600)
    try:
        before = ws.snapshot()
        layer = ws.checkpoint("deep")
        subprocess.run(["rm", "-rf", str(ws / "a")], check=True)
        (ws / "a").mkdir()
        (ws / "a" / "other").write_text("made since\n")
        ws.cowfs("restore", "--from", str(layer), "a")
        diffs = treesnap.compare(before, ws.snapshot())
        assert [d for d in diffs if not d.startswith("changed .: mtime ")] == [], diffs
    finally:
        clear_deep(ws, "a")


def test_a_directory_made_in_a_layer_goes_with_a_deep_ignored_tree_in_it(mounted):
    """A rollback takes away a directory the layer made, with what was
    made in it at ignored paths (never captured) -- here a tree 1,100
    directories deep, looked through and removed without recursion."""
    ws = mounted
    (ws / ".cowfsignore").write_text("build/\n")
    before = ws.snapshot()
    ws.checkpoint("deep ignored")
    (ws / "d" / "build").mkdir(parents=True)
    deep_tree(ws.path / "d" / "build", 1100)
    try:
        assert [c["path"] for c in ws.json("status")["changes"]] == ["d"]
        ws.rollback()
        treesnap.assert_same(before, ws.snapshot())
    finally:
        clear_deep(ws, "d")


def test_a_restore_of_paths_longer_than_twice_path_max_is_refused_and_changes_nothing(mounted):
    """Each level of a tree is held by its whole path while a restore walks
    below it: a tree whose paths pass 8 KiB (90 levels of 100-byte names
    here; an agent's could cost the daemon gigabytes, every request
    waiting) is refused with one line, before anything changes."""
    ws = mounted
    name = "n" * 100
    deep_tree(ws.path, 90, name)
    try:
        layer = ws.checkpoint("deep, long names")
        subprocess.run(["rm", "-rf", str(ws / name)], check=True)
        (ws / "kept.txt").write_text("made since\n")
        before = ws.snapshot()
        r = ws.cowfs("restore", "--from", str(layer), name, "kept.txt", check=False)
        assert r.returncode == 2, r.stderr
        assert "longer than 8192 bytes; nothing restored" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
        treesnap.assert_same(before, ws.snapshot())
    finally:
        clear_deep(ws, name)


def test_a_tree_deeper_than_the_descriptor_limit_is_removed(tmp_path):
    """Removing a tree holds at most backing.HELD_LEVELS directories open:
    one 1,500 deep goes in a process allowed 128 descriptors (each level
    held open before: EMFILE, and the tree left half removed)."""
    deep_tree(tmp_path, 1500)
    (tmp_path / "a" / "side").mkdir()  # (a level with two subdirectories)
    (tmp_path / "kept").write_text("not below it\n")
    code = (
        "import os, resource, sys\n"
        "from cowfs.system import backing\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
        "backing.remove_tree_at(fd, b'a')\n"
    )
    try:
        r = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        assert sorted(os.listdir(tmp_path)) == ["kept"]
    finally:  # (what a failure left: nothing deep for pytest's own clean-up)
        subprocess.run(["rm", "-rf", str(tmp_path / "a")], check=False)
