"""Snapshot a directory tree's metadata and content, and compare snapshots.

Used by tests and the demo to prove that a tree is exactly back to an
earlier state after a rollback.  Names are handled as bytes throughout and
symlinks are never followed.  Directory sizes, atimes and ctimes are not
recorded because they legitimately differ between filesystems or on every
access.  ``KINDS``, the names of the kinds of file, is the one table of them
(``past`` names kinds by it too).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import stat
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from ..system.mounts import STORE_DIR

__all__ = [
    "Entry",
    "Snapshot",
    "snapshot",
    "compare",
    "assert_same",
    "fingerprint",
    "KINDS",
]

ROOT = b"."
"""Key under which the root directory itself is recorded."""

_CHUNK = 1 << 20
_MAX_REPORTED = 50
_XATTR_UNAVAILABLE = frozenset({errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM})
KINDS = {  # the name of each kind of file (the part of st_mode stat.S_IFMT keeps)
    stat.S_IFREG: "file",
    stat.S_IFDIR: "dir",
    stat.S_IFLNK: "symlink",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "chardev",
    stat.S_IFBLK: "blockdev",
}

Path = str | bytes | os.PathLike[str] | os.PathLike[bytes]
XattrPairs = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True, slots=True)
class Entry:
    """Recorded state of one directory entry (see module docstring)."""

    kind: str
    mode: int
    uid: int
    gid: int
    size: int | None
    mtime_ns: int
    digest: str | None
    target: bytes | None
    rdev: int | None
    xattrs: XattrPairs
    link: bytes | None


class Snapshot(dict[bytes, Entry]):
    """Mapping of relative path (bytes, root is ``b"."``) to :class:`Entry`."""


def snapshot(
    root: Path, *, exclude: Iterable[bytes] = (STORE_DIR.encode(),), content: bool = True
) -> Snapshot:
    """Record every entry under ``root`` without following symlinks.

    ``exclude`` names entries directly under ``root`` that are skipped with
    everything below them.  With ``content=False`` file digests are omitted.
    """
    root_b = os.fsencode(root)
    skipped = frozenset(os.fsencode(name) for name in exclude)
    root_fd = os.open(root_b, os.O_RDONLY | os.O_DIRECTORY)
    try:
        root_st = os.fstat(root_fd)
        snap = Snapshot()
        snap[ROOT] = _entry(root_fd, None, root_st, content)
        inodes: defaultdict[tuple[int, int], list[bytes]] = defaultdict(list)
        _walk(root_fd, b"", snap, inodes, skipped, content)
    finally:
        os.close(root_fd)
    for paths in inodes.values():
        leader = min(paths)
        for rel in paths:
            snap[rel] = dataclasses.replace(snap[rel], link=leader)
    return snap


def _walk(
    top_fd: int,
    top_rel: bytes,
    snap: Snapshot,
    inodes: defaultdict[tuple[int, int], list[bytes]],
    skipped: frozenset[bytes],
    content: bool,
) -> None:
    """Record everything below the directory *top_fd*, relative to directory
    fds (no path is ever longer than a name: trees deeper than PATH_MAX are
    fine), depth first with an explicit stack."""
    stack = [(top_fd, top_rel, iter(sorted(os.listdir(top_fd))))]
    try:
        while stack:
            dir_fd, rel_dir, names = stack[-1]
            listed = next(names, None)
            if listed is None:
                stack.pop()
                if dir_fd != top_fd:
                    os.close(dir_fd)
                continue
            name = os.fsencode(listed)
            if not rel_dir and name in skipped:
                continue
            rel = rel_dir + b"/" + name if rel_dir else name
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            snap[rel] = _entry(dir_fd, name, st, content)
            if stat.S_ISDIR(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                stack.append((fd, rel, iter(sorted(os.listdir(fd)))))
            elif st.st_nlink > 1:
                inodes[(st.st_dev, st.st_ino)].append(rel)
    finally:
        for dir_fd, _, _ in stack:
            if dir_fd != top_fd:
                os.close(dir_fd)


def _entry(dir_fd: int, name: bytes | None, st: os.stat_result, content: bool) -> Entry:
    """Build the :class:`Entry` for *name* in *dir_fd* (None: the directory
    itself); ``link`` is filled in later."""
    try:
        kind = KINDS[stat.S_IFMT(st.st_mode)]
    except KeyError:
        raise ValueError(f"unsupported file type {st.st_mode:#o}: {name!r}") from None
    is_file = kind == "file"
    # a short path to the entry itself, for the calls that take no dir fd
    path = b"/proc/self/fd/%d" % dir_fd + (b"/" + name if name is not None else b"")
    here = name if name is not None else b"."  # relative to dir_fd
    return Entry(
        kind=kind,
        mode=st.st_mode,
        uid=st.st_uid,
        gid=st.st_gid,
        size=st.st_size if is_file else None,
        mtime_ns=st.st_mtime_ns,
        digest=_digest(dir_fd, here) if is_file and content else None,
        target=os.readlink(here, dir_fd=dir_fd) if kind == "symlink" else None,
        rdev=st.st_rdev if kind in ("chardev", "blockdev") else None,
        xattrs=_xattrs(path, follow=name is None),  # (the directory: through its fd)
        link=None,
    )


def _digest(dir_fd: int, name: bytes) -> str:
    """Return the xxh3_128 hexdigest of a regular file, read in 1 MiB chunks,
    refusing to follow a symlink swapped in meanwhile."""
    hasher = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    with open(fd, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            hasher.update(view[:n])
    return hasher.hexdigest()


def _xattrs(path: bytes, follow: bool = False) -> XattrPairs:
    """Return sorted (name, value) xattr pairs; empty where xattrs are
    unsupported.  *follow*: *path* is the /proc link of an fd on the object."""
    try:
        pairs = [
            (os.fsencode(name), os.getxattr(path, name, follow_symlinks=follow))
            for name in os.listxattr(path, follow_symlinks=follow)
        ]
    except OSError as e:
        if e.errno in _XATTR_UNAVAILABLE:
            return ()
        raise
    return tuple(sorted(pairs))


def compare(before: Snapshot, after: Snapshot, *, mtimes: bool = True) -> list[str]:
    """Describe every difference between two snapshots, sorted by path.

    An empty list means the trees are identical.  Content is only compared
    when both snapshots have a digest; ``mtimes=False`` ignores mtimes.
    """
    diffs: list[str] = []
    for rel in sorted(before.keys() | after.keys(), key=_path_order):
        old, new = before.get(rel), after.get(rel)
        if new is None:
            diffs.append(f"missing: {_show_path(rel)}")
        elif old is None:
            diffs.append(f"added: {_show_path(rel)}")
        else:
            diffs.extend(
                f"changed {_show_path(rel)}: {change}"
                for change in _entry_changes(old, new, mtimes)
            )
    return diffs


def _entry_changes(old: Entry, new: Entry, mtimes: bool) -> list[str]:
    """List the field-level changes between two entries at the same path."""
    if old.kind != new.kind:
        return [f"kind {old.kind} -> {new.kind}"]
    changes: list[str] = []
    if old.mode != new.mode:
        changes.append(f"mode {old.mode:#o} -> {new.mode:#o}")
    for field in ("uid", "gid", "size", "rdev"):
        a, b = getattr(old, field), getattr(new, field)
        if a != b:
            changes.append(f"{field} {a} -> {b}")
    if mtimes and old.mtime_ns != new.mtime_ns:
        changes.append(f"mtime {old.mtime_ns} -> {new.mtime_ns}")
    if old.digest is not None and new.digest is not None and old.digest != new.digest:
        changes.append("content")
    if old.target != new.target:
        changes.append(f"target {_show_value(old.target)} -> {_show_value(new.target)}")
    if old.xattrs != new.xattrs:
        changes.append("xattrs")
    if old.link != new.link:
        changes.append(f"hard link {_show_value(old.link)} -> {_show_value(new.link)}")
    return changes


def _path_order(rel: bytes) -> tuple[bool, bytes]:
    """Sort key putting the root first, then paths in byte order."""
    return (rel != ROOT, rel)


def _show_path(rel: bytes) -> str:
    """Printable UTF-8 paths as-is, anything else as a bytes repr."""
    try:
        text = rel.decode()
    except UnicodeDecodeError:
        return repr(rel)
    return text if text.isprintable() else repr(rel)


def _show_value(value: bytes | None) -> str:
    """Quote a symlink target or link path unambiguously."""
    if value is None:
        return "None"
    try:
        return repr(value.decode())
    except UnicodeDecodeError:
        return repr(value)


def assert_same(before: Snapshot, after: Snapshot, **kw: bool) -> None:
    """Raise AssertionError listing (up to 50) differences, if there are any."""
    diffs = compare(before, after, **kw)
    if not diffs:
        return
    lines = [f"trees differ ({len(diffs)} differences):"]
    lines += [f"  {d}" for d in diffs[:_MAX_REPORTED]]
    if len(diffs) > _MAX_REPORTED:
        lines.append(f"  ... and {len(diffs) - _MAX_REPORTED} more")
    raise AssertionError("\n".join(lines))


def fingerprint(snap: Snapshot) -> str:
    """Return one xxh3_128 hexdigest over a canonical encoding of all entries."""
    hasher = xxhash.xxh3_128()
    for rel in sorted(snap, key=_path_order):
        hasher.update(_encode(rel))
        hasher.update(_encode(dataclasses.astuple(snap[rel])))
    return hasher.hexdigest()


def _encode(value: object) -> bytes:
    """Encode None/int/str/bytes/tuples as unambiguous tagged, length-prefixed bytes."""
    match value:
        case None:
            return b"N"
        case int():
            return _tagged(b"i", str(value).encode())
        case str():
            return _tagged(b"s", value.encode())
        case bytes():
            return _tagged(b"b", value)
        case tuple():
            return _tagged(b"t", b"".join(_encode(item) for item in value))
    raise TypeError(f"cannot encode {type(value).__name__}")


def _tagged(tag: bytes, payload: bytes) -> bytes:
    """Prefix ``payload`` with a one-byte tag and its decimal length."""
    return tag + str(len(payload)).encode() + b":" + payload


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: print the fingerprint and entry count of the tree at ROOT."""
    parser = argparse.ArgumentParser(
        prog="python -m cowfs.layers.treesnap",
        description="Fingerprint a directory tree (symlinks not followed).",
    )
    parser.add_argument("root", metavar="ROOT", help="directory to snapshot")
    args = parser.parse_args(argv)
    snap = snapshot(args.root)
    print(f"{fingerprint(snap)}  {len(snap)} entries")


if __name__ == "__main__":
    main()
