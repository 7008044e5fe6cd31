"""The mount daemon: hosts a workspace's session (cowfs/service/session.py) with a
mount -- mounts the workspace, serves FUSE requests and control requests
(cowfs/service/control.py) on one trio loop, handles signals, and unmounts cleanly.

``cowfs mount`` starts it as ``python -m cowfs.service.daemon`` in a new session and
waits on a pipe until the mount is live (or the daemon reports why not).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from .. import errors
from ..errors import AlreadyMounted, CowfsError, NoFuse, NotOwner
from ..fuse.ops import Ops
from ..layers import steps
from ..storage import gravesum, schema
from ..system import backing, progress
from ..system.access import Requester, granted
from ..system.backing import checked, libc
from ..system.mounts import (
    FSTYPE,
    MountRecord,
    check_other_mounts,
    mount_users,
    mounts,
    not_owner,
    processes,
    recover_stale_mount,
    socket_path,
    unmount,
)
from . import control
from .launch import clear_view, detach, reap
from .operations import allowed
from .restore import Invalid
from .session import AUDIT_LEVELS, OPS, MountHooks, Session, invoke

if TYPE_CHECKING:  # (imported when the engine is made: pyfuse3 may be missing)
    from ..fuse import kernel_engine, pyfuse3_engine

    Engine = kernel_engine.Engine | pyfuse3_engine.Engine

log = logging.getLogger("cowfs.daemon")

SYNC_INTERVAL = 2.0
LONG_REQUEST = 0.25  # seconds: a control request after which garbage is collected

# A diagnostic: $COWFS_TRACEMALLOC=DIR has the daemon trace its Python
# allocations (tracemalloc, several times slower) and write, after each
# control request, DIR/<pid>-<n>-<op>.txt: the memory traced now and at its
# peak during the request, and the lines that hold the most now.
_TRACE = os.environ.get("COWFS_TRACEMALLOC", "")
_traced = 0


def _let_go(seconds: float) -> None:
    """After a control request, give back what it used.  One that took a
    while (a layer of many records read) left garbage in cycles -- a
    journal reading's tree of slots -- which the collector's rare full
    passes would keep for many requests: it is collected now.  Then the C
    heap's free memory goes back to the system (malloc would keep it,
    scattered).  Measured: three `status` of 200,000 new files in a row
    held 219, 253, then 284 MiB."""
    if seconds > LONG_REQUEST:
        gc.collect()
    trim = getattr(libc, "malloc_trim", None)  # (glibc's)
    if trim is not None:
        trim(0)


def _trace_report(op: str) -> None:
    import tracemalloc

    global _traced
    _traced += 1
    now, peak = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    top = tracemalloc.take_snapshot().statistics("lineno")[:40]
    name = os.path.join(_TRACE, f"{os.getpid()}-{_traced:04d}-{op}.txt")
    with open(name, "w") as f:
        f.write(f"traced {now / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB during {op}\n")
        f.writelines(f"{s}\n" for s in top)


def check_fuse() -> None:
    if not os.path.exists("/dev/fuse"):
        raise NoFuse("/dev/fuse is missing: load the fuse module (modprobe fuse)")
    if os.geteuid() != 0 and not any(
        os.access(os.path.join(d, "fusermount3"), os.X_OK)
        for d in os.environ.get("PATH", "/usr/bin:/bin").split(":")
    ):
        raise NoFuse("fusermount3 is missing: install the fuse3 package")


def processes_inside(path: str) -> list[int]:
    """Pids whose working directory is inside *path* (they keep seeing the
    directory underneath the mount)."""
    out = []
    prefix = path.rstrip("/") + "/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if cwd == path or cwd.startswith(prefix):
            out.append(int(pid))
    return out


class Mounted(MountHooks):
    """The session's hooks into the mount: the operations serving it and
    the FUSE engine that serves them."""

    def __init__(self, ops: Ops, engine: Any, mountpoint: str):
        self.ops = ops
        self.engine = engine
        self.mountpoint = mountpoint

    async def flush(self) -> None:
        """(Without the writeback cache, write(2) reaches the daemon before
        it returns; only shared mmaps of files open for writing leave dirty
        pages.)"""
        if not self.ops.writers:
            return

        def syncfs() -> None:
            fd = os.open(self.mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                checked(libc.syncfs(fd))
            finally:
                os.close(fd)

        await self.blocking(syncfs)

    async def blocking(self, fn: Callable, *args: Any) -> Any:
        """(An operation holds file requests off only while it runs on the
        trio thread.)"""
        return await self.engine.blocking(fn, *args)

    async def wait(self, fn: Callable, *args: Any) -> Any:
        return await self.blocking(fn, *args)

    def layer_switched(self) -> None:
        self.ops.layer_switched()

    async def after_undo(self, touched: Any) -> None:
        invalid = self.ops.after_undo(touched)
        self.ops.layer_switched(after_undo=True)
        await self.blocking(self.engine.invalidate, *invalid)

    def after_commit(self, freed: list) -> None:
        self.ops.after_commit(freed)

    def removed(self, inos: list) -> None:
        self.ops.let_go(inos)

    def operations(self) -> Ops:
        return self.ops

    async def invalidate(self, invalid: Invalid) -> None:
        await self.blocking(self.engine.invalidate, sorted(invalid.entries), sorted(invalid.inodes))

    def refused(self) -> dict | None:
        return self.ops.refused if self.ops.refused["count"] else None

    def engine_info(self) -> dict | None:
        return {
            "name": self.engine.name,
            "why": self.engine.why,
            **getattr(self.engine, "features", lambda: {})(),
            "descriptors": self.ops.fds.info(),
        }


class Daemon:
    """One mounted workspace: its session, its mount, its control socket."""

    def __init__(self, session: Session, engine: str | None = None):
        """*session*: the workspace's, not opened yet (`prepare` opens it);
        *engine*: the FUSE engine asked for (default: chosen)."""
        self.session = session
        self.workspace = self.session.workspace
        self.mountpoint = self.session.mountpoint
        self.store_dir = self.session.store_dir
        self.warnings = self.session.warnings
        self.engine_choice = engine or "auto"
        self.owner = os.geteuid()
        self.lock = trio.Lock()
        self.inflight = 0
        self.unmounted_by_request = False
        self.engine: Engine | None = None  # (made by mount)

    # -- setting up ---------------------------------------------------------------

    def prepare(self) -> None:
        check_fuse()
        cleared = check_other_mounts(self.workspace, self.mountpoint, self.store_dir)
        own = recover_stale_mount(self.mountpoint)
        cleared += [own] if own else []
        self.warnings += cleared
        self.session.open(recovering=bool(cleared))
        if self.mountpoint == self.workspace:
            pids = processes_inside(self.workspace)
            if pids:
                self.warnings.append(
                    f"processes {', '.join(map(str, pids[:10]))} have their working "
                    "directory inside the workspace; they keep seeing the directory "
                    "underneath the mount and their changes are not captured"
                )

    @property
    def fuse(self) -> Engine:
        """The FUSE engine serving the mount (made by mount)."""
        if self.engine is None:
            raise RuntimeError("the workspace is not mounted: no FUSE engine yet")
        return self.engine

    def mount(self, on_ready: Callable[[], None]) -> None:
        s = self.session
        # (forked now, before the FUSE engine's and the control server's
        # threads start and before the inode table grows: little to share)
        helper = steps.Helper(s.store, s.stackview.resolver)
        ops = Ops(s.rootfd, s.store, s.recorder, hidden=s.hidden)
        self.engine = engine = make_engine(self.engine_choice, ops)
        self.record = MountRecord(
            self.mountpoint,
            self.workspace,
            self.store_dir,
            os.getpid(),
            socket_path(self.mountpoint, shared=bool(s.grants)),
        )
        s.attach(
            Mounted(ops, engine, self.mountpoint),
            helper=helper,
            board=progress.Board(progress.path_for(self.record.socket)),
        )
        ops.on_full = s.give_back_room
        self.hasher = ops.sums = gravesum.Hasher(
            s.store,
            busy=ops.is_open,
            quiet=ops.quiet,
            exclusive=self.exclusive,
            operating=self.lock.locked,
        )
        fsname = "cowfs" if "," in self.workspace else f"cowfs:{self.workspace}"
        try:  # informational (a full disk must not keep the workspace from mounting)
            s.store.set_meta_json(schema.K_STATE, {"mounted": True, "pid": os.getpid()})
        except OSError:
            pass
        s.store.audit(
            "mount",
            layer=s.store.open_layer().id,
            mountpoint=self.mountpoint,
            warnings=self.warnings,
        )
        backing.clear_umask()  # new objects get the caller's mode, not ours on top
        engine.mount(self.mountpoint, fsname, os.geteuid() == 0, on_ready)

    def run(self) -> None:
        store = self.session.store
        try:
            trio.run(self._main)
        finally:
            if not self.unmounted_by_request:
                try:
                    self.fuse.close(unmount=True)
                except Exception:
                    log.exception("unmount failed")
            else:
                self.fuse.close(unmount=False)
            try:  # (a mount meanwhile waits for us, see Session.open)
                self.record.finishing = True
                self.record.save()
            except OSError:
                pass
            try:
                self.session.record_fingerprint()
                store.audit("unmount", layer=store.open_layer().id)
                try:
                    store.set_meta_json(schema.K_STATE, {"mounted": False, "pid": None})
                except OSError:
                    pass
                store.close()
            finally:
                self.record.remove()
                self.session.board.close()
                if self.session.helper is not None:
                    self.session.helper.close()
            log.info("unmounted %s", self.mountpoint)

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                control.serve, self.record.socket, self, 0o666 if self.record.shared else 0o600
            )
            ours = [m for m in mounts() if m.mountpoint == self.mountpoint and m.fstype == FSTYPE]
            self.record.dev = ours[-1].dev if ours else ""
            self.record.save()
            nursery.start_soon(self._signals)
            nursery.start_soon(self._periodic_sync)
            nursery.start_soon(self.hasher.run)
            nursery.start_soon(self._resume_forks)
            await self.fuse.serve()
            with trio.move_on_after(5):
                while self.inflight:
                    await trio.sleep(0.01)
            self.hasher.stop.set()  # (a file being hashed is left for the drain)
            nursery.cancel_scope.cancel()
        # removed files not hashed yet are hashed before the store closes
        await self.hasher.drain()

    async def _resume_forks(self) -> None:
        """The workspace's forks are mounted again (with it, after the
        control channel answers: a request waits for them)."""
        async with self.lock:
            with self.exclusive():
                for warning in await self.session.resume_adopt():
                    log.warning("%s", warning)
            for warning in await self.fuse.blocking(self.session.resume):
                log.warning("%s", warning)

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            stopping = False
            async for _ in sigs:  # keep receiving: a second signal must not kill us mid-stop
                if stopping:
                    continue
                stopping = True
                log.info("signal received, unmounting")
                sd_notify("STOPPING=1")
                await self.session.flush()
                with self.fuse.exclusive():
                    self.session.store.sync()
                self.fuse.terminate()

    async def _periodic_sync(self) -> None:
        while True:
            await trio.sleep(SYNC_INTERVAL)
            await trio.to_thread.run_sync(self.session.store.env.sync, True)
            reap()  # (views that ended)

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """While control code runs, no file request is served (the kernel
        engine serves them on a thread of its own)."""
        return self.engine.exclusive() if self.engine is not None else contextlib.nullcontext()

    # -- control requests (control.Host) ----------------------------------------------

    def permits_any(self, who: Requester) -> bool:
        return bool(allowed(granted(self.session.grants, who)))

    def permits(self, who: Requester, name: str) -> None:
        """*who* may ask for operation *name*: the owner and root anything,
        another user what the workspace grants it (NotOwner otherwise)."""
        if who.uid in (0, self.owner):
            return
        ops = allowed(granted(self.session.grants, who))
        what = f"the cowfs workspace mounted at {self.mountpoint}"
        if not ops:
            raise not_owner(what, self.owner)
        if name not in ops:
            raise NotOwner(
                f"{what} belongs to another user (uid {self.owner}), who lets uid "
                f"{who.uid} ask for {', '.join(sorted(ops))}, not {name}"
            )

    def operation(self, name: str) -> Callable:
        if name in ("ping", "unmount"):
            return getattr(self, "op_" + name)
        if name in OPS:
            return getattr(self.session, name)
        raise KeyError(name)

    async def run_request(
        self, name: str, op: Callable, args: dict, who: Requester, gone: Callable[[], bool]
    ) -> dict:
        async with self.lock:
            if gone():
                raise control.Gone
            t0 = time.perf_counter()
            with self.exclusive():  # (let go while it waits)
                self.session.request_starts()
                self.session.requester = who
                result = await invoke(op, **args)
            result["daemon_ms"] = round((time.perf_counter() - t0) * 1000, 3)
            if _TRACE:
                _trace_report(name)
        _let_go(time.perf_counter() - t0)
        return result

    async def unanswered(self, name: str, result: dict) -> None:
        if name == "view":
            # the client is gone (Ctrl-C): a view nobody was told of goes
            await self.fuse.blocking(clear_view, result["mountpoint"])

    async def op_ping(self) -> dict:
        store = self.session.store
        sv = os.fstatvfs(store.dirfd)  # (the mount's statfs is capped by --max-store)
        return {
            "pid": os.getpid(),
            "workspace": self.workspace,
            "mountpoint": self.mountpoint,
            "store": self.store_dir,
            "engine": self.session.hooks.engine_info(),
            "disk": {"free": sv.f_bavail * sv.f_frsize, "size": sv.f_blocks * sv.f_frsize},
        }

    async def op_unmount(self, lazy: bool = False) -> dict:
        """Unmount; the daemon then exits.  *lazy*: detach the mount even
        while processes use it (umount -l); the daemon goes on serving
        them, and exits when the kernel lets the mount go after the last
        one.  The answer names them ("users"; "pid": this daemon)."""
        await self.session.flush()
        self.session.store.sync()
        ours = [
            m
            for m in mounts()  # (not in the table any more once detached)
            if m.mountpoint == self.mountpoint and m.fstype == FSTYPE
        ]
        try:
            await self.fuse.blocking(unmount, self.mountpoint, lazy)
        except OSError as e:
            if e.errno == errno.EBUSY:
                users = await self.fuse.blocking(mount_users, ours[-1]) if ours else []
                raise AlreadyMounted(
                    f"{self.mountpoint} is busy: "
                    + (
                        f"used by {processes(users)}"
                        if users
                        else "a process has a file or its working directory there"
                    )
                    + "; close them, or use --lazy"
                ) from None
            raise CowfsError(f"unmount failed: {e.strerror}") from None
        self.unmounted_by_request = True
        sd_notify("STOPPING=1")
        result: dict[str, Any] = {"unmounted": self.mountpoint, "pid": os.getpid()}
        if lazy and ours:
            result["users"] = await self.fuse.blocking(mount_users, ours[-1])
            if result["users"]:
                log.info(
                    "detached %s; serving the processes still using it until the "
                    "last one leaves: %s",
                    self.mountpoint,
                    ", ".join(map(str, result["users"])),
                )
        return result


ENGINES = ("auto", "kernel", "pyfuse3")


def make_engine(choice: str, ops: Ops) -> Engine:
    """The FUSE engine to serve *ops* with: *choice* "kernel", "pyfuse3",
    or "auto" (the kernel engine wherever it can run)."""
    from ..fuse import kernel_engine, pyfuse3_engine

    why_not = kernel_engine.available()
    if choice == "kernel":
        if why_not:
            raise NoFuse(f"the kernel engine cannot run here: {why_not}")
        return kernel_engine.Engine(ops, "chosen with --engine kernel")
    if choice == "auto" and not why_not:
        return kernel_engine.Engine(ops, "the default where it can run")
    return pyfuse3_engine.Engine(
        ops,
        "chosen with --engine pyfuse3"
        if choice == "pyfuse3"
        else f"the kernel engine cannot run here: {why_not}",
    )


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) about our state, when it is listening."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(message.encode())
    except OSError as e:
        log.warning("cannot notify systemd: %s", e)


def setup_logging(store_dir: str, foreground: bool) -> None:
    handlers: list[logging.Handler] = [logging.FileHandler(os.path.join(store_dir, "daemon.log"))]
    if foreground:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(
        level=logging.INFO,
        handlers=handlers,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


MOUNT_OPTIONS = ("chunk_size", "max_store", "max_layers")


GC_YOUNG = 50_000  # allocations between two passes of the cyclic collector


def serve(
    workspace: str,
    mountpoint: str | None,
    store: str | None,
    report: Callable[[dict], None],
    foreground: bool,
    **options: Any,
) -> int:
    """Prepare, mount and serve until unmounted.  *report* is called once,
    with {"ok": True, "warnings": [...]} when the mount is live, or with the
    error that prevented it.  *options*: MOUNT_OPTIONS."""
    # The daemon keeps large structures for its whole life (the inode table,
    # the journal readings kept between requests) and allocates many small
    # objects a request and a record, few of them in cycles: the collector's
    # default (a pass every 700 allocations, each over every survivor of the
    # young generations) took a fifth of a stack operation on a layer of
    # 100,000 records.  A pass every 50,000 costs a few MB of cyclic garbage
    # kept a little longer.
    gc.set_threshold(GC_YOUNG, 20, 10)
    # Out of whatever directory started it (the workspace itself, often):
    # nothing the daemon starts may find a module there, nor a path be
    # read against it.
    workspace = os.path.abspath(workspace)
    mountpoint = None if mountpoint is None else os.path.abspath(mountpoint)
    store = None if store is None else os.path.abspath(store)
    os.chdir("/")
    if _TRACE:
        import tracemalloc

        tracemalloc.start(int(os.environ.get("COWFS_TRACEMALLOC_FRAMES") or 1))
    engine = options.pop("engine", None)
    daemon = Daemon(Session(workspace, mountpoint, store, **options), engine)
    try:
        daemon.prepare()
        setup_logging(daemon.session.store.path, foreground)  # (the path checked and opened)

        def ready() -> None:
            report(
                {
                    "ok": True,
                    "warnings": daemon.warnings,
                    "pid": os.getpid(),
                    "mountpoint": daemon.mountpoint,
                }
            )
            sd_notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=mounted {daemon.mountpoint}")

        daemon.mount(ready)
    except CowfsError as e:
        report({"ok": False, **e.to_dict()})
        return e.code
    except OSError as e:
        report(
            {
                "ok": False,
                "code": errors.DAEMON_ERROR,
                "error": f"cannot mount {workspace}: {e.strerror or e}",
            }
        )
        return errors.DAEMON_ERROR
    daemon.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cowfs-daemon")
    p.add_argument("--ready-fd", type=int, required=True)
    p.add_argument("--store")
    for name in MOUNT_OPTIONS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int)
    p.add_argument("--accept-drift", action="store_true")
    p.add_argument("--ignore", action="append")
    p.add_argument("--allow", action="append")
    p.add_argument("--audit", choices=AUDIT_LEVELS)
    p.add_argument("--engine", choices=ENGINES)
    p.add_argument("workspace")
    p.add_argument("mountpoint", nargs="?")
    a = p.parse_args(argv)
    return serve(
        a.workspace,
        a.mountpoint,
        a.store,
        detach(a.ready_fd),
        foreground=False,
        accept_drift=a.accept_drift,
        ignore=a.ignore,
        allow=a.allow,
        audit=a.audit,
        engine=a.engine,
        **{name: getattr(a, name) for name in MOUNT_OPTIONS},
    )


if __name__ == "__main__":
    sys.exit(main())
