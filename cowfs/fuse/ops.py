"""The filesystem semantics of the mounted view, engine-neutral: each FUSE
engine (``kernel_engine``, ``pyfuse3_engine``) turns kernel requests into
calls of these plain, synchronous methods and their results into replies.

Every operation works on the backing directory through O_PATH fds kept per
inode (never through paths that could follow a planted symlink) and, before
it changes anything, has the ``Recorder`` write the reverse diff into the open
layer.  Operations run one at a time, each to its end (an engine serves
requests one by one, and a layer switch holds them off), so each is atomic
with respect to the others and to layer switches.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable
from time import monotonic
from types import TracebackType
from typing import Any, NoReturn, Protocol, TypeVar

from ..layers.capture import Recorder
from ..layers.undo import Touched
from ..storage import schema
from ..storage.gravesum import Hasher
from ..storage.store import LimitReached, Store, Writer
from ..system import backing
from .inodes import DirHandle, Handle, InodeTable, Node

log = logging.getLogger("cowfs.ops")

TIMEOUT = 300.0
RELATIME_AGE = 24 * 3600 * 10**9  # relatime updates an atime at least this often
CAPABILITY = b"security.capability"
# A file opened only for reading is served by passthrough from this size on;
# a smaller one through the page cache (kept between opens): for it the
# backing-file handover (two ioctls and an fd per open) and the GETATTR the
# kernel sends at the next stat after every passthrough read (it drops the
# atime it holds) cost more than the READ requests they save.  Measured on
# 3,000 files of the stdlib tree, daemon + client CPU: a cold cat the same,
# a warm one 21-40 % less, a stat of them all 65 % less.
PASSTHROUGH_READ_MIN = 256 << 10

R = TypeVar("R")


class Ctx:
    """Who makes a request (what both engines hand over)."""

    __slots__ = ("pid", "uid", "gid", "umask")

    def __init__(self, pid: int, uid: int, gid: int, umask: int):
        self.pid, self.uid, self.gid, self.umask = pid, uid, gid, umask


class Caller(Protocol):
    """Who makes a request, as the operations read it: a ``Ctx`` (the kernel
    engine's) or pyfuse3's RequestContext (the pyfuse3 engine hands it on)."""

    @property
    def pid(self) -> int: ...
    @property
    def uid(self) -> int: ...
    @property
    def gid(self) -> int: ...
    @property
    def umask(self) -> int: ...


def in_group(ctx: Caller, gid: int) -> bool:
    """Whether the requesting process is in group *gid* (its own, or one of
    its supplementary groups, read from /proc)."""
    if ctx.gid == gid:
        return True
    try:
        with open(f"/proc/{ctx.pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return str(gid) in line.split()[1:]
    except OSError:
        pass
    return False


def fail(code: int) -> OSError:
    return OSError(code, os.strerror(code))


class errno_only:
    """How every FUSE request ends (the mount's operations and the view's
    handlers): with its result, or with an OSError whose errno the engine
    answers; anything unexpected is logged and becomes EIO, so that no
    stray exception reaches the engine's loop and takes the mount down.
    A context manager made once per handler (``with guard:`` costs a
    fraction of a generator-based one, on every request)."""

    __slots__ = ("name", "logger")

    def __init__(self, name: str, logger: logging.Logger = log):
        self.name, self.logger = name, logger

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if kind is not None and issubclass(kind, Exception) and not issubclass(kind, OSError):
            assert exc is not None  # (an exception was raised: *kind* is its type)
            self.logger.error("%s failed", self.name, exc_info=(kind, exc, tb))
            raise fail(errno.EIO) from None


def op(fn: Callable[..., R]) -> Callable[..., R]:
    """Every operation: note who asks (captures made for the request are
    attributed to the process), and anything unexpected becomes EIO (logged,
    see errno_only): engines answer an OSError's errno."""
    name = fn.__name__
    takes_ctx = (
        "ctx" in fn.__code__.co_varnames[: fn.__code__.co_argcount + fn.__code__.co_kwonlyargcount]
    )

    guard = errno_only(name)

    @functools.wraps(fn)
    def wrapper(self: Ops, *args: object, ctx: Caller | None = None, **kw: object) -> R:
        self.last_request = monotonic()  # (background work waits for a pause)
        recorder = self.recorder
        recorder.who = (ctx.pid, ctx.uid) if ctx is not None else None
        if recorder.ignore is not None:  # .cowfsignore may have changed
            recorder.ignore.stale = True
        if takes_ctx:
            kw["ctx"] = ctx
        with guard:
            try:
                try:
                    return fn(self, *args, **kw)
                except OSError as e:
                    # a change fails before it touches anything: once the room
                    # a redo kept is given back, it is tried once more
                    if e.errno != errno.ENOSPC or self.on_full is None or not self.on_full():
                        raise
                return fn(self, *args, **kw)
            except LimitReached:
                self._refused(name, args)
                raise

    return wrapper


# requests that name a new or removed entry (parent, name)
NAMING = ("create", "mknod", "mkdir", "symlink", "unlink", "rmdir", "rename")
# requests that name their file by an open handle
HANDLE_OPS = ("write", "fallocate", "copy_file_range", "flush", "release", "fsync")


class Ops:
    """The filesystem's operations on the backing directory *rootfd*, each
    captured in the open layer of *store* through *recorder* before it
    changes anything; the nodes the kernel knows are in ``table`` (an
    ``InodeTable``), the open files and directories in ``handles``.
    *hidden*: the store's name in the root, when it is inside the
    workspace (not shown, not to be made)."""

    def __init__(
        self, rootfd: int, store: Store, recorder: Recorder, *, hidden: bytes | None = None
    ):
        self.store = store
        self.recorder = recorder
        self.hidden = hidden
        hst = backing.lstat_at(rootfd, hidden) if hidden is not None else None
        self.hidden_dir = hst is not None and stat.S_ISDIR(hst.st_mode)
        # called when a request fails with ENOSPC: True when it gave room back
        self.on_full: Callable[[], bool] | None = None
        self.is_root = os.geteuid() == 0
        self.euid, self.egid = os.geteuid(), os.getegid()
        self.noatime = bool(os.fstatvfs(rootfd).f_flag & os.ST_NOATIME)
        # On an overlay, opening a file for writing can change its times
        # before anything is written: a file whose metadata alone was
        # copied up (metacopy: after a chmod, a rename) gets its data
        # copied up then, and its mtime is the time of that copy.  Its
        # attributes are captured before such an open, not at the first write.
        self.open_changes_times = backing.fs_type(rootfd) == backing.OVERLAYFS_MAGIC
        self.table = table = InodeTable(rootfd, store.grave_fd, hidden)
        self.fds = table.fds
        self.root = table.root
        self.grave = table.grave
        # (the table's, bound here: what every request calls, called as
        # directly as when they were methods of this class)
        self._node = table.node
        self._lookup = table.lookup
        self._path = table.path
        self.handles: dict[int, Handle | DirHandle] = {}
        self.next_fh = 1
        # Files open for writing: only they can have dirty pages (shared
        # mmaps) in the kernel that a layer switch must flush first.
        self.writers = 0
        # files written through passthrough: how many such opens
        self.pt_writers: dict[Node, int] = {}
        self.grave_links = store.grave_counts()
        # told before the bytes of an object change
        self.sums: Hasher | None = None
        self.last_request = time.monotonic()
        # changes refused (ENOSPC) because --max-store was reached: how
        # many since the mount, and the last one's path and time
        self.refused: dict[str, Any] = {"count": 0, "path": None, "time": None}

    # -- names -------------------------------------------------------------------------

    def nlink(self, node: Node, st: os.stat_result) -> int:
        """The link count as the view has it: names in the grave are gone,
        a removed directory has none left, and the hidden store is no
        subdirectory of the root."""
        buried = self.grave_links.get(st.st_ino, 0)
        if not stat.S_ISDIR(st.st_mode):
            return st.st_nlink - buried
        if buried:
            return 0
        # (a directory's count of 1 is "not counted": an overlay's merged
        # directories, btrfs -- nothing to take away)
        return st.st_nlink - (node is self.root and self.hidden_dir and st.st_nlink > 1)

    def _child(self, parent: Node, name: bytes) -> bytes:
        try:
            return backing.join(self._path(parent), name)
        except OSError as e:
            if not parent.live or parent is self.root:
                raise
            # (a directory an undo moved into one the table has no node of,
            # or one the kernel forgot since: found by its identity)
            try:
                return backing.join(self.table.loc(parent), name)
            except OSError:
                raise e from None

    def _check_name(self, parent: Node, name: bytes) -> None:
        if parent is self.root and self.hidden is not None and name == self.hidden:
            raise fail(errno.EPERM)

    # -- capture helpers -------------------------------------------------------------

    def _dir_changes(self, w: Writer, *dirs: Node) -> None:
        """Capture directories' attributes (mtimes!) before their entries change."""
        for d in dirs:
            o = self.recorder.obj(d.bino)
            if not (o.created or o.meta):
                self.recorder.meta(w, d.bino, functools.partial(self.table.loc, d), os.stat(d.fd))

    def _unreachable(self, node: Node, st: os.stat_result) -> bool:
        """An object with no name left (open, unlinked, its grave entry freed
        by a commit) cannot be put back anywhere: nothing to capture."""
        if st.st_nlink == 0:
            self.recorder.note_created(node.bino)
            return True
        return False

    def _capture_meta(self, node: Node) -> None:
        o = self.recorder.obj(node.bino)
        if o.created or o.meta:
            return
        st = os.stat(node.fd)
        if self._unreachable(node, st):
            return
        with self.recorder.txn() as w:
            self.recorder.meta(w, node.bino, functools.partial(self.table.loc, node), st)

    def _capture_data(
        self, node: Node, fd: int | None, start: int, end: int, zeroing: bool = False
    ) -> None:
        """Capture [start, end) of a regular file before it changes; *fd*: a
        readable fd on it, or None to open one.  *zeroing*: the change only
        makes those bytes zeros or cuts them off (see ``Recorder.data``)."""
        o = self.recorder.obj(node.bino)
        if o.created:
            return
        own = fd is None
        if fd is None:
            fd = backing.open_noatime(backing.proc(node.fd), os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if self._unreachable(node, st):
                return
            with self.recorder.txn() as w, backing.noatime(fd):
                self.recorder.data(
                    w,
                    node.bino,
                    functools.partial(self.table.loc, node),
                    fd,
                    st,
                    start,
                    end,
                    zeroing,
                )
        finally:
            if own:
                os.close(fd)

    def _xpath(self, node: Node) -> tuple[bytes, bool]:
        if node.islnk:
            parent, name = self.table.symlink_name(node)
            return backing.proc_at(parent.fd, name), False
        return backing.proc(node.fd), True

    def _capture_xattrs(self, node: Node) -> None:
        o = self.recorder.obj(node.bino)
        if o.created or o.xattrs or self._unreachable(node, os.stat(node.fd)):
            return
        with self.recorder.txn() as w:
            self.recorder.xattrs(
                w,
                node.bino,
                functools.partial(self.table.loc, node),
                lambda: backing.list_xattrs(*self._xpath(node)),
                stat.S_ISDIR(node.mode),
            )

    def _own(
        self, parent: Node, name: bytes, ctx: Caller, mode: int, fd: int | None = None
    ) -> None:
        """Give a new object the caller's uid and gid (or the directory's gid
        under a setgid directory), as the kernel would."""
        if not self.is_root:
            return
        # (the directory's mode is kept current: by setattr and after an undo)
        inherit = parent.mode & stat.S_ISGID
        gid = os.stat(parent.fd).st_gid if inherit else ctx.gid
        if ctx.uid == self.euid and (inherit or gid == self.egid):
            # the backing filesystem gave it these ids already: nothing to
            # change (and no setuid or setgid bit for a chown to clear)
            return
        if fd is not None:
            os.fchown(fd, ctx.uid, gid)
            if mode & (stat.S_ISUID | stat.S_ISGID):
                os.fchmod(fd, stat.S_IMODE(mode))
        else:
            os.chown(name, ctx.uid, gid, dir_fd=parent.fd, follow_symlinks=False)
            if mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISLNK(mode):
                fd2 = os.open(name, backing.PATH_FLAGS, dir_fd=parent.fd)
                try:
                    backing.chmod_fd(fd2, stat.S_IMODE(mode))
                finally:
                    os.close(fd2)

    def _new_object(
        self, parent: Node, name: bytes, make: Callable[[], None], ctx: Caller, mode: int
    ) -> tuple[Node, os.stat_result]:
        """Record the creation, make the object, own it, look it up."""
        self._check_name(parent, name)
        if backing.lstat_at(parent.fd, name) is not None:
            raise fail(errno.EEXIST)
        self.recorder.obj(parent.bino)
        named = not self.recorder.ignored(
            functools.partial(self._child, parent, name), stat.S_ISDIR(mode), None, parent.bino
        )
        if named:
            named = not self.recorder.matched  # (recorded at a captured path)
            with self.recorder.txn() as w:
                self._dir_changes(w, parent)
                self.recorder.create(w, self._child(parent, name), parent.bino)
        make()
        self._own(parent, name, ctx, mode)
        node, st = self._lookup(parent, name)
        self.recorder.note_created(st.st_ino, named)
        node.nocap = True  # (a new object has no capabilities)
        return node, st

    # -- lookups and attributes ------------------------------------------------------

    @op
    def lookup(self, parent_inode: int, name: bytes, ctx: Caller) -> tuple[Node, os.stat_result]:
        parent = self._node(parent_inode)
        if name == b"." or name == b"..":
            node = parent if name == b"." or parent.parent is None else parent.parent
            if node is self.grave:
                raise fail(errno.ENOENT)
            node.nlookup += 1
            return node, os.stat(node.fd)
        if parent is self.root and name == self.hidden:
            raise fail(errno.ENOENT)
        return self._lookup(parent, name)

    @op
    def forget(self, inode_list: Iterable[tuple[int, int]]) -> None:
        self.table.forget(inode_list)

    @op
    def getattr(self, inode: int) -> tuple[Node, os.stat_result]:
        node = self._node(inode)
        return node, os.stat(node.fd)

    @op
    def setattr(
        self,
        inode: int,
        fh: int | None,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
        kill_suidgid: bool = False,
        ctx: Caller | None = None,
    ) -> tuple[Node, os.stat_result]:
        """Set what is not None (uid/gid -1: leave it); nothing at all: a
        change of the ctime alone.  *kill_suidgid*: a truncation by a caller
        without CAP_FSETID (see ``_kill_privs``)."""
        node = self._node(inode)
        handle = self.handles.get(fh) if fh is not None else None
        if isinstance(handle, Handle):
            self.fds.using(handle)
        if size is not None or uid is not None or gid is not None:
            self._kill_privs(node, kill_suidgid and size is not None, ctx)
        if size is not None:
            if not stat.S_ISREG(node.mode):
                raise fail(errno.EINVAL)
            fd = handle.fd if isinstance(handle, Handle) else None
            self._capture_data(node, fd, size, 1 << 63, zeroing=True)
            self._rewriting(node)
            if fd is not None:
                os.ftruncate(fd, size)
            else:
                if self.open_changes_times:
                    self._capture_meta(node)
                wfd = os.open(backing.proc(node.fd), os.O_WRONLY | os.O_CLOEXEC)
                try:
                    os.ftruncate(wfd, size)
                finally:
                    os.close(wfd)
        if not (mode is uid is gid is atime_ns is mtime_ns is None):
            self._capture_meta(node)
            if uid is not None or gid is not None:
                self._chown(node, -1 if uid is None else uid, -1 if gid is None else gid)
            if mode is not None and not node.islnk:
                backing.chmod_fd(node.fd, stat.S_IMODE(mode))
            if atime_ns is not None or mtime_ns is not None:
                backing.utime_fd(node.fd, atime_ns, mtime_ns)  # (a symlink itself)
        elif size is None:
            # A change of nothing but the ctime (chown(f, -1, -1)), or what
            # the kernel asks of us to drop setuid/setgid before an
            # unprivileged write (HANDLE_KILLPRIV_V2): ext4 updates the ctime
            # and drops those bits, and so does this no-op chown of the
            # backing object -- the mode is captured first when they are set.
            # (A ctime needs no capture: it cannot be put back.)
            if os.stat(node.fd).st_mode & (stat.S_ISUID | stat.S_ISGID):
                self._capture_meta(node)
            self._chown(node, -1, -1)
        st = os.stat(node.fd)
        node.mode = st.st_mode
        return node, st

    def _kill_privs(self, node: Node, suidgid: bool, ctx: Caller | None = None) -> None:
        """Before a write, truncation or change of owner: the backing
        filesystem drops the object's capabilities (security.capability) as
        the daemon makes the change -- captured here first; with *suidgid*
        (the kernel leaves it to us under HANDLE_KILLPRIV_V2: the caller has
        no CAP_FSETID), the setuid bit goes, and the setgid bit of a
        group-executable file, or of one whose group the caller (*ctx*) is
        not in, as the kernel clears them."""
        if not stat.S_ISREG(node.mode):
            return
        if not node.nocap:
            try:
                os.getxattr(backing.proc(node.fd), CAPABILITY)
                self._capture_xattrs(node)
            except OSError as e:
                if e.errno != errno.ENODATA:
                    raise
                node.nocap = True
        if suidgid:
            st = os.stat(node.fd)
            mode = st.st_mode
            kept = mode & ~stat.S_ISUID
            if mode & stat.S_IXGRP or (
                mode & stat.S_ISGID and ctx is not None and not in_group(ctx, st.st_gid)
            ):
                kept &= ~stat.S_ISGID
            if kept != mode:
                self._capture_meta(node)
                backing.chmod_fd(node.fd, stat.S_IMODE(kept))
                node.mode = kept

    def _chown(self, node: Node, uid: int, gid: int) -> None:
        backing.chown_fd(node.fd, uid, gid)  # (a symlink itself)

    @op
    def readlink(self, inode: int, ctx: Caller) -> bytes:
        return os.readlink(b"", dir_fd=self._node(inode).fd)

    @op
    def access(self, inode: int, mode: int, ctx: Caller) -> bool:
        return True

    @op
    def statfs(self) -> os.statvfs_result:
        """The backing filesystem's, with the free blocks capped by what
        --max-store still leaves for undo data, so that `df` explains an
        ENOSPC the limit causes (its size shrinks likewise, so what it
        says is used stays true)."""
        sv = os.fstatvfs(self.root.fd)
        limit = self.store.max_store
        if not limit:
            return sv
        left = max(0, limit - self.store.data_bytes()) // (sv.f_frsize or sv.f_bsize or 4096)
        free = min(sv.f_bfree, left)
        return os.statvfs_result(
            (
                sv.f_bsize,
                sv.f_frsize,
                sv.f_blocks - sv.f_bfree + free,
                free,
                min(sv.f_bavail, left),
                sv.f_files,
                sv.f_ffree,
                sv.f_favail,
                sv.f_flag,
                sv.f_namemax,
            )
        )

    # -- creating names ----------------------------------------------------------------

    @op
    def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Caller
    ) -> tuple[Node, os.stat_result]:
        parent = self._node(parent_inode)
        mode &= ~ctx.umask
        return self._new_object(
            parent, name, lambda: os.mknod(name, mode, rdev, dir_fd=parent.fd), ctx, mode
        )

    @op
    def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: Caller
    ) -> tuple[Node, os.stat_result]:
        parent = self._node(parent_inode)
        mode = (mode & ~ctx.umask) | stat.S_IFDIR
        return self._new_object(
            parent, name, lambda: os.mkdir(name, stat.S_IMODE(mode), dir_fd=parent.fd), ctx, mode
        )

    @op
    def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: Caller
    ) -> tuple[Node, os.stat_result]:
        parent = self._node(parent_inode)
        return self._new_object(
            parent,
            name,
            lambda: os.symlink(target, name, dir_fd=parent.fd),
            ctx,
            stat.S_IFLNK | 0o777,
        )

    @op
    def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Caller
    ) -> tuple[Node, os.stat_result]:
        node = self._node(inode)
        parent = self._node(new_parent_inode)
        self._check_name(parent, new_name)
        if backing.lstat_at(parent.fd, new_name) is not None:
            raise fail(errno.EEXIST)
        self.recorder.obj(parent.bino)
        at, name = self.table.symlink_name(node) if node.islnk else (node, b"")
        with self.recorder.txn() as w:
            self._dir_changes(w, parent)
            self.recorder.link(w, self._child(parent, new_name), parent.bino)
            self.recorder.attribute(w, node.bino)
        if node.islnk:
            os.link(name, new_name, src_dir_fd=at.fd, dst_dir_fd=parent.fd, follow_symlinks=False)
        else:
            os.link(backing.proc(node.fd), new_name, dst_dir_fd=parent.fd, follow_symlinks=True)
        return self._lookup(parent, new_name)

    @op
    def create(
        self,
        parent_inode: int,
        name: bytes,
        mode: int,
        flags: int,
        ctx: Caller,
        kill_suidgid: bool = False,
    ) -> tuple[int, bool, Node, os.stat_result]:
        parent = self._node(parent_inode)
        self._check_name(parent, name)
        if backing.lstat_at(parent.fd, name) is not None:
            if flags & os.O_EXCL:
                raise fail(errno.EEXIST)
            node, st = self._lookup(parent, name)
            fh, keep = self._open(node, flags & ~os.O_CREAT, ctx, kill_suidgid)
            return fh, keep, node, os.stat(node.fd)
        mode = (mode & ~ctx.umask) | stat.S_IFREG
        self.recorder.obj(parent.bino)
        named = not self.recorder.ignored(
            functools.partial(self._child, parent, name), False, None, parent.bino
        )
        if named:
            named = not self.recorder.matched  # (recorded at a captured path)
            with self.recorder.txn() as w:
                self._dir_changes(w, parent)
                self.recorder.create(w, self._child(parent, name), parent.bino)
        fl = self._open_flags(flags)
        fd = self.fds.open(
            name, fl | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, stat.S_IMODE(mode), parent.fd
        )
        try:
            self._own(parent, name, ctx, mode, fd)
            node, st = self._lookup(parent, name, made=os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        self.recorder.note_created(st.st_ino, named)
        node.nocap = True
        return (*self._new_handle(node, fd, flags, fl), node, st)

    # -- removing and moving names -------------------------------------------------------

    def _bury(self, w: Writer, parent: Node, name: bytes, st: os.stat_result) -> int:
        """Record that *name* goes to the grave; the caller moves it."""
        return self.recorder.grave(w, self._child(parent, name), st, parent.bino)

    def _to_grave(self, parent: Node, name: bytes, gid: int, bino: int) -> None:
        gname = str(gid).encode()
        backing.renameat2(parent.fd, name, self.grave.fd, gname, backing.RENAME_NOREPLACE)
        self.grave_links[bino] = self.grave_links.get(bino, 0) + 1
        node = self.table.by_bino(bino)
        if node is not None:
            self.table.remove_link(node, parent, name)
            self.table.add_link(node, self.grave, gname)
            if node in self.pt_writers:  # (written on unseen: no hash of it can hold)
                self._rewriting(node)

    def _remove(self, parent: Node, name: bytes, want_dir: bool) -> None:
        self._check_name(parent, name)
        st = os.stat(name, dir_fd=parent.fd, follow_symlinks=False)
        isdir = stat.S_ISDIR(st.st_mode)
        if want_dir and not isdir:
            raise fail(errno.ENOTDIR)
        if not want_dir and isdir:
            raise fail(errno.EISDIR)
        self.recorder.obj(parent.bino)
        if self.recorder.ignored(
            functools.partial(self._child, parent, name), isdir, st.st_ino, parent.bino
        ):
            # Not captured: removed for real, the parent's times are left.
            self._last_name(st)
            if isdir:
                os.rmdir(name, dir_fd=parent.fd)
            else:
                os.unlink(name, dir_fd=parent.fd)
            node = self.table.by_bino(st.st_ino)
            if node is not None:
                self.table.remove_link(node, parent, name)
            if isdir or st.st_nlink == 1:
                self.table.orphan(st.st_ino)
            return
        if not isdir and self.recorder.obj(st.st_ino).created:
            # Nothing to keep.  (Directories always go to the grave, even
            # new ones: earlier records may name paths inside them, and those
            # must resolve while a rollback replays them.)
            self._last_name(st)
            with self.recorder.txn() as w:
                self._dir_changes(w, parent)
            os.unlink(name, dir_fd=parent.fd)
            node = self.table.by_bino(st.st_ino)
            if node is not None:
                self.table.remove_link(node, parent, name)
            if st.st_nlink == 1:
                self.table.orphan(st.st_ino)
            return
        if isdir and not self._is_empty(parent, name):
            raise fail(errno.ENOTEMPTY)
        self._last_name(st)  # (the grave's name goes at a base commit)
        with self.recorder.txn() as w:
            self._dir_changes(w, parent)
            gid = self._bury(w, parent, name, st)
        self._to_grave(parent, name, gid, st.st_ino)

    def _last_name(self, st: os.stat_result) -> None:
        """The name of *st*'s object is about to go (for real, or into the
        grave, whose name a base commit takes): if it was the last and a
        program has the file open, the node's fd is kept open from now
        (pinned: it could not be opened again by a name), counted against
        the requester -- EMFILE, before anything changes, for one who holds
        its share of such files already."""
        if st.st_nlink == 1 and not stat.S_ISDIR(st.st_mode):
            node = self.table.by_bino(st.st_ino)
            if node is not None and node.nopen:
                who = self.recorder.who
                self.fds.pin(node, who[1] if who is not None else -1)

    def _is_empty(self, parent: Node, name: bytes) -> bool:
        fd = backing.open_noatime(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent.fd
        )
        try:
            with os.scandir(fd) as it:
                return next(it, None) is None
        finally:
            os.close(fd)

    @op
    def unlink(self, parent_inode: int, name: bytes, ctx: Caller) -> None:
        self._remove(self._node(parent_inode), name, want_dir=False)

    @op
    def rmdir(self, parent_inode: int, name: bytes, ctx: Caller) -> None:
        self._remove(self._node(parent_inode), name, want_dir=True)

    @op
    def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: Caller,
    ) -> None:
        sp = self._node(parent_inode_old)
        dp = self._node(parent_inode_new)
        self._check_name(sp, name_old)
        self._check_name(dp, name_new)
        sst = os.stat(name_old, dir_fd=sp.fd, follow_symlinks=False)
        dst = backing.lstat_at(dp.fd, name_new)
        src_path, dst_path = self._child(sp, name_old), self._child(dp, name_new)
        self.recorder.obj(sp.bino), self.recorder.obj(dp.bino)
        if flags & backing.RENAME_EXCHANGE:
            if dst is None:
                raise fail(errno.ENOENT)
            with self.recorder.txn() as w:
                self._dir_changes(w, sp, dp)
                self.recorder.exchange(
                    w, src_path, dst_path, sst.st_ino, dst.st_ino, sp.bino, dp.bino
                )
            backing.renameat2(sp.fd, name_old, dp.fd, name_new, backing.RENAME_EXCHANGE)
            self.table.relink(sst.st_ino, sp, name_old, dp, name_new)
            self.table.relink(dst.st_ino, dp, name_new, sp, name_old)
            return
        if dst is not None:
            if flags & backing.RENAME_NOREPLACE:
                raise fail(errno.EEXIST)
            if dst.st_ino == sst.st_ino:
                return
            if stat.S_ISDIR(dst.st_mode):
                if not stat.S_ISDIR(sst.st_mode):
                    raise fail(errno.EISDIR)
                if not self._is_empty(dp, name_new):
                    raise fail(errno.ENOTEMPTY)
            elif stat.S_ISDIR(sst.st_mode):
                raise fail(errno.ENOTDIR)
        isdir = stat.S_ISDIR(sst.st_mode)
        dst_ignored = dst is not None and self.recorder.ignored(
            dst_path, isdir, dst.st_ino, dp.bino
        )
        # Within ignored paths nothing is recorded, unless the object replaced
        # was seen at a captured path (it is kept, as any captured object).
        quiet = (
            not flags & backing.RENAME_WHITEOUT
            and self.recorder.ignored(src_path, isdir, sst.st_ino, sp.bino)
            and (
                dst_ignored
                if dst is not None
                else self.recorder.ignored(dst_path, isdir, None, dp.bino)
            )
        )
        bury = (
            dst is not None
            and not dst_ignored
            and (stat.S_ISDIR(dst.st_mode) or not self.recorder.obj(dst.st_ino).created)
        )
        whiteout = flags & backing.RENAME_WHITEOUT
        if dst is not None:
            self._last_name(dst)  # (the object replaced may be open)
        gid = None
        with self.recorder.txn() as w:
            if not quiet:  # (within ignored paths: nothing is recorded)
                self._dir_changes(w, sp, dp)
                if bury:
                    assert dst is not None  # (only a name there can be buried)
                    gid = self._bury(w, dp, name_new, dst)
                self.recorder.rename(w, src_path, dst_path, sst.st_ino, sp.bino, dp.bino)
                if whiteout:  # undone first: the whiteout leaves the name free
                    self.recorder.create(w, src_path, sp.bino)
        if gid is not None:
            assert dst is not None  # (buried: the name replaced)
            self._to_grave(dp, name_new, gid, dst.st_ino)
        try:
            backing.renameat2(sp.fd, name_old, dp.fd, name_new, whiteout)
        except OSError:
            if gid is not None:
                assert dst is not None
                self._from_grave(gid, dp, name_new, dst.st_ino)
            raise
        if whiteout:
            self._own(sp, name_old, ctx, stat.S_IFCHR)
            self.recorder.note_created(
                os.stat(name_old, dir_fd=sp.fd, follow_symlinks=False).st_ino
            )
        if dst is not None and gid is None:
            node = self.table.by_bino(dst.st_ino)
            if node is not None:
                self.table.remove_link(node, dp, name_new)
            if dst.st_nlink == 1:
                self.table.orphan(dst.st_ino)
        self.table.relink(sst.st_ino, sp, name_old, dp, name_new)

    def _from_grave(self, gid: int, parent: Node, name: bytes, bino: int) -> None:
        """Undo _to_grave after a failed rename (the records stay; their undo
        steps find nothing to do)."""
        gname = str(gid).encode()
        backing.renameat2(self.grave.fd, gname, parent.fd, name, backing.RENAME_NOREPLACE)
        self.grave_links[bino] -= 1
        node = self.table.by_bino(bino)
        if node is not None:
            self.table.remove_link(node, self.grave, gname)
            self.table.add_link(node, parent, name)

    # -- files ------------------------------------------------------------------------

    def _open_flags(self, flags: int) -> int:
        acc = flags & os.O_ACCMODE
        if acc == os.O_WRONLY:
            acc = os.O_RDWR  # capturing reads the old bytes
        return (
            (
                flags
                & ~(
                    os.O_ACCMODE
                    | os.O_CREAT
                    | os.O_EXCL
                    | os.O_NOCTTY
                    | os.O_NOFOLLOW
                    | os.O_DIRECT
                )
            )
            | acc
            | os.O_CLOEXEC
        )

    def _new_handle(self, node: Node, fd: int, flags: int, fd_flags: int) -> tuple[int, bool]:
        """(fh, whether the kernel may keep the cached pages); *fd* was
        opened with *fd_flags* (and is opened so again if it is evicted)."""
        fh = self.next_fh
        self.next_fh += 1
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        self.writers += writable
        h = self.handles[fh] = Handle(node, fd, fd_flags, writable, self.recorder.who)
        self.fds.opened(node, h)
        return fh, self._keep_cache(fd, flags)

    def _keep_cache(self, fd: int, flags: int) -> bool:
        """Whether the kernel may keep the file's cached pages for this open.
        A read the cache answers never reaches the backing file, so it never
        updates the atime (the kernel leaves FUSE atimes to the daemon).
        Where the next read would update it (relatime: the atime is not
        newer than the mtime or ctime, or is a day old), the cache is dropped
        so that the read comes here, as reads of the native file would."""
        if self.noatime or flags & os.O_NOATIME or flags & os.O_ACCMODE == os.O_WRONLY:
            return True
        st = os.fstat(fd)
        return (
            st.st_atime_ns > max(st.st_mtime_ns, st.st_ctime_ns)
            and time.time_ns() - st.st_atime_ns < RELATIME_AGE
        )

    @op
    def open(
        self, inode: int, flags: int, ctx: Caller, kill_suidgid: bool = False
    ) -> tuple[int, bool]:
        """*kill_suidgid*: an O_TRUNC open by a caller without CAP_FSETID."""
        return self._open(self._node(inode), flags, ctx, kill_suidgid)

    def _open(self, node: Node, flags: int, ctx: Caller, kill_suidgid: bool) -> tuple[int, bool]:
        if flags & os.O_TRUNC and stat.S_ISREG(node.mode):
            self._kill_privs(node, kill_suidgid, ctx)
            self._capture_data(node, None, 0, 1 << 63, zeroing=True)
            self._rewriting(node)
        fl = self._open_flags(flags)
        if self.open_changes_times and flags & os.O_ACCMODE != os.O_RDONLY:
            self._capture_meta(node)
        try:
            fd = self.fds.open(backing.proc(node.fd), fl)
        except PermissionError:
            fl = (fl & ~os.O_ACCMODE) | (flags & os.O_ACCMODE)
            fd = self.fds.open(backing.proc(node.fd), fl)
        return self._new_handle(node, fd, flags, fl)

    def _file(self, fh: int) -> Handle:
        """The open file *fh* (EBADF for a directory handle)."""
        h = self.handles[fh]
        if not isinstance(h, Handle):
            raise fail(errno.EBADF)
        fds = self.fds  # (its fd is open, and stays so while the request runs)
        if h is not fds.busy:
            fds.busy2, fds.busy = fds.busy, h
        if h.fd < 0:
            fds.reopen_handle(h)
        return h

    def _dir(self, fh: int) -> DirHandle:
        """The open directory *fh* (EBADF for a file handle)."""
        h = self.handles[fh]
        if not isinstance(h, DirHandle):
            raise fail(errno.EBADF)
        return h

    @op
    def read(self, fh: int, off: int, size: int) -> bytes:
        return os.pread(self._file(fh).fd, size, off)

    @op
    def write(
        self,
        fh: int,
        off: int,
        buf: bytes | memoryview,
        kill_suidgid: bool = False,
        ctx: Caller | None = None,
    ) -> int:
        """*kill_suidgid*: the writer (*ctx*) has no CAP_FSETID (see
        ``_kill_privs``)."""
        h = self._file(fh)
        node = h.node
        if kill_suidgid or not node.nocap:
            self._kill_privs(node, kill_suidgid, ctx)
        if not self.recorder.write_is_captured(node.bino, off, len(buf)):
            self.recorder.who = h.who
            self._capture_data(node, h.fd, off, off + len(buf))
        self._rewriting(node)
        return os.pwrite(h.fd, buf, off)

    @op
    def fallocate(self, fh: int, off: int, length: int, mode: int) -> None:
        """fallocate(2) on the backing file: what a mode changes (the size;
        the bytes a hole or zero range replaces; all bytes from *off* on
        when a collapse or insert shifts them) is captured first."""
        h = self._file(fh)
        node = h.node
        if mode & (backing.FALLOC_FL_COLLAPSE_RANGE | backing.FALLOC_FL_INSERT_RANGE):
            self._capture_data(node, h.fd, off, 1 << 63)
        elif mode & (backing.FALLOC_FL_PUNCH_HOLE | backing.FALLOC_FL_ZERO_RANGE):
            self._capture_data(node, h.fd, off, off + length, zeroing=True)
        if not mode & backing.FALLOC_FL_KEEP_SIZE:
            self._capture_meta(node)  # (the size it may grow from)
        self._rewriting(node)
        backing.fallocate(h.fd, mode, off, length)

    @op
    def lseek(self, fh: int, off: int, whence: int) -> int:
        """SEEK_DATA and SEEK_HOLE (the kernel does the others itself)."""
        return os.lseek(self._file(fh).fd, off, whence)

    @op
    def copy_file_range(
        self, fh_in: int, off_in: int, fh_out: int, off_out: int, length: int
    ) -> int:
        """copy_file_range(2) between backing files (reflinked where the
        filesystem can), the range it overwrites captured first."""
        src, dst = self._file(fh_in), self._file(fh_out)
        self.recorder.who = dst.who
        self._capture_data(dst.node, dst.fd, off_out, off_out + length)
        self._capture_meta(dst.node)
        self._rewriting(dst.node)
        return os.copy_file_range(src.fd, dst.fd, length, off_in, off_out)

    @op
    def tmpfile(
        self, parent_inode: int, mode: int, flags: int, ctx: Caller
    ) -> tuple[int, bool, Node, os.stat_result]:
        """O_TMPFILE: an unnamed file in the directory, made in this layer
        (nothing to capture; giving it a name later is a link)."""
        parent = self._node(parent_inode)
        mode = (mode & ~ctx.umask) | stat.S_IFREG
        self.fds.may_pin(ctx.uid)  # (it has no name: its fd stays while open)
        fl = self._open_flags(flags) & ~os.O_TMPFILE
        fd = self.fds.open(backing.proc(parent.fd), fl | os.O_TMPFILE, stat.S_IMODE(mode))
        try:
            self._own(parent, b"", ctx, mode, fd)
            st = os.fstat(fd)
            # (an O_PATH fd on the file itself: through our own fd's magic
            # link, which O_NOFOLLOW would open instead)
            path_fd = os.open(backing.proc(fd), os.O_PATH | os.O_CLOEXEC)
            node = Node(self.table.new_ino(st.st_ino), st.st_ino, path_fd, st.st_mode, self.fds)
        except BaseException:
            os.close(fd)
            raise
        node.nlookup = 1
        node.nocap = True
        self.table.add(node)
        self.recorder.note_created(st.st_ino)
        fh, keep = self._new_handle(node, fd, flags, fl)
        self.fds.pin(node, ctx.uid)
        return fh, keep, node, st

    def _rewriting(self, node: Node) -> None:
        """The bytes of *node*'s object are about to change: if it is also
        kept whole in the grave (open after its removal, or another name of
        it), the hash taken of it there no longer holds."""
        if self.sums is not None:
            self.sums.changing(node.bino)

    def quiet(self) -> float:
        """Seconds since the last request."""
        return time.monotonic() - self.last_request

    def is_open(self, bino: int) -> bool:
        """Whether a program has backing object *bino* open in the mount."""
        node = self.table.by_bino(bino)
        return node is not None and node.nopen > 0

    @op
    def flush(self, fh: int) -> NoReturn:
        # Writes go straight to the backing file, so close() has nothing to
        # flush; ENOSYS tells the kernel to stop sending FLUSH (one request
        # less per close).
        raise fail(errno.ENOSYS)

    @op
    def release(self, fh: int) -> Handle:
        h = self.handles[fh]  # (not _file: an evicted fd needs no reopening)
        if not isinstance(h, Handle):
            raise fail(errno.EBADF)
        del self.handles[fh]
        self.writers -= h.writable
        node = h.node
        if h.counted:
            if h.passthrough:
                node.pt -= 1
                if h.writable:
                    n = self.pt_writers[node] - 1
                    if n:
                        self.pt_writers[node] = n
                    else:
                        del self.pt_writers[node]
            else:
                node.pt += 1  # (one fewer served through the daemon)
        self.fds.closed(h)
        return h

    # -- passthrough --------------------------------------------------------------------

    def passthrough(self, fh: int) -> int | None:
        """Whether open file *fh* may be served by the kernel from the
        backing file directly (FUSE passthrough: its reads and writes never
        reach the daemon, so they are not captured one by one).  If so, the
        fd of the node's backing file to hand the kernel (every passthrough
        open of an inode shares one), else None.

        All opens of an inode agree (the kernel refuses a mix): the first
        decides -- passthrough for reading, or for writing a file made in the
        open layer (nothing to capture).  A writer of a file already served
        so gets passthrough too, the file captured whole first; and at every
        layer switch, files open for writing this way are captured whole in
        the new top layer (``layer_switched``).

        The fd returned is the node's O_PATH fd, for the engine to hand over
        at once (FUSE_DEV_IOC_BACKING_OPEN takes a reference to the file:
        the kernel opens each passthrough file on its path, and the fd can
        be closed -- or evicted -- right after)."""
        h = self._file(fh)
        node = h.node
        ok = (
            stat.S_ISREG(node.mode)
            and node.pt >= 0  # (none served through the daemon)
            and (
                node.pt > 0
                or (
                    self.recorder.obj(node.bino).created
                    if h.writable
                    else os.fstat(h.fd).st_size >= PASSTHROUGH_READ_MIN
                )
            )
        )
        if ok and not node.pt:
            try:
                _ = node.fd  # (reachable: opened again if it was evicted)
            except OSError:
                ok = False
        if not ok:
            node.pt -= 1  # (one more served through the daemon)
            h.counted = True
            return None
        if h.writable:
            self._capture_whole(node, h.fd)
            self.pt_writers[node] = self.pt_writers.get(node, 0) + 1
        node.pt += 1
        h.counted = h.passthrough = True
        return node.fd

    def passthrough_refused(self, fh: int) -> None:
        """The kernel would not take the backing file ``passthrough`` gave
        for *fh* (the first passthrough open of its node): *fh* is served
        through the daemon instead, as if ``passthrough`` had said None."""
        h = self._file(fh)
        node = h.node
        if h.writable:
            n = self.pt_writers.get(node, 0) - 1
            if n > 0:
                self.pt_writers[node] = n
            else:
                self.pt_writers.pop(node, None)
        node.pt -= 2  # (not the one passthrough open counted: one through the daemon)
        h.passthrough = False

    def _capture_whole(self, node: Node, fd: int) -> None:
        """Capture every byte and the attributes of *node*'s file in the open
        layer (nothing, for a file made in it), so that writes the daemon
        does not see need no capture."""
        self._capture_data(node, fd, 0, 1 << 63)
        self._capture_meta(node)
        self._rewriting(node)

    def layer_switched(self, after_undo: bool = False) -> None:
        """After the open layer changed (checkpoint, rollback, redo, commit):
        files that programs write through passthrough are captured whole in
        it, unless made in it.  After an undo, not those it took out of the
        tree (into the grave, kept for a redo, which would notice their
        change by its fingerprint)."""
        if not self.pt_writers:
            return
        # (one pass over the open files: a program may hold very many)
        writing: dict[Node, Handle] = {}
        for open_file in self.handles.values():
            if (
                isinstance(open_file, Handle)
                and open_file.passthrough
                and open_file.node in self.pt_writers
            ):
                writing.setdefault(open_file.node, open_file)
        for node in list(self.pt_writers):
            found = writing.get(node)
            if found is not None and node.live:
                self.fds.using(found)
                if after_undo and schema.grave_id(self.table.loc(node)) is not None:
                    continue
                try:
                    self._capture_whole(node, found.fd)
                except OSError as e:
                    log.warning(
                        "could not capture a file open for writing across a layer switch: %s", e
                    )

    @op
    def fsync(self, fh: int, datasync: bool) -> None:
        self.store.sync()  # the pre-images first, then the change they protect
        h = self._file(fh)
        if datasync:
            os.fdatasync(h.fd)
        else:
            os.fsync(h.fd)

    # -- directories ------------------------------------------------------------------

    @op
    def opendir(self, inode: int, ctx: Caller) -> int:
        # The names are read by the first readdir (and again after a
        # rewind), not here: opening a directory does not read it, nor
        # update its atime.
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = DirHandle(self._node(inode), [])
        return fh

    def _list(self, node: Node) -> list[bytes]:
        fd = os.open(backing.proc(node.fd), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            names = [os.fsencode(n) for n in os.listdir(fd)]
        finally:
            os.close(fd)
        if node is self.root and self.hidden is not None:
            names = [n for n in names if n != self.hidden]
        return [b".", b".."] + names

    @op
    def names(self, inode: int) -> list[bytes]:
        """The names in directory *inode* (no dot entries, nor the store)."""
        return self._list(self._node(inode))[2:]

    @op
    def readdir(
        self, fh: int, start: int, take: Callable[[bytes, Node, os.stat_result, int], bool]
    ) -> None:
        """Hand the entries from position *start* on to *take(name, node,
        stat, next position)* until it says no more fit (False).  The
        kernel holds a reference to each node it took (not to dot entries)."""
        dh = self._dir(fh)
        if start == 0 or not dh.names:
            # (a handle may begin past 0: the kernel's readdir cache goes on
            # where the part it kept ends; positions are those of the listing,
            # stable while the directory does not change -- a change drops
            # that cache)
            dh.names = self._list(dh.node)
        names = dh.names
        for i in range(start, len(names)):
            name = names[i]
            if name == b"." or name == b"..":
                node = (
                    dh.node
                    if name == b"." or dh.node.parent in (None, self.grave)
                    else dh.node.parent
                )
                if not take(name, node, os.stat(node.fd), i + 1):
                    return
                continue
            try:
                node, st = self._lookup(dh.node, name, count=False)
            except FileNotFoundError:
                continue
            if not take(name, node, st, i + 1):
                if node.nlookup == 0:
                    self.table.drop(node)
                return
            node.nlookup += 1

    @op
    def releasedir(self, fh: int) -> None:
        del self.handles[fh]

    @op
    def fsyncdir(self, fh: int, datasync: bool) -> None:
        self.store.sync()
        node = self.handles[fh].node
        fd = os.open(backing.proc(node.fd), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- xattrs -----------------------------------------------------------------------

    @op
    def getxattr(self, inode: int, name: bytes, ctx: Caller) -> bytes:
        node = self._node(inode)
        if node.noxattr or (name == CAPABILITY and node.nocap):
            raise fail(errno.ENODATA)
        path, follow = self._xpath(node)
        try:
            return os.getxattr(path, name, follow_symlinks=follow)
        except OSError as e:
            if e.errno == errno.ENODATA:
                if name == CAPABILITY:
                    node.nocap = True
                if node.noxattr is None:
                    # (asked once: has it any? programs that copy or check
                    # files ask for the same absent names of every file)
                    try:
                        node.noxattr = not os.listxattr(path, follow_symlinks=follow)
                    except OSError:
                        pass
            raise

    @op
    def listxattr(self, inode: int, ctx: Caller) -> list[bytes]:
        node = self._node(inode)
        if node.noxattr:
            return []
        path, follow = self._xpath(node)
        names = [os.fsencode(n) for n in os.listxattr(path, follow_symlinks=follow)]
        # (none: remembered until an xattr is set through the mount or an
        # undo puts some back -- copying tools ask two or three times a file)
        node.noxattr = not names
        return names

    @op
    def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Caller, flags: int = 0) -> None:
        node = self._node(inode)
        if flags & (os.XATTR_CREATE | os.XATTR_REPLACE):
            # a flag that makes it fail fails before anything is recorded
            there = self._has_xattr(node, name)
            if there and flags & os.XATTR_CREATE:
                raise fail(errno.EEXIST)
            if not there and flags & os.XATTR_REPLACE:
                raise fail(errno.ENODATA)
        self._capture_xattrs(node)
        self._capture_meta(node)
        path, follow = self._xpath(node)
        node.noxattr = False
        os.setxattr(path, name, value, flags, follow_symlinks=follow)
        if name == CAPABILITY:
            node.nocap = False

    def _has_xattr(self, node: Node, name: bytes) -> bool:
        """Whether the object has xattr *name* (a change that depends on it
        fails before anything is recorded); another error is raised."""
        path, follow = self._xpath(node)
        try:
            os.getxattr(path, name, follow_symlinks=follow)
        except OSError as e:
            if e.errno != errno.ENODATA:
                raise
            return False
        return True

    @op
    def removexattr(self, inode: int, name: bytes, ctx: Caller) -> None:
        node = self._node(inode)
        if node.noxattr or not self._has_xattr(node, name):
            raise fail(errno.ENODATA)  # (nothing to remove or record)
        self._capture_xattrs(node)
        self._capture_meta(node)
        path, follow = self._xpath(node)
        node.noxattr = None  # (it may have none left)
        os.removexattr(path, name, follow_symlinks=follow)

    # -- after a rollback ---------------------------------------------------------------

    def _target(self, op: str, args: tuple) -> bytes | None:
        """The location request *op* (with its handler's *args*) changes."""
        try:
            if op in HANDLE_OPS:
                return self._path(self.handles[args[2 if op == "copy_file_range" else 0]].node)
            if op == "link":
                return self._child(self._node(args[1]), args[2])
            if op in NAMING:
                return self._child(self._node(args[0]), args[1])
            return self._path(self._node(args[0]))
        except (OSError, KeyError, IndexError, TypeError):
            return None

    def _refused(self, op: str, args: tuple) -> None:
        """A change refused because --max-store was reached: counted, with
        its path and time, for `status`."""
        path = self._target(op, args)
        self.refused = {
            "count": self.refused["count"] + 1,
            "time": time.time(),
            "path": None
            if path is None or schema.grave_id(path) is not None
            else os.fsdecode(path) or ".",
        }

    def after_undo(self, touched: Touched) -> tuple[list[tuple[int, bytes]], list[int]]:
        """Bring the inode table in line with what an undo run did; return
        the kernel entries and inodes to invalidate."""
        for known in self.table.nodes.values():  # (it may have put xattrs back)
            known.nocap, known.noxattr = False, None
        self.grave_links = self.store.grave_counts()
        if self.sums is not None:
            self.sums.reload()
        for bino in touched.removed:
            self.table.orphan(bino)
        # (directories by the backing inode of the one each step acted in:
        # a path looked up now may lead elsewhere, a later step having
        # moved a directory above it)
        for bino, dino, name in touched.unnamed:  # (a name taken from one that keeps others)
            node = self.table.by_bino(bino)
            parent = self.table.by_bino(dino) if dino else None
            if node is not None and parent is not None:
                self.table.remove_link(node, parent, name)
        for bino, dino, name in touched.moves:
            node = self.table.by_bino(bino)
            if node is None:
                continue
            if not dino:  # kept for a redo
                self.table.add_link(node, self.grave, name)
                continue
            parent = self.table.by_bino(dino)
            if parent is not None and parent.isdir:
                self.table.add_link(node, parent, name)
            elif node.isdir:
                # in a directory the table has no node of: its path is
                # found again when it is needed (``_child``; a file's names
                # are checked before each use: ``InodeTable.loc``)
                node.parent, node.name = None, b""
        entries, inodes = [], []
        for dino, name in touched.entries:
            parent = self.table.by_bino(dino)
            if parent is not None:
                entries.append((parent.ino, name))
                inodes.append(parent.ino)  # its mtime and link count changed back
        for bino in touched.objects:
            node = self.table.by_bino(bino)
            if node is not None:
                try:
                    node.mode = os.stat(node.fd).st_mode
                except OSError:  # (its fd was evicted, and it has no name left)
                    pass
                inodes.append(node.ino)
        return entries, sorted(set(inodes))

    def let_go(self, binos: list[int]) -> None:
        """These objects are gone (a rollback removed them to make room):
        the O_PATH fds held on them close now, not when the kernel forgets
        them, so that their blocks are freed (an open file keeps its own)."""
        for bino in binos:
            self.table.let_go(bino)

    def after_commit(self, freed: list[int]) -> None:
        """A base commit deleted these objects' grave entries."""
        self.grave_links = self.store.grave_counts()
        if self.sums is not None:
            self.sums.reload()
        for bino in freed:
            node = self.table.by_bino(bino)
            if node is None:
                continue
            for parent, name in self.table.names(node):
                if parent is self.grave:
                    self.table.remove_link(node, self.grave, name)
            if not self.table.named(node):
                self.table.orphan(bino)
