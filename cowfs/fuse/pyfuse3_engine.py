"""The pyfuse3 engine: the operations (``ops``) behind pyfuse3's async
Operations class, on trio.  Portable (non-root mounts through fusermount3,
any kernel), but every request goes through trio's scheduler, and libfuse
3.14 negotiates none of the kernel's newer features (see ``kernel_engine``)."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, ParamSpec, TypeVar, TypeVarTuple

import pyfuse3
import trio
from pyfuse3 import FUSEError

from .inodes import Node
from .ops import TIMEOUT, Ops, errno_only

NAME = "pyfuse3"
log = logging.getLogger("cowfs.pyfuse3")
T = TypeVar("T")
P = ParamSpec("P")
Ts = TypeVarTuple("Ts")


def statvfs_data(sv: os.statvfs_result) -> pyfuse3.StatvfsData:
    """pyfuse3's answer to statfs, from an os.statvfs result."""
    out = pyfuse3.StatvfsData()
    for attr in (
        "f_bsize",
        "f_frsize",
        "f_blocks",
        "f_bfree",
        "f_bavail",
        "f_files",
        "f_ffree",
        "f_favail",
        "f_namemax",
    ):
        setattr(out, attr, getattr(sv, attr))
    return out


def handler(fn: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """A pyfuse3 handler written in the operations' terms (``cowfs.fuse.view``'s):
    it answers an OSError's errno, and anything unexpected is logged (to its
    module's logger) and answers EIO (``ops.errno_only``).  pyfuse3 lets a
    handler raise only FUSEError; any other exception would end its loop."""
    guard = errno_only(fn.__name__, logging.getLogger(fn.__module__))

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kw: P.kwargs) -> T:
        try:
            with guard:
                return await fn(*args, **kw)
        except OSError as e:
            raise FUSEError(e.errno or errno.EIO) from None

    return wrapper


def _call(fn: Callable[..., T], *args: object, **kw: object) -> T:
    try:
        return fn(*args, **kw)
    except OSError as e:
        raise FUSEError(e.errno or errno.EIO) from None


class CowFS(pyfuse3.Operations):
    # No writeback cache: with it the kernel keeps its own file sizes and
    # mtimes and never takes them back from the daemon, so a process holding
    # a file open would keep seeing pre-rollback sizes.  keep_cache is safe:
    # a rollback invalidates the pages it changed (see Ops._keep_cache for
    # when an open drops them anyway).
    enable_writeback_cache = False
    supports_dot_lookup = True

    def __init__(self, ops: Ops, on_init: Callable[[], None] | None = None):
        super().__init__()
        self.ops = ops
        self.on_init = on_init

    def init(self) -> None:
        if self.on_init is not None:
            self.on_init()

    def _entry(self, node: Node, st: os.stat_result) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = node.ino
        e.generation = 0
        e.entry_timeout = TIMEOUT
        e.attr_timeout = TIMEOUT
        e.st_mode = st.st_mode
        e.st_nlink = self.ops.nlink(node, st)
        e.st_uid = st.st_uid
        e.st_gid = st.st_gid
        e.st_rdev = st.st_rdev
        e.st_size = st.st_size
        e.st_blksize = st.st_blksize
        e.st_blocks = st.st_blocks
        e.st_atime_ns = st.st_atime_ns
        e.st_mtime_ns = st.st_mtime_ns
        e.st_ctime_ns = st.st_ctime_ns
        return e

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self._entry(*_call(self.ops.lookup, parent_inode, name, ctx=ctx))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        _call(self.ops.forget, inode_list)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(*_call(self.ops.getattr, inode, ctx=ctx))

    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        kw: dict[str, int] = {}
        if fields.update_size:
            kw["size"] = attr.st_size
        if fields.update_mode:
            kw["mode"] = attr.st_mode
        if fields.update_uid:
            kw["uid"] = attr.st_uid
        if fields.update_gid:
            kw["gid"] = attr.st_gid
        if fields.update_atime:
            kw["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            kw["mtime_ns"] = attr.st_mtime_ns
        return self._entry(*_call(self.ops.setattr, inode, fh, ctx=ctx, **kw))

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return _call(self.ops.readlink, inode, ctx=ctx)

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        return True

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        return statvfs_data(_call(self.ops.statfs, ctx=ctx))

    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self._entry(*_call(self.ops.mknod, parent_inode, name, mode, rdev, ctx=ctx))

    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self._entry(*_call(self.ops.mkdir, parent_inode, name, mode, ctx=ctx))

    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self._entry(*_call(self.ops.symlink, parent_inode, name, target, ctx=ctx))

    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self._entry(*_call(self.ops.link, inode, new_parent_inode, new_name, ctx=ctx))

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        fh, keep, node, st = _call(self.ops.create, parent_inode, name, mode, flags, ctx=ctx)
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep), self._entry(node, st)

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        _call(self.ops.unlink, parent_inode, name, ctx=ctx)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        _call(self.ops.rmdir, parent_inode, name, ctx=ctx)

    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        _call(
            self.ops.rename, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx=ctx
        )

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        fh, keep = _call(self.ops.open, inode, flags, ctx=ctx)
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return _call(self.ops.read, fh, off, size)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return _call(self.ops.write, fh, off, buf)

    async def flush(self, fh: int) -> None:
        _call(self.ops.flush, fh)

    async def release(self, fh: int) -> None:
        _call(self.ops.release, fh)

    async def fsync(self, fh: int, datasync: bool) -> None:
        _call(self.ops.fsync, fh, datasync)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return _call(self.ops.opendir, inode, ctx=ctx)

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        _call(
            self.ops.readdir,
            fh,
            start_id,
            lambda name, node, st, nxt: pyfuse3.readdir_reply(
                token, name, self._entry(node, st), nxt
            ),
        )

    async def releasedir(self, fh: int) -> None:
        _call(self.ops.releasedir, fh)

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        _call(self.ops.fsyncdir, fh, datasync)

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        return _call(self.ops.getxattr, inode, name, ctx=ctx)

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return _call(self.ops.listxattr, inode, ctx=ctx)

    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        _call(self.ops.setxattr, inode, name, value, ctx=ctx)

    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        _call(self.ops.removexattr, inode, name, ctx=ctx)


class Engine:
    """The daemon's view of an engine (see ``kernel_engine.Engine``)."""

    name = NAME

    def __init__(self, ops: Ops, why: str = ""):
        self.ops = ops
        self.why = why

    def mount(
        self, mountpoint: str, fsname: str, allow_other: bool, on_init: Callable[[], None]
    ) -> None:
        options = {f"fsname={fsname}", "subtype=cowfs", "default_permissions"}
        if allow_other:
            options.add("allow_other")
        pyfuse3.init(CowFS(self.ops, on_init), mountpoint, options)

    async def serve(self) -> None:
        try:
            await pyfuse3.main(min_tasks=2, max_tasks=16)
        except* ConnectionAbortedError:
            # A request read while the kernel tore the connection down (an
            # unmount with releases still queued: a program closed many
            # files just before) reads as ECONNABORTED, which libfuse takes
            # for an error; the connection is gone either way.
            log.info("the kernel ended the FUSE connection with requests queued")

    def terminate(self) -> None:
        pyfuse3.terminate()

    def close(self, unmount: bool) -> None:
        pyfuse3.close(unmount=unmount)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Requests are served on the trio thread: nothing runs beside it."""
        yield

    def invalidate(self, entries: list[tuple[int, bytes]], inodes: list[int]) -> None:
        """(From a worker thread.)"""
        for pino, name in entries:
            try:
                pyfuse3.invalidate_entry(pino, name)
            except OSError:
                pass
        for ino in inodes:
            try:
                pyfuse3.invalidate_inode(ino)
            except OSError:
                pass

    async def blocking(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """Run *fn* in a worker thread (requests go on meanwhile)."""
        return await trio.to_thread.run_sync(fn, *args)
