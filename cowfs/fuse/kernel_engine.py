"""The kernel engine: the FUSE protocol spoken on /dev/fuse directly, in one
synchronous loop on a thread of its own -- a blocking read of one request,
the operation (``ops``), a write of the reply -- with no event loop and no
task switch in between.  It negotiates with the kernel what libfuse 3.14
cannot (see ``INIT`` below); struct layouts are in ``fuse_abi``.

The daemon's control code runs on trio in the main thread.  It takes the
file system for itself (``exclusive``: a lock the loop takes for every
request) while it runs, and lets go while it waits (``blocking``), so a
layer switch happens between two requests, as with the pyfuse3 engine.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import select
import shutil
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar, TypeVarTuple

import trio

from ..system import backing
from ..system.backing import checked, libc
from ..system.mounts import unmount
from . import fuse_abi
from .inodes import Node
from .ops import TIMEOUT, Ctx, Ops

log = logging.getLogger("cowfs.kernel")

NAME = "kernel"
SUBTYPE = "cowfs"  # the mount's type is fuse.cowfs
MS_NOSUID, MS_NODEV = 2, 4
MAX_WRITE = 1 << 20
OFF_MAX = (1 << 63) - 1  # the largest file offset (loff_t) and count (ssize_t)
MAX_PAGES = MAX_WRITE // 4096
READ_AHEAD_KB = 1024
# How long (microseconds) the loop looks for the next request before it
# sleeps, when it may run on another CPU than the program it serves:
# $COWFS_SPIN_US (0: it sleeps at once), else 50.
_spin = os.environ.get("COWFS_SPIN_US", "")
SPIN_NS = (int(_spin) if _spin.isdigit() else 50) * 1000

_ENTRY_TIMEOUT = int(TIMEOUT)
_NEGATIVE = fuse_abi.ENTRY_OUT.pack(0, 0, _ENTRY_TIMEOUT, 0, 0, 0) + bytes(fuse_abi.ATTR.size)

T = TypeVar("T")
Ts = TypeVarTuple("Ts")
# a request's handler: (unique, nodeid, uid, gid, pid, the body after the header)
Handler = Callable[[int, int, int, int, int, memoryview], None]


def available() -> str | None:
    """Why the kernel engine cannot run here (None: it can)."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if os.geteuid() != 0 and not shutil.which("fusermount3"):
        return "a mount by a user other than root needs fusermount3 (the fuse3 package)"
    return None


CAP_SYS_ADMIN = 21


def can_pass_through() -> bool:
    """Whether this process may hand the kernel backing files (passthrough
    needs CAP_SYS_ADMIN: a user's mount serves every read and write)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return False


def _escape(value: str) -> str:
    """A value inside fusermount3's comma-separated -o list."""
    return value.replace("\\", "\\\\").replace(",", "\\,")


def fusermount(mountpoint: str, options: str) -> int:
    """Mount as a user other than root, as libfuse does: fusermount3 (setuid
    root) opens /dev/fuse, mounts it with *options* and passes the open
    descriptor back over a socket pair (SCM_RIGHTS); returns it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with theirs:
            env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
            try:
                r = subprocess.run(
                    ["fusermount3", "-o", options, "--", mountpoint],
                    env=env,
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
            except (OSError, subprocess.TimeoutExpired) as e:
                raise OSError(errno.EIO, f"fusermount3: {e}", mountpoint) from None
        if r.returncode != 0:
            why = (
                r.stderr.strip().splitlines()[-1]
                if r.stderr.strip()
                else f"exit status {r.returncode}"
            )
            raise OSError(errno.EPERM, why.removeprefix("fusermount3: "), mountpoint)
        ours.settimeout(10)
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    finally:
        ours.close()
    if not fds:
        raise OSError(errno.EIO, "fusermount3 mounted but passed no descriptor", mountpoint)
    for extra in fds[1:]:
        os.close(extra)
    os.set_inheritable(fds[0], False)
    return fds[0]


class FsLock:
    """Held by the request loop for each request, and by control code (on
    the trio thread) while it runs; reentrant for the trio thread, whose
    tasks interleave at their awaits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0

    def acquire(self) -> None:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return
        self._lock.acquire()
        self._owner, self._depth = me, 1

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()

    def suspend(self) -> int:
        """Let go entirely (this thread holds it); how deep it was held."""
        if self._owner != threading.get_ident():
            return 0
        depth, self._depth, self._owner = self._depth, 0, None
        self._lock.release()
        return depth

    def resume(self, depth: int) -> None:
        if not depth:
            return
        me = threading.get_ident()
        if self._owner == me:
            self._depth += depth
            return
        self._lock.acquire()
        self._owner, self._depth = me, depth


def _attr(node: Node, st: os.stat_result, nlink: int) -> bytes:
    a, m, c = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
    return fuse_abi.ATTR.pack(
        node.ino,
        st.st_size,
        st.st_blocks,
        a // 1_000_000_000,
        m // 1_000_000_000,
        c // 1_000_000_000,
        a % 1_000_000_000,
        m % 1_000_000_000,
        c % 1_000_000_000,
        st.st_mode,
        nlink,
        st.st_uid,
        st.st_gid,
        st.st_rdev & 0xFFFFFFFF,
        st.st_blksize,
        0,
    )


class Engine:
    """Mount with mount(2), answer the kernel on /dev/fuse."""

    name = NAME

    def __init__(self, ops: Ops, why: str = ""):
        self.ops = ops
        self.why = why
        self.fd = -1
        self.mountpoint = ""
        self.lock = FsLock()
        self.on_init: Callable[[], None] | None = None
        self.minor = 0
        self.flags = 0  # what INIT agreed on
        self.running = False
        self.ended = False  # the kernel let go of the connection: not mounted
        self.counts: dict[int, int] = {}
        # the id of each passthrough file the kernel holds, by node
        self.backing_ids: dict[Node, int] = {}
        self.use_passthrough = can_pass_through()
        self.passthrough = False  # negotiated
        self._handlers = self._table()

    def features(self) -> dict:
        """What INIT agreed on, by name."""
        names = {
            fuse_abi.HANDLE_KILLPRIV_V2: "killpriv_v2",
            fuse_abi.PASSTHROUGH: "passthrough",
            fuse_abi.DO_READDIRPLUS: "readdirplus",
            fuse_abi.PARALLEL_DIROPS: "parallel_dirops",
            fuse_abi.ATOMIC_O_TRUNC: "atomic_o_trunc",
            fuse_abi.MAX_PAGES: "max_pages",
        }
        return {
            "protocol": f"7.{self.minor}",
            "spin_us": SPIN_NS // 1000,
            "features": sorted(n for bit, n in names.items() if self.flags & bit)
            + ["negative_entries", "cache_readdir"],
            "requests": {
                fuse_abi.OPCODE_NAMES.get(op, str(op)): n for op, n in sorted(self.counts.items())
            },
        }

    # -- mounting ----------------------------------------------------------------------

    def mount(
        self, mountpoint: str, fsname: str, allow_other: bool, on_init: Callable[[], None]
    ) -> None:
        self.mountpoint = mountpoint
        self.on_init = on_init
        common = "default_permissions" + (",allow_other" if allow_other else "")
        if os.geteuid() != 0:
            # (fusermount3 adds nosuid and nodev, and the fd, rootmode and ids)
            self.fd = fusermount(
                mountpoint, f"fsname={_escape(fsname)},subtype={SUBTYPE}," + common
            )
            return
        self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        st = os.stat(mountpoint)
        opts = (
            f"fd={self.fd},rootmode={stat.S_IFMT(st.st_mode):o},"
            f"user_id={os.geteuid()},group_id={os.getegid()},{common}"
        )
        try:
            checked(
                libc.mount(
                    os.fsencode(fsname),
                    os.fsencode(mountpoint),
                    f"fuse.{SUBTYPE}".encode(),
                    MS_NOSUID | MS_NODEV,
                    opts.encode(),
                ),
                mountpoint,
                call="mount",
            )
        except OSError:
            os.close(self.fd)
            self.fd = -1
            raise

    def _tune_bdi(self) -> None:
        """Read ahead 1 MiB on reads the daemon serves (the default 128 KiB
        made cold sequential reads 1.6x slower here); best effort."""
        from ..system.mounts import FSTYPE, mounts

        found = [m for m in mounts() if m.mountpoint == self.mountpoint and m.fstype == FSTYPE]
        if not found:
            return
        try:
            with open(f"/sys/class/bdi/{found[-1].dev}/read_ahead_kb", "w") as f:
                f.write(str(READ_AHEAD_KB))
        except OSError as e:
            log.info("could not set the mount's read-ahead: %s", e)

    async def serve(self) -> None:
        """Serve requests until the mount is gone."""
        await trio.to_thread.run_sync(self._loop)

    def terminate(self) -> None:
        """Unmount (lazily: processes still inside keep it until they leave);
        the loop ends when the kernel lets go of the connection."""
        try:
            unmount(self.mountpoint, lazy=True)
        except OSError as e:
            log.warning("unmount of %s: %s", self.mountpoint, e.strerror)

    def close(self, unmount: bool) -> None:
        if unmount and not self.ended:
            self.terminate()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        self.lock.acquire()
        try:
            yield
        finally:
            self.lock.release()

    async def blocking(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """Run *fn* in a worker thread, letting requests be served meanwhile."""
        depth = self.lock.suspend()
        try:
            return await trio.to_thread.run_sync(fn, *args)
        finally:
            self.lock.resume(depth)

    def invalidate(self, entries: list[tuple[int, bytes]], inodes: list[int]) -> None:
        """Drop what the kernel caches of these names and inodes (from a
        thread that holds no lock the loop might wait for)."""
        for pino, name in entries:
            self._notify(
                fuse_abi.NOTIFY_INVAL_ENTRY,
                fuse_abi.NOTIFY_INVAL_ENTRY_OUT.pack(pino, len(name), 0) + name + b"\0",
            )
        for ino in inodes:
            self._notify(
                fuse_abi.NOTIFY_INVAL_INODE, fuse_abi.NOTIFY_INVAL_INODE_OUT.pack(ino, 0, 0)
            )

    def _notify(self, code: int, body: bytes) -> None:
        try:
            os.write(self.fd, fuse_abi.OUT_HEADER.pack(16 + len(body), code, 0) + body)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTCONN, errno.EBADF, errno.ENODEV):
                log.warning("notification %d failed: %s", code, e)

    # -- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        self.running = True
        buf = bytearray(MAX_WRITE + 4096)
        view = memoryview(buf)
        bufs = [buf]
        fd = self.fd
        unpack_hdr = fuse_abi.IN_HEADER.unpack_from
        handlers = self._handlers
        lock = self.lock
        counts = self.counts
        os.set_blocking(fd, False)
        idle = select.poll()
        idle.register(fd, select.POLLIN)
        try:
            while True:
                try:
                    n = os.readv(fd, bufs)
                except BlockingIOError:
                    self._wait(idle)
                    continue
                except OSError as e:
                    # (ENOENT: a request interrupted meanwhile; ECONNABORTED:
                    # one read while an unmount tore the connection down --
                    # the next read says ENODEV)
                    if e.errno in (errno.EINTR, errno.ENOENT, errno.ECONNABORTED):
                        continue
                    if e.errno == errno.ENODEV:
                        self.ended = True  # unmounted
                        return
                    raise
                ln, opcode, unique, nodeid, uid, gid, pid, _, _ = unpack_hdr(buf)
                counts[opcode] = counts.get(opcode, 0) + 1
                handler = handlers.get(opcode)
                if handler is None:
                    self._error(unique, errno.ENOSYS)
                    continue
                lock.acquire()
                try:
                    handler(unique, nodeid, uid, gid, pid, view[40:n])
                except OSError as e:
                    self._error(unique, e.errno or errno.EIO)
                except _Stop:
                    self.ended = True
                    return
                except Exception:
                    log.exception("opcode %d failed", opcode)
                    self._error(unique, errno.EIO)
                finally:
                    lock.release()
        finally:
            self.running = False

    def _wait(self, idle: select.poll) -> None:
        """No request is waiting.  With another CPU to run on, look again
        for a while first: the next request of a program running elsewhere
        is then taken without a wake-up of this thread (on this machine
        kind a wake-up across CPUs costs 60-110 us); yielding meanwhile
        to whatever else wants this CPU."""
        if len(os.sched_getaffinity(0)) > 1:
            until = time.perf_counter_ns() + SPIN_NS
            while time.perf_counter_ns() < until:
                os.sched_yield()
                if idle.poll(0):
                    return
        idle.poll()

    def _reply(self, unique: int, body: bytes = b"") -> None:
        try:
            os.write(self.fd, fuse_abi.OUT_HEADER.pack(16 + len(body), 0, unique) + body)
        except OSError as e:
            if e.errno != errno.ENOENT:  # (the request was interrupted)
                raise

    def _reply_data(self, unique: int, data: bytes) -> None:
        try:
            os.writev(self.fd, [fuse_abi.OUT_HEADER.pack(16 + len(data), 0, unique), data])
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise

    def _error(self, unique: int, err: int) -> None:
        try:
            os.write(self.fd, fuse_abi.OUT_HEADER.pack(16, -err, unique))
        except OSError:
            pass

    def _entry(self, unique: int, node: Node, st: os.stat_result, extra: bytes = b"") -> None:
        body = (
            fuse_abi.ENTRY_OUT.pack(node.ino, 0, _ENTRY_TIMEOUT, _ENTRY_TIMEOUT, 0, 0)
            + _attr(node, st, self.ops.nlink(node, st))
            + extra
        )
        try:
            os.write(self.fd, fuse_abi.OUT_HEADER.pack(16 + len(body), 0, unique) + body)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
            self.ops.forget([(node.ino, 1)])  # the kernel took no reference

    def _attr_reply(self, unique: int, node: Node, st: os.stat_result) -> None:
        self._reply(
            unique,
            fuse_abi.ATTR_OUT.pack(_ENTRY_TIMEOUT, 0, 0)
            + _attr(node, st, self.ops.nlink(node, st)),
        )

    # -- the requests --------------------------------------------------------------------

    def _table(self) -> dict[int, Handler]:
        return {
            fuse_abi.INIT: self._init,
            fuse_abi.DESTROY: self._destroy,
            fuse_abi.LOOKUP: self._lookup,
            fuse_abi.FORGET: self._forget,
            fuse_abi.BATCH_FORGET: self._batch_forget,
            fuse_abi.GETATTR: self._getattr,
            fuse_abi.SETATTR: self._setattr,
            fuse_abi.READLINK: self._readlink,
            fuse_abi.SYMLINK: self._symlink,
            fuse_abi.MKNOD: self._mknod,
            fuse_abi.MKDIR: self._mkdir,
            fuse_abi.UNLINK: self._unlink,
            fuse_abi.RMDIR: self._rmdir,
            fuse_abi.RENAME: self._rename,
            fuse_abi.RENAME2: self._rename2,
            fuse_abi.LINK: self._link,
            fuse_abi.OPEN: self._open,
            fuse_abi.READ: self._read,
            fuse_abi.WRITE: self._write,
            fuse_abi.STATFS: self._statfs,
            fuse_abi.RELEASE: self._release,
            fuse_abi.FSYNC: self._fsync,
            fuse_abi.FLUSH: self._flush,
            fuse_abi.SETXATTR: self._setxattr,
            fuse_abi.GETXATTR: self._getxattr,
            fuse_abi.LISTXATTR: self._listxattr,
            fuse_abi.REMOVEXATTR: self._removexattr,
            fuse_abi.OPENDIR: self._opendir,
            fuse_abi.READDIRPLUS: self._readdirplus,
            fuse_abi.READDIR: self._readdir,
            fuse_abi.RELEASEDIR: self._releasedir,
            fuse_abi.FSYNCDIR: self._fsyncdir,
            fuse_abi.ACCESS: self._access,
            fuse_abi.CREATE: self._create,
            fuse_abi.INTERRUPT: self._interrupt,
            fuse_abi.SYNCFS: self._syncfs,
            fuse_abi.FALLOCATE: self._fallocate,
            fuse_abi.LSEEK: self._lseek,
            fuse_abi.COPY_FILE_RANGE: self._copy_file_range,
            fuse_abi.COPY_FILE_RANGE_64: self._copy_file_range_64,
            fuse_abi.TMPFILE: self._tmpfile,
        }

    def _init(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        major, minor, max_readahead, flags, flags2 = fuse_abi.INIT_IN.unpack_from(body)
        if major != fuse_abi.KERNEL_VERSION:
            # an older or newer major: say ours, the kernel sends INIT again
            self._reply(
                unique,
                fuse_abi.INIT_OUT.pack(
                    fuse_abi.KERNEL_VERSION, fuse_abi.KERNEL_MINOR, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
                ),
            )
            return
        kernel = flags | (flags2 << 32 if flags & fuse_abi.INIT_EXT else 0)
        want = (fuse_abi.PASSTHROUGH if self.use_passthrough else 0) | (
            fuse_abi.ASYNC_READ
            | fuse_abi.ATOMIC_O_TRUNC
            | fuse_abi.EXPORT_SUPPORT
            | fuse_abi.BIG_WRITES
            | fuse_abi.DO_READDIRPLUS
            | fuse_abi.PARALLEL_DIROPS
            | fuse_abi.MAX_PAGES
            | fuse_abi.INIT_EXT
            # no GETXATTR security.capability before every write, truncation
            # and chown: the daemon clears privileges itself (ops._kill_privs)
            | fuse_abi.HANDLE_KILLPRIV_V2
        )
        # (not CACHE_SYMLINKS: a readlink the kernel answers from its cache
        # never updates the symlink's atime, as a native one would)
        agreed = kernel & want
        self.minor = min(minor, fuse_abi.KERNEL_MINOR)
        self.flags = agreed
        self.passthrough = bool(agreed & fuse_abi.PASSTHROUGH)
        self._reply(
            unique,
            fuse_abi.INIT_OUT.pack(
                fuse_abi.KERNEL_VERSION,
                self.minor,
                max_readahead,
                agreed & 0xFFFFFFFF,
                64,
                48,
                MAX_WRITE,
                1,
                MAX_PAGES,
                0,
                agreed >> 32,
                self._stack_depth() if self.passthrough else 0,
                0,
            ),
        )
        log.info("FUSE 7.%d, kernel offers %#x, agreed %#x", minor, kernel, agreed)
        self._tune_bdi()  # (after INIT, which caps the read-ahead)
        if self.on_init is not None:
            self.on_init()

    def _destroy(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        self._reply(unique)
        raise _Stop

    def _interrupt(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        pass  # each request runs to its end at once: nothing to interrupt

    def _lookup(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        name = bytes(body[:-1])
        try:
            node, st = self.ops.lookup(nodeid, name, ctx=Ctx(pid, uid, gid, 0))
        except FileNotFoundError:
            # a negative entry: the kernel remembers the name is absent (an
            # undo that brings one back invalidates it)
            self._reply(unique, _NEGATIVE)
            return
        self._entry(unique, node, st)

    def _forget(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        self.ops.forget([(nodeid, fuse_abi.FORGET_IN.unpack_from(body)[0])])

    def _batch_forget(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        count = fuse_abi.BATCH_FORGET_IN.unpack_from(body)[0]
        one = fuse_abi.FORGET_ONE
        self.ops.forget([one.unpack_from(body, 8 + i * 16) for i in range(count)])

    def _getattr(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        node, st = self.ops.getattr(nodeid)
        self._attr_reply(unique, node, st)

    def _setattr(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        (
            valid,
            _,
            fh,
            size,
            _,
            atime,
            mtime,
            _,
            atimensec,
            mtimensec,
            _,
            mode,
            _,
            auid,
            agid,
            _,
        ) = fuse_abi.SETATTR_IN.unpack_from(body)
        kw: dict[str, int] = {}
        if valid & fuse_abi.FATTR_SIZE:
            kw["size"] = size
        if valid & fuse_abi.FATTR_MODE:
            kw["mode"] = mode
        if valid & fuse_abi.FATTR_UID:
            kw["uid"] = auid
        if valid & fuse_abi.FATTR_GID:
            kw["gid"] = agid
        now = None
        if valid & fuse_abi.FATTR_ATIME:
            if valid & fuse_abi.FATTR_ATIME_NOW:
                now = time.time_ns()
                kw["atime_ns"] = now
            else:
                kw["atime_ns"] = atime * 1_000_000_000 + atimensec
        if valid & fuse_abi.FATTR_MTIME:
            if valid & fuse_abi.FATTR_MTIME_NOW:
                kw["mtime_ns"] = now if now is not None else time.time_ns()
            else:
                kw["mtime_ns"] = mtime * 1_000_000_000 + mtimensec
        node, st = self.ops.setattr(
            nodeid,
            fh if valid & fuse_abi.FATTR_FH else None,
            ctx=Ctx(pid, uid, gid, 0),
            kill_suidgid=bool(valid & fuse_abi.FATTR_KILL_SUIDGID),
            **kw,
        )
        self._attr_reply(unique, node, st)

    def _readlink(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        self._reply(unique, self.ops.readlink(nodeid, ctx=Ctx(pid, uid, gid, 0)))

    def _symlink(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        raw = bytes(body)
        end = raw.index(0)
        name, target = raw[:end], raw[end + 1 : raw.index(0, end + 1)]
        node, st = self.ops.symlink(nodeid, name, target, ctx=Ctx(pid, uid, gid, 0))
        self._entry(unique, node, st)

    def _mknod(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        mode, rdev, umask, _ = fuse_abi.MKNOD_IN.unpack_from(body)
        name = bytes(body[16:-1])
        node, st = self.ops.mknod(nodeid, name, mode, rdev, ctx=Ctx(pid, uid, gid, umask))
        self._entry(unique, node, st)

    def _mkdir(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        mode, umask = fuse_abi.MKDIR_IN.unpack_from(body)
        name = bytes(body[8:-1])
        node, st = self.ops.mkdir(nodeid, name, mode, ctx=Ctx(pid, uid, gid, umask))
        self._entry(unique, node, st)

    def _unlink(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        self.ops.unlink(nodeid, bytes(body[:-1]), ctx=Ctx(pid, uid, gid, 0))
        self._reply(unique)

    def _rmdir(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        self.ops.rmdir(nodeid, bytes(body[:-1]), ctx=Ctx(pid, uid, gid, 0))
        self._reply(unique)

    def _do_rename(
        self,
        unique: int,
        nodeid: int,
        uid: int,
        gid: int,
        pid: int,
        newdir: int,
        flags: int,
        names: bytes,
    ) -> None:
        end = names.index(0)
        old, new = names[:end], names[end + 1 : names.index(0, end + 1)]
        self.ops.rename(nodeid, old, newdir, new, flags, ctx=Ctx(pid, uid, gid, 0))
        self._reply(unique)

    def _rename(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        self._do_rename(
            unique,
            nodeid,
            uid,
            gid,
            pid,
            fuse_abi.RENAME_IN.unpack_from(body)[0],
            0,
            bytes(body[8:]),
        )

    def _rename2(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        newdir, flags, _ = fuse_abi.RENAME2_IN.unpack_from(body)
        self._do_rename(unique, nodeid, uid, gid, pid, newdir, flags, bytes(body[16:]))

    def _link(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        old = fuse_abi.LINK_IN.unpack_from(body)[0]
        node, st = self.ops.link(old, nodeid, bytes(body[8:-1]), ctx=Ctx(pid, uid, gid, 0))
        self._entry(unique, node, st)

    def _open(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        flags, open_flags = fuse_abi.OPEN_IN.unpack_from(body)
        fh, keep = self.ops.open(
            nodeid,
            flags,
            ctx=Ctx(pid, uid, gid, 0),
            kill_suidgid=bool(open_flags & fuse_abi.OPEN_KILL_SUIDGID),
        )
        self._reply(unique, self._open_out(fh, keep))

    def _create(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        flags, mode, umask, open_flags = fuse_abi.CREATE_IN.unpack_from(body)
        fh, keep, node, st = self.ops.create(
            nodeid,
            bytes(body[16:-1]),
            mode,
            flags,
            ctx=Ctx(pid, uid, gid, umask),
            kill_suidgid=bool(open_flags & fuse_abi.OPEN_KILL_SUIDGID),
        )
        self._entry(unique, node, st, self._open_out(fh, keep))

    def _tmpfile(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        flags, mode, umask, _ = fuse_abi.CREATE_IN.unpack_from(body)
        fh, keep, node, st = self.ops.tmpfile(nodeid, mode, flags, ctx=Ctx(pid, uid, gid, umask))
        self._entry(unique, node, st, self._open_out(fh, keep))

    def _fallocate(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        fh, off, length, mode, _ = fuse_abi.FALLOCATE_IN.unpack_from(body)
        self.ops.fallocate(fh, off, length, mode)
        self._reply(unique)

    def _lseek(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        fh, off, whence, _ = fuse_abi.LSEEK_IN.unpack_from(body)
        self._reply(unique, fuse_abi.LSEEK_OUT.pack(self.ops.lseek(fh, off, whence)))

    def _copy(self, nodeid: int, body: memoryview, most: int) -> int:
        """The copy a COPY_FILE_RANGE(_64) request asks for, of at most
        *most* bytes (what its answer can carry: a short copy is one
        copy_file_range(2) may make); offsets past what a file offset can
        be (loff_t) and flags are EINVAL, as the system call says."""
        fh_in, off_in, _, fh_out, off_out, length, flags = fuse_abi.COPY_FILE_RANGE_IN.unpack_from(
            body
        )
        if off_in > OFF_MAX or off_out > OFF_MAX or flags:
            raise OSError(errno.EINVAL, "copy_file_range: offset out of range, or flags")
        n = self.ops.copy_file_range(fh_in, off_in, fh_out, off_out, min(length, most))
        # The kernel updates the destination's attributes itself but not the
        # source's atime, which reading it underneath changed (as natively):
        # drop its cached attributes (only those: offset -1 leaves the page
        # cache, and no page lock is waited for in the loop).
        self._notify(
            fuse_abi.NOTIFY_INVAL_INODE, fuse_abi.NOTIFY_INVAL_INODE_OUT.pack(nodeid, -1, 0)
        )
        return n

    def _copy_file_range(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        """The count answered in 32 bits (fuse_write_out): the kernel asks
        for at most UINT_MAX & PAGE_MASK here, and so does this."""
        self._reply(unique, fuse_abi.WRITE_OUT.pack(self._copy(nodeid, body, 0xFFFFF000), 0))

    def _copy_file_range_64(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        """The same copy, its count answered in 64 bits (Linux 6.18 sends
        it first, whatever the protocol minor, and falls back to
        COPY_FILE_RANGE for good when it is answered ENOSYS)."""
        self._reply(unique, fuse_abi.COPY_FILE_RANGE_OUT.pack(self._copy(nodeid, body, OFF_MAX)))

    def _read(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        fh, off, size, _, _, _, _ = fuse_abi.READ_IN.unpack_from(body)
        self._reply_data(unique, self.ops.read(fh, off, size))

    def _write(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        fh, off, size, write_flags, _, _, _ = fuse_abi.WRITE_IN.unpack_from(body)
        if write_flags & fuse_abi.WRITE_KILL_SUIDGID:
            n = self.ops.write(
                fh, off, body[40 : 40 + size], kill_suidgid=True, ctx=Ctx(pid, uid, gid, 0)
            )
        else:
            n = self.ops.write(fh, off, body[40 : 40 + size])
        self._reply(unique, fuse_abi.WRITE_OUT.pack(n, 0))

    def _statfs(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        sv = self.ops.statfs()
        self._reply(
            unique,
            fuse_abi.KSTATFS.pack(
                sv.f_blocks,
                sv.f_bfree,
                sv.f_bavail,
                sv.f_files,
                sv.f_ffree,
                sv.f_bsize,
                sv.f_namemax,
                sv.f_frsize,
                0,
            ),
        )

    def _release(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        h = self.ops.release(fuse_abi.RELEASE_IN.unpack_from(body)[0])
        node = h.node
        if h.passthrough and not node.pt:
            bid = self.backing_ids.pop(node, None)
            if bid is not None:
                self._backing_close(bid)
        self._reply(unique)

    def _open_out(self, fh: int, keep: bool) -> bytes:
        """The reply to an open: passthrough where the operations allow it."""
        if self.passthrough:
            bfd = self.ops.passthrough(fh)
            if bfd is not None:
                node = self.ops.handles[fh].node
                bid = self.backing_ids.get(node)
                if bid is None:
                    # (the kernel takes a reference to the file behind *bfd*,
                    # the node's O_PATH fd, and keeps it until the id is
                    # closed: the fd itself may be closed or evicted later)
                    try:
                        bid = self.backing_ids[node] = self._backing_open(bfd)
                    except OSError as e:
                        # (the kernel would not take this file: it is served
                        # through the daemon, the program's open unharmed)
                        log.warning("passthrough refused for a file: %s", e.strerror)
                        self.ops.passthrough_refused(fh)
                        return fuse_abi.OPEN_OUT.pack(
                            fh, fuse_abi.FOPEN_KEEP_CACHE if keep else 0, 0
                        )
                return fuse_abi.OPEN_OUT.pack(fh, fuse_abi.FOPEN_PASSTHROUGH, bid)
        return fuse_abi.OPEN_OUT.pack(fh, fuse_abi.FOPEN_KEEP_CACHE if keep else 0, 0)

    def _stack_depth(self) -> int:
        """How deep this mount stacks on other filesystems (INIT's
        max_stack_depth): 1 over a plain one, 2 over one that is itself
        stacked (an overlay: the kernel refuses passthrough to its files
        otherwise, ELOOP).  The kernel allows 2 at most, and nothing can
        then be stacked on this mount (an overlay over a workspace): so 2
        only where it is needed."""
        try:
            kind = backing.fs_type(self.ops.root.fd)
        except OSError:
            return 1
        return 2 if kind in backing.STACKED else 1

    def _backing_open(self, fd: int) -> int:
        arg = ctypes.create_string_buffer(
            fuse_abi.BACKING_MAP.pack(fd, 0, 0), fuse_abi.BACKING_MAP.size
        )
        return checked(
            libc.ioctl(self.fd, ctypes.c_ulong(fuse_abi.DEV_IOC_BACKING_OPEN), arg),
            call="FUSE_DEV_IOC_BACKING_OPEN",
        )

    def _backing_close(self, bid: int) -> None:
        arg = ctypes.c_uint32(bid)
        try:
            checked(
                libc.ioctl(
                    self.fd, ctypes.c_ulong(fuse_abi.DEV_IOC_BACKING_CLOSE), ctypes.byref(arg)
                )
            )
        except OSError as e:
            log.warning("FUSE_DEV_IOC_BACKING_CLOSE %d: %s", bid, e.strerror)

    def _flush(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        # Writes go straight to the backing file: nothing to flush at close.
        # ENOSYS once tells the kernel to send no more FLUSH.
        raise OSError(errno.ENOSYS, "no flush")

    def _fsync(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        fh, flags, _ = fuse_abi.FSYNC_IN.unpack_from(body)
        self.ops.fsync(fh, bool(flags & fuse_abi.FSYNC_FDATASYNC))
        self._reply(unique)

    def _syncfs(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        self.ops.store.sync()
        self._reply(unique)

    def _setxattr(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        size, flags = fuse_abi.SETXATTR_IN.unpack_from(body)
        rest = bytes(body[8:])
        end = rest.index(0)
        self.ops.setxattr(
            nodeid,
            rest[:end],
            rest[end + 1 : end + 1 + size],
            ctx=Ctx(pid, uid, gid, 0),
            flags=flags,
        )
        self._reply(unique)

    def _getxattr(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        size, _ = fuse_abi.GETXATTR_IN.unpack_from(body)
        value = self.ops.getxattr(nodeid, bytes(body[8:-1]), ctx=Ctx(pid, uid, gid, 0))
        self._sized(unique, size, value)

    def _listxattr(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        size, _ = fuse_abi.GETXATTR_IN.unpack_from(body)
        names = self.ops.listxattr(nodeid, ctx=Ctx(pid, uid, gid, 0))
        self._sized(unique, size, b"".join(n + b"\0" for n in names))

    def _sized(self, unique: int, size: int, value: bytes) -> None:
        """An xattr reply: its size when asked with size 0, else the value."""
        if size == 0:
            self._reply(unique, fuse_abi.GETXATTR_OUT.pack(len(value), 0))
        elif len(value) > size:
            self._error(unique, errno.ERANGE)
        else:
            self._reply(unique, value)

    def _removexattr(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        self.ops.removexattr(nodeid, bytes(body[:-1]), ctx=Ctx(pid, uid, gid, 0))
        self._reply(unique)

    def _opendir(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        fh = self.ops.opendir(nodeid, ctx=Ctx(pid, uid, gid, 0))
        # the kernel may keep the entries it read until the directory changes
        # (through the mount, or an undo, which invalidates it)
        self._reply(
            unique,
            fuse_abi.OPEN_OUT.pack(fh, fuse_abi.FOPEN_CACHE_DIR | fuse_abi.FOPEN_KEEP_CACHE, 0),
        )

    def _readdirplus(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        fh, off, size, _, _, _, _ = fuse_abi.READ_IN.unpack_from(body)
        out = bytearray()
        nlink = self.ops.nlink
        entry = fuse_abi.ENTRY_OUT.pack
        dirent = fuse_abi.DIRENT.pack

        def take(name: bytes, node: Node, st: os.stat_result, nxt: int) -> bool:
            reclen = 152 + len(name)  # (an entry's length, before its padding)
            pad = -reclen % 8
            if len(out) + reclen + pad > size:
                return False
            dot = name == b"." or name == b".."  # (the kernel takes no reference)
            out.extend(entry(0 if dot else node.ino, 0, _ENTRY_TIMEOUT, _ENTRY_TIMEOUT, 0, 0))
            out.extend(_attr(node, st, nlink(node, st)))
            out.extend(dirent(node.ino, nxt, len(name), stat.S_IFMT(st.st_mode) >> 12))
            out.extend(name)
            out.extend(bytes(pad))
            return True

        self.ops.readdir(fh, off, take)
        self._reply_data(unique, bytes(out))

    def _readdir(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        fh, off, size, _, _, _, _ = fuse_abi.READ_IN.unpack_from(body)
        out = bytearray()
        taken: list[Node] = []

        def take(name: bytes, node: Node, st: os.stat_result, nxt: int) -> bool:
            reclen = 24 + len(name)  # (an entry's length, before its padding)
            pad = -reclen % 8
            if len(out) + reclen + pad > size:
                return False
            out.extend(
                fuse_abi.DIRENT.pack(node.ino, nxt, len(name), stat.S_IFMT(st.st_mode) >> 12)
            )
            out.extend(name)
            out.extend(bytes(pad))
            if name != b"." and name != b"..":
                taken.append(node)
            return True

        self.ops.readdir(fh, off, take)
        # plain READDIR gives the kernel no reference (unlike READDIRPLUS)
        self.ops.forget([(node.ino, 1) for node in taken])
        self._reply_data(unique, bytes(out))

    def _releasedir(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        self.ops.releasedir(fuse_abi.RELEASE_IN.unpack_from(body)[0])
        self._reply(unique)

    def _fsyncdir(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        fh, flags, _ = fuse_abi.FSYNC_IN.unpack_from(body)
        self.ops.fsyncdir(fh, bool(flags & fuse_abi.FSYNC_FDATASYNC))
        self._reply(unique)

    def _access(
        self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview
    ) -> None:
        self._reply(unique)  # (default_permissions: the kernel checks)


class _Stop(Exception):
    """DESTROY: the kernel is done with this connection."""
