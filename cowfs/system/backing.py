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
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

# The one handle on the C library in cowfs, for the system calls Python's os
# module lacks; ``checked`` turns a failed call into the OSError os would
# raise.
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.renameat2.argtypes = [
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_uint,
]
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
RENAME_WHITEOUT = 4
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2
FALLOC_FL_COLLAPSE_RANGE = 8
FALLOC_FL_ZERO_RANGE = 0x10
FALLOC_FL_INSERT_RANGE = 0x20

PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC

# The daemon creates objects for its callers with exactly the mode the kernel
# hands it (the caller's umask already applied): its own umask must not be
# applied a second time, so a mounted daemon runs under umask 0.  Commands it
# runs for the user get back the umask it was started with.
_user_umask: int | None = None


# A location in the store's grave (a removed object kept whole) rather than
# in the workspace: the grave entry's id after a prefix no path can have.
GRAVE_PREFIX = b"\0grave/"


def grave_loc(gid: int) -> bytes:
    return GRAVE_PREFIX + str(gid).encode()


def grave_id(loc: bytes) -> int | None:
    return int(loc[len(GRAVE_PREFIX) :]) if loc.startswith(GRAVE_PREFIX) else None


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


def checked(result: int, *filenames: bytes | str | None, call: str = "") -> int:
    """*result*, what a call through ``libc`` returned, unless it says the
    call failed (it is negative): then the OSError the call failed with --
    its errno, the message (after "*call*: " where given) and *filenames*
    as OSError takes them (one, or the two of a rename with None between)."""
    if result >= 0:
        return result
    e = ctypes.get_errno()
    message = os.strerror(e)
    raise OSError(e, f"{call}: {message}" if call else message, *filenames)


def renameat2(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int = 0) -> None:
    checked(libc.renameat2(olddirfd, old, newdirfd, new, flags), old, None, new)


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    checked(libc.fallocate(fd, mode, offset, length))


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Deallocate a range (it reads back as zeros); falls back to writing
    zeros where the filesystem cannot punch holes."""
    if length <= 0:
        return
    try:
        checked(libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length))
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise
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


# Attribute changes through an O_PATH fd (AT_EMPTY_PATH): one system call,
# where a /proc/self/fd path costs a walk through /proc (3-5x slower)
AT_EMPTY_PATH = 0x1000
UTIME_OMIT = (1 << 30) - 2
SYS_FCHMODAT2 = 452  # (Linux 6.6; x86_64 and aarch64 alike)
libc.fchownat.argtypes = [
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_uint,
    ctypes.c_uint,
    ctypes.c_int,
]
libc.utimensat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int]
_fchmodat2 = [True]  # until the kernel says it has no fchmodat2
_Times = ctypes.c_long * 4


def chown_fd(fd: int, uid: int, gid: int) -> None:
    """chown the object behind *fd* (O_PATH is enough; a symlink itself);
    -1 leaves an id as it is."""
    checked(libc.fchownat(fd, b"", uid & 0xFFFFFFFF, gid & 0xFFFFFFFF, AT_EMPTY_PATH))


def utime_fd(fd: int, atime_ns: int | None, mtime_ns: int | None) -> None:
    """Set the times of the object behind *fd* (O_PATH is enough; a symlink
    itself); None leaves a time as it is."""
    a = (0, UTIME_OMIT) if atime_ns is None else divmod(atime_ns, 1_000_000_000)
    m = (0, UTIME_OMIT) if mtime_ns is None else divmod(mtime_ns, 1_000_000_000)
    checked(libc.utimensat(fd, b"", _Times(a[0], a[1], m[0], m[1]), AT_EMPTY_PATH))


def chmod_fd(fd: int, mode: int) -> None:
    """chmod the object behind *fd* (O_PATH is enough; not a symlink)."""
    if _fchmodat2[0]:
        try:
            checked(libc.syscall(SYS_FCHMODAT2, fd, b"", mode, AT_EMPTY_PATH))
            return
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EINVAL):
                raise
        _fchmodat2[0] = False  # an older kernel: through /proc
    os.chmod(proc(fd), mode)


def data_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    """The ranges of the first *size* bytes of the file open at *fd* that
    hold data (SEEK_DATA/SEEK_HOLE); the rest reads as zeros.  What reads a
    whole file costs in proportion to its data this way, not its size (a
    sparse file of a TiB holds none)."""
    return list(iter_data(fd, size))


def next_data(fd: int, pos: int, end: int) -> tuple[int, int] | None:
    """The first range of data of the file open at *fd* within [pos, end)
    (None: none; a filesystem that cannot say: all of it)."""
    try:
        start = os.lseek(fd, pos, os.SEEK_DATA)
    except OSError as e:
        if e.errno == errno.ENXIO:
            return None
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        return (pos, end) if pos < end else None
    if start >= end:
        return None
    return start, min(os.lseek(fd, start, os.SEEK_HOLE), end)


def iter_data(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """``data_ranges``, one range at a time (memory that does not grow
    with the number of extents)."""
    off = 0
    while off < size:
        try:
            start = os.lseek(fd, off, os.SEEK_DATA)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            return
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end
        off = end


def split(path: bytes) -> tuple[bytes, bytes]:
    """'a/b/c' -> ('a/b', 'c')."""
    head, _, tail = path.rpartition(b"/")
    return head, tail


def join(parent: bytes, name: bytes) -> bytes:
    return parent + b"/" + name if parent else name


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


SYS_OPENAT2 = 437  # (x86_64 and aarch64 alike)
RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH = 0x02, 0x04, 0x08
_HOW = _OpenHow(DIR_FLAGS, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
_openat2 = [True]  # until the kernel says it has no openat2


def open_dir(rootfd: int, path: bytes) -> int:
    """Open the directory *path* (relative to *rootfd*) as an O_PATH fd,
    following no symlink and never leaving *rootfd*: openat2 with
    RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS in one call where the kernel has
    it, else component by component."""
    if path and _openat2[0]:
        if (
            path[0] == 47
            or path[-1] == 47
            or b"//" in path
            or (b"." in path and any(c in (b".", b"..") for c in path.split(b"/")))
        ):
            raise OSError(errno.EINVAL, "bad path component", path)
        try:
            return checked(
                libc.syscall(SYS_OPENAT2, rootfd, path, ctypes.byref(_HOW), ctypes.sizeof(_HOW)),
                path,
            )
        except OSError as e:
            if e.errno == errno.ENOSYS:
                _openat2[0] = False
            elif e.errno != errno.ENAMETOOLONG:  # (deeper than PATH_MAX: walk it)
                raise
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

    READ_CACHE = 1024

    def __init__(self, rootfd: int, grave_fd: int):
        self.rootfd = rootfd
        self.grave_fd = grave_fd
        self._dirs: dict[bytes, int] | None = None
        self._acting = False
        self._held = 0  # `at` blocks open on cached fds
        self._retired: list[int] = []  # fds dropped from the cache while held
        self.generation = 0  # counts `moved` calls

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Within it, ``lstat`` keeps the directories it looked into open,
        so that looking at many names costs one open per directory.  For
        lookups only: nothing is ever written through these fds (a directory
        moved meanwhile would be looked into where it went)."""
        if self._dirs is not None:
            yield
            return
        self._dirs = {}
        try:
            yield
        finally:
            self._close_dirs()
            self._dirs = None

    @contextmanager
    def acting(self) -> Iterator[None]:
        """Within it, ``at`` takes directories from the cache too: for an
        undo or a redo, the only thing that changes the tree meanwhile (the
        file requests are held off), which calls ``moved`` after each step
        that moves or removes a directory."""
        outer = self._acting
        self._acting = True
        try:
            with self.reading():
                yield
        finally:
            self._acting = outer

    def moved(self) -> None:
        """A directory was moved or removed: the cached paths may be wrong."""
        self.generation += 1
        self._close_dirs()

    def _close_dirs(self) -> None:
        if self._dirs:
            if self._held:  # (in use: closed once released)
                self._retired += self._dirs.values()
            else:
                for fd in self._dirs.values():
                    os.close(fd)
            self._dirs.clear()

    def dir_fd(self, path: bytes) -> int:
        """An O_PATH fd on directory *path*, from the cache (within
        ``reading``; valid until the next call)."""
        return self._dir(path)

    def _dir(self, path: bytes) -> int:
        """An O_PATH fd on directory *path*, from the cache (see reading)."""
        if not path:
            return self.rootfd
        assert self._dirs is not None
        fd = self._dirs.get(path)
        if fd is not None:
            return fd
        # up to the nearest directory at hand, then down, a name at a time
        # (no recursion, whatever the depth)
        down = []
        p = path
        while True:
            parent, name = split(p)
            if name in (b"", b".", b".."):
                raise OSError(errno.EINVAL, "bad path component", path)
            down.append((p, name))
            found = self._dirs.get(parent) if parent else self.rootfd
            if found is not None:
                break
            p = parent
        pfd = found
        for p, name in reversed(down):
            pfd = os.open(name, DIR_FLAGS, dir_fd=pfd)
            if len(self._dirs) >= self.READ_CACHE:
                self._close_dirs()  # (pfd among them: it served its turn)
            self._dirs[p] = pfd
        return pfd

    @contextmanager
    def at(self, loc: bytes) -> Iterator[tuple[int, bytes]]:
        """(dirfd, name) for *loc*; the root itself is ('root fd', b'.')."""
        gid = grave_id(loc)
        if gid is not None:
            yield self.grave_fd, str(gid).encode()
            return
        if loc == b"":
            yield self.rootfd, b"."
            return
        parent, name = split(loc)
        if self._acting:
            fd = self._dir(parent)
            self._held += 1
            try:
                yield fd, name
            finally:
                self._held -= 1
                if not self._held and self._retired:
                    for old in self._retired:
                        os.close(old)
                    self._retired.clear()
            return
        fd = open_dir(self.rootfd, parent)
        try:
            yield fd, name
        finally:
            os.close(fd)

    def lstat(self, loc: bytes) -> os.stat_result | None:
        """What is at *loc*; None when nothing is (or a component of its
        path is gone)."""
        try:
            return self.lstat_strict(loc)
        except OSError:
            return None

    def lstat_strict(self, loc: bytes) -> os.stat_result | None:
        """What is at *loc*; None when nothing is; OSError when a directory
        of its path is gone (or is no directory)."""
        if self._dirs is not None and loc and not loc.startswith(GRAVE_PREFIX):
            parent, name = split(loc)
            return lstat_at(self._dir(parent), name)
        with self.at(loc) as (d, n):
            return lstat_at(d, n)


# An object's identity beyond its inode number, which the filesystem gives
# the next object made once it is freed: the file handle name_to_handle_at(2)
# encodes (ext4, xfs, tmpfs: the inode number and its generation, new at
# each reuse), with the mount it is on.  AT_HANDLE_FID (Linux 6.5) asks for
# one to compare only, which filesystems that cannot be exported give too.
MAX_HANDLE_SZ = 128
AT_HANDLE_FID = 0x200
_handle_flags = [AT_EMPTY_PATH | AT_HANDLE_FID]


class _FileHandle(ctypes.Structure):
    _fields_ = [
        ("handle_bytes", ctypes.c_uint),
        ("handle_type", ctypes.c_int),
        ("f_handle", ctypes.c_ubyte * MAX_HANDLE_SZ),
    ]


libc.name_to_handle_at.argtypes = [
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.POINTER(_FileHandle),
    ctypes.POINTER(ctypes.c_int),
    ctypes.c_int,
]


def object_id(fd: int) -> bytes | None:
    """The identity of the object behind *fd* (O_PATH is enough), to tell
    it from a later object given its inode number; None where the
    filesystem has no file handles."""
    fh = _FileHandle()
    mount_id = ctypes.c_int()
    while True:
        fh.handle_bytes = MAX_HANDLE_SZ
        try:
            checked(
                libc.name_to_handle_at(
                    fd, b"", ctypes.byref(fh), ctypes.byref(mount_id), _handle_flags[0]
                )
            )
            break
        except OSError as e:
            if e.errno == errno.EINVAL and _handle_flags[0] & AT_HANDLE_FID:
                _handle_flags[0] = AT_EMPTY_PATH  # (a kernel before 6.5)
                continue
            if e.errno in (errno.EOPNOTSUPP, errno.EOVERFLOW, errno.ENOSYS):
                return None
            raise
    n = fh.handle_bytes
    head = mount_id.value.to_bytes(4, "little", signed=True)
    return head + fh.handle_type.to_bytes(4, "little", signed=True) + bytes(fh.f_handle[:n])


# Filesystems whose objects are themselves stacked on another filesystem:
# the kernel counts such stacking (at most 2 deep), and FUSE passthrough to a
# file on one of them needs a connection that says it may stack 2 deep.
OVERLAYFS_MAGIC = 0x794C7630
FUSE_MAGIC = 0x65735546
ECRYPTFS_MAGIC = 0xF15F
STACKED = frozenset((OVERLAYFS_MAGIC, FUSE_MAGIC, ECRYPTFS_MAGIC))
libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]


def fs_type(fd: int) -> int:
    """The f_type of the filesystem *fd* (O_PATH is enough) is on."""
    buf = ctypes.create_string_buffer(256)  # (struct statfs: 120 bytes on 64-bit)
    checked(libc.fstatfs(fd, buf), call="fstatfs")
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def stable_handle(fd: int) -> bytes | None:
    """The file handle of the object behind *fd* without the mount's id: the
    same after the filesystem is mounted again (an overlay's handles name
    its layers' objects by their filesystems' uuids)."""
    oid = object_id(fd)
    return None if oid is None else oid[4:]


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


# (the directories a removal of a tree holds open at most: those above are
# let go, each known by its identity, and found again through "..")
HELD_LEVELS = 64


class _Level:
    __slots__ = ("fd", "name", "subdirs", "ident")

    def __init__(self, fd: int, name: bytes, subdirs: list[bytes]):
        self.fd = fd
        self.name = name
        self.subdirs = subdirs
        self.ident: bytes | None = None


def remove_tree_at(dirfd: int, name: bytes) -> None:
    """Remove *name* in *dirfd* and everything below it, never following
    symlinks (a directory at a time, however deep: no recursion, and no
    more than HELD_LEVELS descriptors however deep the tree -- a directory
    let go is found again through the ".." of the one below it, checked
    to be the very object it was)."""
    st = lstat_at(dirfd, name)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dirfd)
        return
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    stack: list[_Level] = []  # (each below the one before; the first in dirfd)

    def enter(parent: int, here: bytes) -> None:
        fd = os.open(here, flags, dir_fd=parent)
        subdirs = []
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(os.fsencode(entry.name))
                    else:
                        os.unlink(entry.name, dir_fd=fd)
        except BaseException:
            os.close(fd)
            raise
        stack.append(_Level(fd, here, subdirs))
        if len(stack) > HELD_LEVELS:
            far = stack[-HELD_LEVELS - 1]
            if far.fd >= 0:
                far.ident = object_id(far.fd)
                if far.ident is not None:  # (else it stays held)
                    os.close(far.fd)
                    far.fd = -1

    try:
        enter(dirfd, name)
        while stack:
            top = stack[-1]
            if top.subdirs:
                enter(top.fd, top.subdirs.pop())
                continue
            stack.pop()
            try:
                if stack and stack[-1].fd < 0:
                    above = stack[-1]
                    fd = os.open(b"..", flags, dir_fd=top.fd)
                    if object_id(fd) != above.ident:
                        os.close(fd)
                        raise OSError(errno.ESTALE, "a directory moved while its tree was removed")
                    above.fd = fd
            finally:
                os.close(top.fd)
            os.rmdir(top.name, dir_fd=stack[-1].fd if stack else dirfd)
    finally:
        for level in stack:
            if level.fd >= 0:
                os.close(level.fd)


# -- has it changed since? -------------------------------------------------------------

UNREACHABLE = "unreachable"  # (a directory of the path is gone, or is no directory)


def _print(st: os.stat_result) -> list:
    return [st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def fingerprint(resolver: Resolver, loc: bytes) -> list | None:
    """What is at *loc*, as it must still be for nothing there to have
    changed: [inode, mode, uid, gid, size, mtime, ctime] (ns); None: nothing
    is there; [UNREACHABLE].  The ctime changes with anything done to the
    object: its content, attributes, xattrs, and for a directory its
    entries.  What the unmount's drift record and a rollback's seal (for
    its redo) keep of every location they watch."""
    try:
        st = resolver.lstat_strict(loc)
    except OSError:
        return [UNREACHABLE]
    return None if st is None else _print(st)


def fingerprints(resolver: Resolver, locs: Iterable[bytes]) -> list[tuple[bytes, list | None]]:
    """(location, ``fingerprint(resolver, location)``) for each of *locs*
    (within ``resolver.reading()``), with less work: a directory is looked
    up once for the names in it that come one after another (sorted
    *locs*).  This runs for every location a layer or a rollback touched."""
    out: list[tuple[bytes, list | None]] = []
    parent, fd = None, None
    for loc in locs:
        if not loc:
            out.append((loc, fingerprint(resolver, loc)))
            continue
        if loc.startswith(GRAVE_PREFIX):
            parent, fd, name = None, resolver.grave_fd, loc[len(GRAVE_PREFIX) :]
        else:
            head, _, name = loc.rpartition(b"/")
            if head != parent:
                parent = head
                try:
                    fd = resolver.dir_fd(head)
                except OSError:
                    fd = None
        try:
            if fd is None:
                raise NotADirectoryError
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            out.append((loc, None))
        except OSError:
            out.append((loc, [UNREACHABLE]))
        else:
            out.append((loc, _print(st)))
    return out
