"""System-call helpers for working on the backing directory safely.

Every backing path is resolved relative to a directory fd, one component at
a time, never following a symlink: no name planted in the workspace can
lead cowfs outside it (DESIGN invariant 3).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat
from contextlib import contextmanager
from typing import Iterator

from . import schema as S

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                            ctypes.c_char_p, ctypes.c_uint]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
RENAME_WHITEOUT = 4
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2

PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC

# The daemon creates objects for its callers with exactly the mode the kernel
# hands it (the caller's umask already applied): its own umask must not be
# applied a second time, so a mounted daemon runs under umask 0.  Commands it
# runs for the user get back the umask it was started with.
_user_umask: int | None = None


def clear_umask() -> None:
    """Run under umask 0 from now on (the mount daemon)."""
    global _user_umask
    if _user_umask is None:
        _user_umask = os.umask(0)


def user_umask() -> int:
    """The umask this process was started with."""
    if _user_umask is not None:
        return _user_umask
    mask = os.umask(0)
    os.umask(mask)
    return mask
DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def renameat2(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int = 0) -> None:
    if _libc.renameat2(olddirfd, old, newdirfd, new, flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), old, None, new)


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Deallocate a range (it reads back as zeros); falls back to writing
    zeros where the filesystem cannot punch holes."""
    if length <= 0:
        return
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return
    e = ctypes.get_errno()
    if e not in (errno.EOPNOTSUPP, errno.ENOSYS):
        raise OSError(e, os.strerror(e))
    os.pwrite(fd, bytes(length), offset)


def open_noatime(path: bytes, flags: int, dir_fd: int | None = None) -> int:
    """open() for reading that the daemon does for itself (captures, checks):
    it must not update the atime as a program's read would.  O_NOATIME is
    refused (EPERM) on objects the daemon neither owns nor may override;
    there the read updates the atime as before."""
    try:
        return os.open(path, flags | os.O_NOATIME, dir_fd=dir_fd)
    except PermissionError:
        return os.open(path, flags, dir_fd=dir_fd)


@contextmanager
def noatime(fd: int) -> Iterator[None]:
    """Reads through the open file *fd* leave the atime alone for the
    duration (O_NOATIME set and cleared again), where that is allowed."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & os.O_NOATIME:
        yield
        return
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NOATIME)
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def proc(fd: int) -> bytes:
    """The /proc magic link that reaches the object behind *fd*."""
    return b"/proc/self/fd/%d" % fd


def proc_at(dirfd: int, name: bytes) -> bytes:
    """A path to *name* inside the directory *dirfd*, for calls that have no
    *at variant (xattrs); use it with follow_symlinks=False."""
    return b"/proc/self/fd/%d/%s" % (dirfd, name)


def split(path: bytes) -> tuple[bytes, bytes]:
    """'a/b/c' -> ('a/b', 'c')."""
    head, _, tail = path.rpartition(b"/")
    return head, tail


def join(parent: bytes, name: bytes) -> bytes:
    return parent + b"/" + name if parent else name


def open_dir(rootfd: int, path: bytes) -> int:
    """Open the directory *path* (relative to *rootfd*) as an O_PATH fd,
    walking component by component without following symlinks."""
    fd = os.dup(rootfd)
    try:
        for comp in path.split(b"/") if path else ():
            if comp in (b"", b".", b".."):
                raise OSError(errno.EINVAL, "bad path component", path)
            nfd = os.open(comp, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


class Resolver:
    """Resolves record locations (workspace paths and grave entries)."""

    def __init__(self, rootfd: int, grave_fd: int):
        self.rootfd = rootfd
        self.grave_fd = grave_fd

    @contextmanager
    def at(self, loc: bytes) -> Iterator[tuple[int, bytes]]:
        """(dirfd, name) for *loc*; the root itself is ('root fd', b'.')."""
        gid = S.grave_id(loc)
        if gid is not None:
            yield self.grave_fd, str(gid).encode()
            return
        if loc == b"":
            yield self.rootfd, b"."
            return
        parent, name = split(loc)
        fd = open_dir(self.rootfd, parent)
        try:
            yield fd, name
        finally:
            os.close(fd)

    def lstat(self, loc: bytes) -> os.stat_result | None:
        """What is at *loc*; None when nothing is (or a component of its
        path is gone)."""
        try:
            with self.at(loc) as (d, n):
                return lstat_at(d, n)
        except OSError:
            return None


def lstat_at(dirfd: int, name: bytes) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def xattr_target(dirfd: int, name: bytes) -> tuple[bytes, bool]:
    """(path, follow_symlinks) that reaches the object *name* in *dirfd*
    for the xattr calls, which have no *at variants."""
    if name == b".":
        return proc(dirfd), True
    return proc_at(dirfd, name), False


def list_xattrs(path: bytes, follow: bool) -> list[tuple[bytes, bytes]]:
    """All xattrs of the object at *path*."""
    try:
        names = os.listxattr(path, follow_symlinks=follow)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EPERM):
            return []
        raise
    out = []
    for n in names:
        try:
            out.append((os.fsencode(n), os.getxattr(path, n, follow_symlinks=follow)))
        except OSError as e:
            if e.errno != errno.ENODATA:
                raise
    return out


def set_all_xattrs(path: bytes, follow: bool, pairs: list[tuple[bytes, bytes]]) -> None:
    """Make the object's xattrs exactly *pairs*."""
    want = dict(pairs)
    for n, _ in list_xattrs(path, follow):
        if n not in want:
            os.removexattr(path, n, follow_symlinks=follow)
    for n, v in want.items():
        os.setxattr(path, n, v, follow_symlinks=follow)


def remove_tree_at(dirfd: int, name: bytes) -> None:
    """Remove *name* in *dirfd* and everything below it, never following
    symlinks."""
    st = lstat_at(dirfd, name)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dirfd)
        return
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dirfd)
    try:
        for child in os.listdir(fd):
            remove_tree_at(fd, os.fsencode(child))
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dirfd)
