"""What a fork changed since its fork point, path by path.

A fork's overlay keeps in its upper layer exactly what the fork touched
(cowfs/service/forks.py): a file copied up at its first change (or its
attributes alone, ``trusted.overlay.metacopy``), a directory made or
copied up for a change below it, a whiteout (a character device 0:0) where
a name of the fork point was removed, a directory replaced whole
(``trusted.overlay.opaque``) or moved (``trusted.overlay.redirect``).  So
the paths to compare are the upper layer's own, every path below a
replaced or moved directory, and nothing else: the cost is what the fork
changed, not the tree.  Each is compared as the net changes of a layer are
(what the path holds at the fork point against what it holds now: type,
bytes, mode, owner, xattrs, symlink target, modification time), ignored
paths included -- the fork's own capture skips those, its upper layer
does not.

The fork point is read through the fork's view (its lower layer), the
fork through its mount; both are reached only through descriptors opened
here, one component at a time, never following a symlink.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from ..system import backing

OVERLAY = b"trusted.overlay."
OPAQUE = b"trusted.overlay.opaque"
REDIRECT = b"trusted.overlay.redirect"
STORE = b".cowfs"  # (the fork's own store, in its upper layer)
BLOCK = 1 << 20


@dataclass
class Change:
    path: bytes
    kind: str  # "A" added, "D" deleted, "T" type changed, "M" bytes, "m" attributes, "t" mtime
    is_dir: bool = False  # (what the path holds in the fork, or held if it is gone)


def _xattrs(dirfd: int, name: bytes) -> dict[bytes, bytes]:
    target, follow = backing.xattr_target(dirfd, name)
    out = {}
    with contextlib.suppress(OSError):
        for k in os.listxattr(target, follow_symlinks=follow):
            kb = os.fsencode(k)
            if not kb.startswith(OVERLAY):
                with contextlib.suppress(OSError):
                    out[kb] = os.getxattr(target, k, follow_symlinks=follow)
    return out


def _overlay_xattr(dirfd: int, name: bytes, key: bytes) -> bytes | None:
    target, follow = backing.xattr_target(dirfd, name)
    try:
        return os.getxattr(target, key, follow_symlinks=follow)
    except OSError:
        return None


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def candidates(upper_fd: int) -> Iterator[tuple[bytes, bool]]:
    """The paths the fork's upper layer names, each with whether everything
    below it must be compared too (a directory replaced or moved there)."""
    stack: list[bytes] = [b""]
    while stack:
        rel = stack.pop()
        fd = backing.open_dir(upper_fd, rel) if rel else os.dup(upper_fd)
        try:
            dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        finally:
            os.close(fd)
        try:
            with os.scandir(dfd) as it:
                names = sorted(os.fsencode(e.name) for e in it)
            for name in names:
                if not rel and name == STORE:
                    continue
                path = backing.join(rel, name)
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    whole = (
                        _overlay_xattr(dfd, name, OPAQUE) == b"y"
                        or _overlay_xattr(dfd, name, REDIRECT) is not None
                    )
                    yield path, whole
                    if not whole:
                        stack.append(path)
                else:
                    yield path, False
        finally:
            os.close(dfd)


class Tree:
    """One side (the fork point, or the fork), read through *root*, a
    descriptor of its root directory, for one reading: the directories it
    opened stay open (a few, the last used) and each path's attributes
    are read once (``close`` ends it)."""

    DIRS = 64

    def __init__(self, root: int):
        self.root = root
        self._dirs: dict[bytes, int] = {}
        self._stats: dict[bytes, os.stat_result | None] = {}

    def close(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()

    def _dir(self, rel: bytes) -> int:
        """The directory *rel* (OSError where there is none), kept open."""
        if not rel:
            return self.root
        fd = self._dirs.pop(rel, None)
        if fd is None:
            fd = backing.open_dir(self.root, rel)
            if len(self._dirs) >= self.DIRS:
                os.close(self._dirs.pop(next(iter(self._dirs))))  # (the least lately used)
        self._dirs[rel] = fd
        return fd

    def lstat(self, rel: bytes) -> os.stat_result | None:
        if rel in self._stats:
            return self._stats[rel]
        head, name = backing.split(rel)
        try:
            st: os.stat_result | None = backing.lstat_at(self._dir(head), name)
        except OSError:
            st = None
        self._stats[rel] = st
        return st

    def names(self, rel: bytes) -> list[bytes]:
        try:
            dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=self._dir(rel))
        except OSError:
            return []
        try:
            with os.scandir(dfd) as it:
                return sorted(os.fsencode(e.name) for e in it)
        finally:
            os.close(dfd)

    def xattrs(self, rel: bytes) -> dict[bytes, bytes]:
        head, name = backing.split(rel)
        fd = self._dir(head)
        return _xattrs(fd, name) if name else _xattrs(fd, b".")

    def readlink(self, rel: bytes) -> bytes:
        head, name = backing.split(rel)
        return os.readlink(name, dir_fd=self._dir(head))

    def open(self, rel: bytes) -> int:
        head, name = backing.split(rel)
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir(head))


def _same_bytes(a: Tree, b: Tree, rel: bytes, size: int) -> bool:
    fa, fb = a.open(rel), b.open(rel)
    try:
        off = 0
        while off < size:
            x, y = os.pread(fa, BLOCK, off), os.pread(fb, BLOCK, off)
            if x != y or not x:
                return x == y
            off += len(x)
        return True
    finally:
        os.close(fa)
        os.close(fb)


def compare(then: Tree, now: Tree, rel: bytes) -> str | None:
    """The kind of change at *rel* (None: it holds the same)."""
    a, b = then.lstat(rel), now.lstat(rel)
    if a is None and b is None:
        return None
    if a is None:
        return "A"
    if b is None:
        return "D"
    if stat.S_IFMT(a.st_mode) != stat.S_IFMT(b.st_mode):
        return "T"
    if stat.S_ISREG(a.st_mode) and (
        a.st_size != b.st_size or not _same_bytes(then, now, rel, a.st_size)
    ):
        return "M"
    if stat.S_ISLNK(a.st_mode) and then.readlink(rel) != now.readlink(rel):
        return "M"
    if (stat.S_ISCHR(a.st_mode) or stat.S_ISBLK(a.st_mode)) and a.st_rdev != b.st_rdev:
        return "T"
    if (a.st_mode, a.st_uid, a.st_gid) != (b.st_mode, b.st_uid, b.st_gid) or (
        not stat.S_ISLNK(a.st_mode) and then.xattrs(rel) != now.xattrs(rel)
    ):
        return "m"
    if a.st_mtime_ns != b.st_mtime_ns and not stat.S_ISDIR(a.st_mode):
        return "t"
    return None


def changes(upper_fd: int, then_root: int, now_root: int) -> list[Change]:
    """Every path whose state differs between the fork point (*then_root*)
    and the fork (*now_root*), by the paths the upper layer (*upper_fd*)
    names; in path order."""
    then, now = Tree(then_root), Tree(now_root)
    try:
        return _changes(upper_fd, then, now)
    finally:
        then.close()
        now.close()


def _changes(upper_fd: int, then: Tree, now: Tree) -> list[Change]:
    paths: set[bytes] = set()
    for rel, whole in candidates(upper_fd):
        paths.add(rel)
        if whole:
            for side in (then, now):
                stack = [rel]
                while stack:
                    d = stack.pop()
                    for name in side.names(d):
                        p = backing.join(d, name)
                        paths.add(p)
                        st = side.lstat(p)
                        if st is not None and stat.S_ISDIR(st.st_mode):
                            stack.append(p)
    # A file with other names at the fork point changed through one of
    # them: the overlay copies up the name used, and the others show the
    # same object (its index) with no entry of their own.  They are found
    # by a walk of the fork point -- only when there is such a file.
    linked = {}
    for rel in paths:
        st = then.lstat(rel)
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            linked[st.st_ino] = rel
    if linked:
        paths |= _names_of(then, set(linked))
    # A name the fork gave a file it holds under other names too (a link
    # made to a file, changed or not): those names hold what they held,
    # yet they are one object with it now -- they are changes too, or an
    # adopt would make the new name a copy.  (Every such name is in the
    # upper layer or one of the fork point's names of a file found above:
    # the overlay copies a file up to link it.)
    groups: dict[tuple[str, int], set[bytes]] = {}
    for rel in paths:
        for which, tree in (("then", then), ("now", now)):
            st = tree.lstat(rel)
            if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                groups.setdefault((which, st.st_ino), set()).add(rel)
    relinked = set()
    for (which, _), names in groups.items():
        if which == "now" and len(names) > 1:
            for rel in names:
                st = then.lstat(rel)
                was = groups.get(("then", st.st_ino), {rel}) if st is not None else set()
                if names - was:
                    relinked.add(rel)
    out = []
    for rel in sorted(paths):
        kind = compare(then, now, rel)
        if kind is None and rel in relinked:
            kind = "m"
        if kind is not None:
            st = now.lstat(rel) or then.lstat(rel)
            out.append(Change(rel, kind, st is not None and stat.S_ISDIR(st.st_mode)))
    return out


def compare_trees(a_root: int, b_root: int, paths: set[bytes]) -> list[Change]:
    """The paths of *paths* (and every path below one that is a directory
    on one side only, or on both but found in neither's listing of the
    other) whose state differs between tree *a* and tree *b*, the kind as
    from *a* to *b*; in path order.  The store is left out."""
    a, b = Tree(a_root), Tree(b_root)
    try:
        out = []
        todo = sorted(p for p in paths if p != STORE and not p.startswith(STORE + b"/"))
        seen = set(todo)
        while todo:
            rel = todo.pop()
            kind = compare(a, b, rel)
            if kind is None:
                continue
            sa, sb = a.lstat(rel), b.lstat(rel)
            st = sb or sa
            out.append(Change(rel, kind, st is not None and stat.S_ISDIR(st.st_mode)))
            # (below a directory one side has and the other not, or made
            # anew: what it holds differs too, path by path)
            for side, other in ((sa, sb), (sb, sa)):
                if side is not None and stat.S_ISDIR(side.st_mode):
                    if other is None or not stat.S_ISDIR(other.st_mode):
                        for name in set(a.names(rel)) | set(b.names(rel)):
                            p = backing.join(rel, name)
                            if p not in seen:
                                seen.add(p)
                                todo.append(p)
        return sorted(out, key=lambda c: c.path)
    finally:
        a.close()
        b.close()


def _names_of(tree: Tree, inos: set[int]) -> set[bytes]:
    """Every path of *tree* whose object is one of *inos*."""
    found = set()
    stack = [b""]
    while stack:
        d = stack.pop()
        for name in tree.names(d):
            p = backing.join(d, name)
            if not d and name == STORE:
                continue
            st = tree.lstat(p)
            if st is None:
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(p)
            elif st.st_ino in inos:
                found.add(p)
    return found
