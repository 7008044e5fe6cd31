"""Tests for cowfs.layers.treesnap: snapshots detect every kind of tree difference."""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cowfs.layers.treesnap import Snapshot, assert_same, compare, fingerprint, snapshot

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def kept_mtime(*paths: Path | bytes) -> Iterator[None]:
    """Restore the atime/mtime of ``paths`` (not following symlinks) on exit."""
    saved = [(p, os.lstat(p)) for p in paths]
    yield
    for p, st in saved:
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def write(path: Path | bytes, data: bytes, mode: int = 0o644) -> None:
    """Create or overwrite a regular file with ``data`` and an explicit mode."""
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A small tree with files, a subdirectory, a symlink and a hard link pair."""
    root = tmp_path / "tree"
    (root / "sub" / "deep").mkdir(parents=True)
    write(root / "f", b"hello world")
    write(root / "sub" / "g", b"x" * (3 << 20))
    write(root / "sub" / "deep" / "h", b"")
    os.symlink("f", root / "ln")
    os.link(root / "f", root / "sub" / "hard")
    return root


def test_identical_trees_compare_equal(tree: Path) -> None:
    before, after = snapshot(tree), snapshot(os.fsencode(tree))
    assert isinstance(before, Snapshot)
    assert compare(before, after) == []
    assert_same(before, after)
    assert fingerprint(before) == fingerprint(after)
    assert set(before) == {
        b".",
        b"f",
        b"ln",
        b"sub",
        b"sub/g",
        b"sub/hard",
        b"sub/deep",
        b"sub/deep/h",
    }


def test_entry_fields(tree: Path) -> None:
    snap = snapshot(tree)
    root, f, ln, sub = snap[b"."], snap[b"f"], snap[b"ln"], snap[b"sub"]
    assert root.kind == sub.kind == "dir"
    assert root.size is None and root.digest is None
    assert f.kind == "file" and f.size == 11 and f.mode == stat.S_IFREG | 0o644
    assert f.digest is not None and len(f.digest) == 32
    assert ln.kind == "symlink" and ln.target == b"f" and ln.digest is None
    assert f.link == snap[b"sub/hard"].link == b"f"
    assert snap[b"sub/g"].link is None
    assert snapshot(tree, content=False)[b"f"].digest is None


def test_content_flip_same_size_and_mtime(tree: Path) -> None:
    before = snapshot(tree)
    with kept_mtime(tree / "f"):
        with open(tree / "f", "r+b") as f:
            f.seek(4)
            f.write(b"O")
    after = snapshot(tree)
    # "f" and "sub/hard" are the same inode.
    assert compare(before, after) == ["changed f: content", "changed sub/hard: content"]
    assert compare(snapshot(tree, content=False), snapshot(tree, content=False)) == []


def test_content_change_past_first_chunk(tree: Path) -> None:
    before = snapshot(tree)
    with kept_mtime(tree / "sub" / "g"):
        with open(tree / "sub" / "g", "r+b") as f:
            f.seek((2 << 20) + 5)
            f.write(b"y")
    assert compare(before, snapshot(tree)) == ["changed sub/g: content"]


def test_mode_change(tree: Path) -> None:
    before = snapshot(tree)
    os.chmod(tree / "sub" / "g", 0o600)
    assert compare(before, snapshot(tree)) == ["changed sub/g: mode 0o100644 -> 0o100600"]


def test_mtime_change(tree: Path) -> None:
    before = snapshot(tree)
    old = before[b"sub/g"].mtime_ns
    os.utime(tree / "sub" / "g", ns=(old, 1_700_000_000_000_000_000))
    after = snapshot(tree)
    assert compare(before, after) == [f"changed sub/g: mtime {old} -> 1700000000000000000"]
    assert compare(before, after, mtimes=False) == []


def test_symlink_target_change(tree: Path) -> None:
    before = snapshot(tree)
    with kept_mtime(tree):
        os.remove(tree / "ln")
        os.symlink("sub/g", tree / "ln")
    os.utime(tree / "ln", ns=(0, before[b"ln"].mtime_ns), follow_symlinks=False)
    assert compare(before, snapshot(tree)) == ["changed ln: target 'f' -> 'sub/g'"]


def test_xattr_change(tree: Path) -> None:
    target = tree / "sub" / "g"
    try:
        os.setxattr(target, "user.cowfs.test", b"one")
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            pytest.skip(f"filesystem at {tree} rejects user.* xattrs: {e}")
        raise
    before = snapshot(tree)
    assert before[b"sub/g"].xattrs == ((b"user.cowfs.test", b"one"),)
    os.setxattr(target, "user.cowfs.test", b"two")
    assert compare(before, snapshot(tree)) == ["changed sub/g: xattrs"]
    os.removexattr(target, "user.cowfs.test")
    assert compare(before, snapshot(tree)) == ["changed sub/g: xattrs"]


def test_hard_link_broken_into_copies(tree: Path) -> None:
    before = snapshot(tree)
    hard = tree / "sub" / "hard"
    st = os.lstat(hard)
    with kept_mtime(tree / "sub"):
        os.remove(hard)
        write(hard, b"hello world")
        os.utime(hard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert compare(before, snapshot(tree)) == [
        "changed f: hard link 'f' -> None",
        "changed sub/hard: hard link 'f' -> None",
    ]


def test_added_and_removed_files(tree: Path) -> None:
    before = snapshot(tree)
    with kept_mtime(tree, tree / "sub" / "deep"):
        write(tree / "new", b"")
        os.remove(tree / "sub" / "deep" / "h")
    assert compare(before, snapshot(tree)) == ["added: new", "missing: sub/deep/h"]


def test_directory_mtime_change_detected(tree: Path) -> None:
    before = snapshot(tree)
    write(tree / "sub" / "deep" / "new", b"")
    diffs = compare(before, snapshot(tree))
    assert diffs[0].startswith("changed sub/deep: mtime ")
    assert diffs[1:] == ["added: sub/deep/new"]


def test_kind_change(tree: Path) -> None:
    before = snapshot(tree)
    with kept_mtime(tree):
        os.remove(tree / "ln")
        os.mkdir(tree / "ln")
    assert compare(before, snapshot(tree)) == ["changed ln: kind symlink -> dir"]


def test_special_files(tree: Path) -> None:
    os.mkfifo(tree / "pipe")
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(os.fspath(tree / "sock"))
        snap = snapshot(tree)  # must not block on the fifo or socket
    finally:
        sock.close()
    assert snap[b"pipe"].kind == "fifo" and snap[b"pipe"].digest is None
    assert snap[b"sock"].kind == "socket"
    with kept_mtime(tree):
        os.remove(tree / "pipe")
        write(tree / "pipe", b"")
    assert compare(snap, snapshot(tree))[0] == "changed pipe: kind fifo -> file"


def test_device_nodes(tree: Path) -> None:
    try:
        os.mknod(tree / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError as e:
        pytest.skip(f"cannot create device nodes here: {e}")
    before = snapshot(tree)
    assert before[b"null"].kind == "chardev"
    assert before[b"null"].rdev == os.makedev(1, 3)
    with kept_mtime(tree):
        os.remove(tree / "null")
        os.mknod(tree / "null", stat.S_IFCHR | 0o600, os.makedev(1, 5))
    os.utime(tree / "null", ns=(0, before[b"null"].mtime_ns))
    assert compare(before, snapshot(tree)) == [
        f"changed null: rdev {os.makedev(1, 3)} -> {os.makedev(1, 5)}"
    ]


def test_unusual_names(tree: Path) -> None:
    root = os.fsencode(tree)
    newline, non_utf8 = b"new\nline", b"bad\xffname"
    write(os.path.join(root, newline), b"a")
    write(os.path.join(root, b"sub", non_utf8), b"b")
    before = snapshot(tree)
    assert before[newline].kind == "file"
    assert before[b"sub/" + non_utf8].size == 1
    with kept_mtime(root):
        os.remove(os.path.join(root, newline))
    with kept_mtime(os.path.join(root, b"sub", non_utf8)):
        write(os.path.join(root, b"sub", non_utf8), b"c")
    diffs = compare(before, snapshot(tree))
    assert diffs == [
        "missing: b'new\\nline'",
        "changed b'sub/bad\\xffname': content",
    ]
    assert all(d.isprintable() for d in diffs)


def test_excluded_names_are_ignored(tree: Path) -> None:
    (tree / ".cowfs").mkdir()
    (tree / "sub" / ".cowfs").mkdir()
    with kept_mtime(tree):
        write(tree / ".cowfs" / "layer", b"1")
    before = snapshot(tree)
    assert b".cowfs" not in before and b".cowfs/layer" not in before
    assert b"sub/.cowfs" in before  # only top-level names are excluded
    assert b".cowfs/layer" in snapshot(tree, exclude=())
    with kept_mtime(tree):
        os.remove(tree / ".cowfs" / "layer")
        os.rmdir(tree / ".cowfs")
        write(tree / "other", b"")
    after = snapshot(tree, exclude=(b"other",))
    assert compare(before, after) == []


def test_symlinked_directories_are_not_followed(tree: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    write(outside / "secret", b"s")
    os.symlink(outside, tree / "out")
    os.symlink("sub", tree / "subln")
    before = snapshot(tree)
    assert before[b"out"].kind == "symlink" and before[b"subln"].kind == "symlink"
    assert not any(p.startswith((b"out/", b"subln/")) for p in before)
    write(outside / "secret", b"changed")
    write(outside / "more", b"")
    assert compare(before, snapshot(tree)) == []


def test_assert_same_reports_at_most_50(tree: Path) -> None:
    before = snapshot(tree)
    with kept_mtime(tree):
        for i in range(60):
            write(tree / f"n{i:02d}", b"")
    with pytest.raises(AssertionError) as info:
        assert_same(before, snapshot(tree))
    message = str(info.value)
    assert "60 differences" in message
    assert "added: n49" in message and "added: n50" not in message
    assert "... and 10 more" in message


def test_fingerprint_changes_with_tree(tree: Path) -> None:
    before = fingerprint(snapshot(tree))
    os.chmod(tree / "f", 0o600)
    assert fingerprint(snapshot(tree)) != before
    os.chmod(tree / "f", 0o644)
    assert fingerprint(snapshot(tree)) == before


def test_cli_prints_fingerprint_and_count(tree: Path) -> None:
    pythonpath = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    result = subprocess.run(
        [sys.executable, "-m", "cowfs.layers.treesnap", str(tree)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)},
    )
    snap = snapshot(tree)
    assert result.stdout == f"{fingerprint(snap)}  {len(snap)} entries\n"


def test_root_must_be_a_directory(tree: Path) -> None:
    with pytest.raises(NotADirectoryError):
        snapshot(tree / "f")
    with pytest.raises(NotADirectoryError):
        snapshot(tree / "ln")
