"""The mount daemon: mounts a workspace, serves FUSE requests and control
requests on one trio loop, and unmounts cleanly.

``cowfs mount`` starts it as ``python -m cowfs.daemon`` in a new session and
waits on a pipe until the mount is live (or the daemon reports why not).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import functools
import json
import logging
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable

import trio

from . import backing as B
from . import schema as S
from . import errors
from . import fsck
from . import gravesum
from . import progress
from . import redo
from .capture import Recorder
from .control import MAX_REQUEST, encode, wait_readable
from .errors import AlreadyMounted, BadWorkspace, CowfsError, Drift, NoFuse, NotMounted
from .ops import Ops
from .ignore import IgnoreRules
from .past import SHOW_PAGE, History, describe_past, diff_entry, wpath
from .providers import Registry
from .mounts import (FSTYPE, MountRecord, is_cowfs_mount, lock_holder, mount_table, mount_users,
                     mounted_workspaces, mounts, not_owner, pid_alive, socket_path,
                     processes, unmount, wait_gone)
from .stack import FINISHED, RollbackReport, Stack, files_left
from .store import Store
from .text import count
from .view import FSTYPE as VIEW_FSTYPE

AUDIT_HASH_LIMIT = 64 << 20     # larger files get sizes only in the audit log
AUDIT_LEVELS = ("hashes", "changes", "events")

log = logging.getLogger("cowfs.daemon")

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
FINISHING_WAIT = 60       # seconds a mount waits for the last mount's daemon to exit
SYNC_INTERVAL = 2.0


def default_store(workspace: str) -> str:
    return os.path.join(workspace, ".cowfs")


def check_fuse() -> None:
    if not os.path.exists("/dev/fuse"):
        raise NoFuse("/dev/fuse is missing: load the fuse module (modprobe fuse)")
    if os.geteuid() != 0 and not any(
            os.access(os.path.join(d, "fusermount3"), os.X_OK)
            for d in os.environ.get("PATH", "/usr/bin:/bin").split(":")):
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


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 20
    if os.geteuid() == 0 and hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return
        except (ValueError, OSError):
            pass
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class BadRequest(Exception):
    pass


def check_args(op: Callable, args: dict) -> None:
    """Arguments must be the op's parameters, of their annotated types
    (bool is not an int here; None only where allowed)."""
    import inspect
    import typing
    params = inspect.signature(op).parameters
    hints = typing.get_type_hints(op)
    for name, value in args.items():
        if name not in params:
            raise BadRequest(f"unknown argument {name!r}")
        allowed = typing.get_args(hints[name]) or (hints[name],)
        ok = any(value is None if t is type(None) else
                 isinstance(value, t) and not (t is int and isinstance(value, bool))
                 for t in allowed)
        if not ok:
            raise BadRequest(f"argument {name!r} has the wrong type")
    for name, p in params.items():
        if p.default is inspect.Parameter.empty and name not in args:
            raise BadRequest(f"missing argument {name!r}")


class Daemon:
    def __init__(self, workspace: str, mountpoint: str | None = None,
                 store: str | None = None, chunk_size: int | None = None,
                 max_store: int | None = None, max_layers: int | None = None,
                 accept_drift: bool = False, ignore: list[str] | None = None,
                 audit: str | None = None, engine: str | None = None):
        self.workspace = os.path.abspath(workspace)
        self.engine_choice = engine or "auto"
        self.mountpoint = os.path.abspath(mountpoint or workspace)
        self.store_dir = os.path.abspath(store or default_store(self.workspace))
        self.chunk_size = chunk_size
        self.limits = {"max_store": max_store, "max_layers": max_layers, "audit": audit}
        self.accept_drift = accept_drift
        self.ignore_patterns = ignore     # None: the store's, as the last mount set them
        self.owner = os.geteuid()
        self.warnings: list[str] = []
        self.lock = trio.Lock()
        self.inflight = 0
        self.unmounted_by_request = False
        self.recovering = False
        self.fs: Ops | None = None       # the mounted view's operations
        self.engine = None
        self._history_cache: tuple | None = None   # (store state, History) for show/diff

    # -- setting up ---------------------------------------------------------------

    def prepare(self) -> None:
        check_fuse()
        self._check_other_mounts()
        self._open()
        if self.mountpoint == self.workspace:
            pids = processes_inside(self.workspace)
            if pids:
                self.warnings.append(
                    f"processes {', '.join(map(str, pids[:10]))} have their working "
                    "directory inside the workspace; they keep seeing the directory "
                    "underneath the mount and their changes are not captured")

    def open_offline(self) -> None:
        """Open the store of a workspace that is not mounted (a dead mount
        is cleared first) to run control operations on it directly: recovery
        never depends on FUSE."""
        if not os.path.isdir(self.store_dir) and not is_cowfs_mount(self.workspace):
            raise NotMounted(f"{self.workspace} is not mounted and has no cowfs store "
                             f"({self.store_dir})")
        self._open(create=False)

    def close_offline(self) -> None:
        self.store.sync()
        self.store.close()
        os.close(self.rootfd)

    def _check_other_mounts(self) -> None:
        """Before mounting: refuse a workspace that is mounted already
        (anywhere; a dead mount of it is cleared), a mount point where
        another workspace is mounted, and any nesting with another mounted
        workspace, either way: the outer one's layers would capture the
        inner one's live store, and an outer rollback rewrite it."""
        ws, mp, store = map(os.path.realpath, (self.workspace, self.mountpoint, self.store_dir))
        ours = {"workspace": ws, "mount point": mp, "store": store}
        for rec in mounted_workspaces():
            live = rec.pid > 0 and pid_alive(rec.pid)
            # (their paths as recorded, absolute: resolving them would ask their
            # daemons, and one that hangs would hang this mount)
            theirs = {"workspace": os.path.normpath(rec.workspace),
                      "mount point": os.path.normpath(rec.mountpoint),
                      "store": os.path.normpath(rec.store) if rec.store else None}
            if ws in (theirs["workspace"], theirs["mount point"]) or store == theirs["store"]:
                if live:
                    raise already_mounted(rec)
                if rec.pid and theirs["mount point"] != mp:   # (dead, by its record)
                    self._recover_stale_mount(rec.mountpoint)
                continue
            if mp == theirs["mount point"]:
                if live:
                    raise AlreadyMounted(f"{mp} is the mount point of the cowfs workspace "
                                         f"{rec.workspace} (daemon pid {rec.pid})")
                continue    # a dead mount there is cleared by _open
            other = rec.workspace + ("" if theirs["mount point"] == theirs["workspace"]
                                     else f" (mounted at {rec.mountpoint})")
            for role, path in ours.items():
                for their_role, their_path in theirs.items():
                    if their_path is None:
                        continue
                    what = ("the store of " if their_role == "store" else "") + \
                        f"the mounted cowfs workspace {other}"
                    if within(path, their_path):
                        where = f"its {role} {path} lies inside {what}"
                    elif within(their_path, path):
                        where = f"{what} lies inside its {role} {path}"
                    else:
                        continue
                    raise BadWorkspace(f"cannot mount {ws}: {where}; nested workspaces are "
                                       "refused (the outer one would capture the inner "
                                       "one's store)")

    def _store_in_use(self) -> AlreadyMounted:
        """Why the store's lock is taken: by the daemon of a mount (or of a
        lazily unmounted one that still serves), or by another process."""
        store = os.path.realpath(self.store_dir)
        for rec in MountRecord.all():
            if os.path.normpath(rec.store) != store or not pid_alive(rec.pid):
                continue
            if is_cowfs_mount(rec.mountpoint):
                return already_mounted(rec)
            return AlreadyMounted(
                f"{rec.workspace} was unmounted lazily from {rec.mountpoint} and its daemon "
                f"(pid {rec.pid}) still serves the processes using it; it exits when the "
                "last one leaves")
        pid = lock_holder(os.path.join(self.store_dir, "lock"))
        return AlreadyMounted(f"the store of {self.workspace} ({self.store_dir}) is in use "
                              "by another cowfs process" + (f" (pid {pid})" if pid else ""))

    def _open(self, create: bool = True) -> None:
        self._recover_stale_mount()
        if not os.path.isdir(self.workspace):
            raise BadWorkspace(f"workspace {self.workspace} does not exist or is not a directory")
        if not os.path.isdir(self.mountpoint):
            raise BadWorkspace(f"mount point {self.mountpoint} is not a directory")
        raise_fd_limit()
        self.rootfd = os.open(self.workspace, B.DIR_FLAGS)
        def open_store() -> Store:
            return Store.open(self.store_dir, self.workspace, create=create,
                              **({"chunk_size": self.chunk_size} if self.chunk_size else {}))
        try:
            self.store = open_store()
        except AlreadyMounted:
            # the daemon of the last mount may still be recording its state
            finishing = [rec for rec in MountRecord.all() if rec.finishing and
                         os.path.normpath(rec.store) == os.path.realpath(self.store_dir)
                         and pid_alive(rec.pid)]
            if not finishing:
                raise self._store_in_use() from None
            pid = finishing[0].pid
            t0 = time.monotonic()
            if not wait_gone(pid, FINISHING_WAIT):
                raise AlreadyMounted(
                    f"the daemon of the last mount of {self.workspace} (pid {pid}) is still "
                    f"finishing its unmount after {FINISHING_WAIT} s (recording the "
                    "workspace's state, closing the store); mount again once it has "
                    "exited") from None
            self.warnings.append(f"waited {time.monotonic() - t0:.1f} s for the daemon of the "
                                 f"last mount (pid {pid}) to finish its unmount")
            self.store = open_store()
        inside = os.path.dirname(self.store_dir) == self.workspace
        self.hidden = os.fsencode(os.path.basename(self.store_dir)) if inside else None
        if create:   # a mount: its options (0 clears) change the store's limits
            self.store.set_limits(**{k: v for k, v in self.limits.items() if v is not None})
        self.stack = Stack(self.store, B.Resolver(self.rootfd, self.store.grave_fd))
        if self.recovering:
            self.warnings += [f"store check: {p}" for p in self.stack.check()]
        self.registry = Registry(self.store.dirfd, self.mountpoint)
        if create:
            self._check_drift()
        # An interrupted rollback resumes under the filters its layers were
        # captured with; a mount's new --ignore patterns apply from then on.
        self._load_ignore_rules()
        pending = self.stack.pending()
        if pending is not None and pending.get("op") == "checkpoint":
            self.recorder = Recorder(self.store)
            self.warnings += self._resume_checkpoint(pending)
        elif pending is not None:
            self.warnings += trio.run(self._resume)
        if create and self.ignore_patterns is not None:
            self.store.set_meta_json(S.K_IGNORE, self.ignore_patterns)
            self._load_ignore_rules()
        self.stack.resume()
        self.recorder = Recorder(self.store)
        self.recorder.ignore = self.rules

    def _load_ignore_rules(self) -> None:
        self.rules = IgnoreRules(self.rootfd, self.store.get_meta_json(S.K_IGNORE) or [])
        self.stack.ignored = self.rules.matches

    def _check_drift(self) -> None:
        """Paths the layers changed that were changed again while the
        workspace was not mounted make the mount refuse (their undo data no
        longer fits them), unless accepted; accepted drift is logged."""
        recorded = self.store.get_meta_json(S.K_DRIFT)
        if recorded is None:
            return
        drift = self.stack.drift(recorded)
        if drift and not self.accept_drift:
            shown = ", ".join(drift[:10]) + (f" and {len(drift) - 10} more"
                                            if len(drift) > 10 else "")
            raise Drift(f"{len(drift)} path{'s' if len(drift) > 1 else ''} the layers changed "
                        f"were changed while the workspace was not mounted: {shown}; a "
                        "rollback would mix both; mount with --accept-drift to go on anyway")
        if drift:
            self.stack.discard_redo("the workspace was changed while not mounted "
                                    "(mounted with --accept-drift)")
            top = self.stack.ensure_base()
            self.store.append_to_layer(top.id, "drift", [{"time": time.time(), "paths": drift}])
            self.warnings.append(f"accepted drift of {count(len(drift), 'path')} (recorded in the log): "
                                 + ", ".join(drift[:10]))
        # (no write: the first change captured makes the record stale)

    def record_fingerprint(self) -> None:
        """At a clean unmount: what the layers' paths look like now."""
        try:
            self.store.set_meta_json(S.K_DRIFT, self.stack.fingerprint())
        except Exception:
            log.exception("could not record the workspace's state for drift detection")

    def _recover_stale_mount(self, mountpoint: str | None = None) -> None:
        mountpoint = mountpoint or self.mountpoint
        if not is_cowfs_mount(mountpoint):
            return
        rec = MountRecord.load(mountpoint)
        if rec is not None and pid_alive(rec.pid):
            raise AlreadyMounted(f"{mountpoint} is already mounted by cowfs (pid {rec.pid})")
        unmount(mountpoint, lazy=True)
        self.recovering = True
        if rec is not None:
            rec.remove()
        self.warnings.append(f"cleared the dead mount at {mountpoint}")

    def mount(self, on_ready: Callable[[], None]) -> None:
        self.fs = Ops(self.rootfd, self.store, self.recorder, hidden=self.hidden)
        self.engine = make_engine(self.engine_choice, self.fs)
        self.stack.on_freed = self.fs.after_commit
        self.fs.on_full = self._give_back_redo
        self.hasher = self.fs.sums = gravesum.Hasher(self.store, busy=self.fs.is_open,
                                                     quiet=self.fs.quiet,
                                                     exclusive=self.exclusive)
        fsname = "cowfs" if "," in self.workspace else f"cowfs:{self.workspace}"
        self.record = MountRecord(self.mountpoint, self.workspace, self.store_dir,
                                  os.getpid(), socket_path(self.mountpoint))
        self.stack.board = progress.Board(progress.path_for(self.record.socket))
        try:    # informational (a full disk must not keep the workspace from mounting)
            self.store.set_meta_json(S.K_STATE, {"mounted": True, "pid": os.getpid()})
        except OSError:
            pass
        self.store.audit("mount", layer=self.store.top().id, mountpoint=self.mountpoint,
                         warnings=self.warnings)
        B.clear_umask()   # new objects get the caller's mode, not ours on top
        self.engine.mount(self.mountpoint, fsname, os.geteuid() == 0, on_ready)

    def run(self) -> None:
        try:
            trio.run(self._main)
        finally:
            if not self.unmounted_by_request:
                try:
                    self.engine.close(unmount=True)
                except Exception:
                    log.exception("unmount failed")
            else:
                self.engine.close(unmount=False)
            try:        # (a mount meanwhile waits for us, see _open)
                self.record.finishing = True
                self.record.save()
            except OSError:
                pass
            try:
                self.record_fingerprint()
                self.store.audit("unmount", layer=self.store.top().id)
                try:
                    self.store.set_meta_json(S.K_STATE, {"mounted": False, "pid": None})
                except OSError:
                    pass
                self.store.close()
            finally:
                self.record.remove()
                self.stack.board.close()
            log.info("unmounted %s", self.mountpoint)

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self._serve_control)
            self.record.save()
            nursery.start_soon(self._signals)
            nursery.start_soon(self._periodic_sync)
            nursery.start_soon(self.hasher.run)
            await self.engine.serve()
            with trio.move_on_after(5):
                while self.inflight:
                    await trio.sleep(0.01)
            self.hasher.stop.set()      # (a file being hashed is left for the drain)
            nursery.cancel_scope.cancel()
        # removed files not hashed yet are hashed before the store closes
        await self.hasher.drain()

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            stopping = False
            async for _ in sigs:  # keep receiving: a second signal must not kill us mid-stop
                if stopping:
                    continue
                stopping = True
                log.info("signal received, unmounting")
                sd_notify("STOPPING=1")
                await self._flush()
                with self.engine.exclusive():
                    self.store.sync()
                self.engine.terminate()

    async def _periodic_sync(self) -> None:
        while True:
            await trio.sleep(SYNC_INTERVAL)
            await trio.to_thread.run_sync(self.store.env.sync, True)

    # -- flushing and invalidating ---------------------------------------------------

    async def _flush(self) -> None:
        """Write the kernel's dirty pages of this mount to the daemon, so that
        every write completed so far belongs to the current layer.  (Without
        the writeback cache, write(2) reaches the daemon before it returns;
        only shared mmaps of files open for writing leave dirty pages.)"""
        self.recorder.flush()
        if self.fs is None or not self.fs.writers:
            return

        def syncfs() -> None:
            fd = os.open(self.mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                if _libc.syncfs(fd) != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, os.strerror(e))
            finally:
                os.close(fd)

        await self._blocking(syncfs)

    async def _invalidate(self, entries: list[tuple[int, bytes]], inodes: list[int]) -> None:
        await self._blocking(self.engine.invalidate, entries, inodes)

    def exclusive(self):
        """While control code runs, no file request is served (the kernel
        engine serves them on a thread of its own)."""
        return self.engine.exclusive() if self.engine is not None else contextlib.nullcontext()

    async def _blocking(self, fn, *args):
        """Run *fn* in a worker thread; file requests are served meanwhile
        (an operation holds them off only while it runs here)."""
        if self.engine is None:
            return await trio.to_thread.run_sync(fn, *args)
        return await self.engine.blocking(fn, *args)

    # -- control requests ---------------------------------------------------------------

    async def _serve_control(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        path = self.record.socket
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(socket.SOMAXCONN)
        listener = trio.SocketListener(sock)
        task_status.started()
        await trio.serve_listeners(self._connection, [listener])

    async def _connection(self, stream: trio.SocketStream) -> None:
        """Serve one request; nothing a client sends may escape this (an
        exception here would stop the daemon and its mount)."""
        try:
            await self._serve_one(stream)
        except Exception:
            log.exception("control connection failed")

    async def _serve_one(self, stream: trio.SocketStream) -> None:
        async with stream:
            creds = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                             struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if uid not in (0, self.owner):
                e = not_owner(f"the cowfs workspace mounted at {self.mountpoint}", self.owner)
                await stream.send_all(encode({"ok": False, **e.to_dict()}))
                return
            buf = bytearray()
            with trio.move_on_after(30):
                while b"\n" not in buf and len(buf) <= MAX_REQUEST:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        break
                    buf += chunk
            if b"\n" not in buf:
                return
            try:
                req = json.loads(buf[:buf.index(b"\n")])
                op = getattr(self, "op_" + req.pop("op"))
                check_args(op, req)
            except BadRequest as e:
                await stream.send_all(encode({"ok": False, "code": errors.USAGE,
                                              "error": f"bad request: {e}"}))
                return
            except Exception:  # not JSON, not an object, no such op, too deep, ...
                await stream.send_all(encode({"ok": False, "code": errors.USAGE,
                                              "error": "malformed request"}))
                return
            self.inflight += 1    # until answered: an unmount's answer goes out before we exit
            try:
                try:
                    async with self.lock:
                        t0 = time.perf_counter()
                        with self.exclusive():      # (let go while it waits)
                            self.rules.stale = True     # (.cowfsignore as it is now)
                            result = await op(**req)
                        result["daemon_ms"] = round((time.perf_counter() - t0) * 1000, 3)
                    resp = {"ok": True, "result": result}
                except CowfsError as e:
                    resp = {"ok": False, **e.to_dict()}
                except Exception as e:
                    log.exception("control request failed")
                    resp = {"ok": False, "code": errors.DAEMON_ERROR, "error": str(e)}
                try:
                    await stream.send_all(encode(resp))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    if op.__name__ == "op_view" and resp["ok"]:
                        # the client is gone (Ctrl-C): a view nobody was told of goes
                        await self._blocking(clear_view, resp["result"]["mountpoint"])
            finally:
                self.inflight -= 1

    async def op_ping(self) -> dict:
        sv = os.fstatvfs(self.store.dirfd)   # (the mount's statfs is capped by --max-store)
        return {"pid": os.getpid(), "workspace": self.workspace,
                "mountpoint": self.mountpoint, "store": self.store_dir,
                "engine": self.engine_info(),
                "disk": {"free": sv.f_bavail * sv.f_frsize, "size": sv.f_blocks * sv.f_frsize}}

    def engine_info(self) -> dict | None:
        """Which FUSE engine serves the mount, why, and what it negotiated."""
        if self.engine is None:
            return None
        return {"name": self.engine.name, "why": self.engine.why,
                **getattr(self.engine, "features", lambda: {})()}

    async def op_checkpoint(self, message: str = "", providers: list | None = None,
                            containers: list | None = None, vms: list | None = None,
                            agent: dict | None = None) -> dict:
        """Open a layer (with snapshots of *providers*, *containers* and
        *vms*).  *agent*: the agent event it stands for (see `agents`), kept
        on the layer: {"agent": str, "event": str, ...}, at most 16 KiB."""
        if agent is not None:
            check_agent_record(agent)
        providers = list(providers or [])
        for kind, key, names in (("docker", "container", containers or []),
                                 ("libvirt", "domain", vms or [])):
            for target in names:
                if not isinstance(target, str) or not target:
                    raise CowfsError("bad request: container and VM names are strings",
                                     errors.USAGE)
                providers.append(self.registry.ensure(kind, key, target))
        if not all(isinstance(p, str) for p in providers) or len(set(providers)) != len(providers):
            raise CowfsError("bad request: providers must be distinct names", errors.USAGE)
        chosen = [self.registry.get(name) for name in providers]  # unknown names fail first
        await self._flush()
        layer = self.stack.checkpoint(message, agent)
        self._switched(fresh=True)
        taken: list[dict] = []
        t0 = time.perf_counter()
        if chosen:   # a crash while capturing: the next mount removes what was taken
            self.store.set_meta_json(S.K_PENDING, {"op": "checkpoint", "layer": layer.id,
                                                   "providers": providers})
        try:
            for provider in chosen:
                ctx = self.registry.context(provider.name, layer.id)
                data = await self._blocking(provider.capture, ctx)
                taken.append({"provider": provider.name, "data": data,
                              "seconds": round(time.perf_counter() - t0, 3)})
                t0 = time.perf_counter()
            if taken:
                self.store.set_snapshots(layer.id, taken, close_pending=True)
        except Exception as e:
            # All or nothing: discard what was taken and drop the new layer.
            failed = chosen[min(len(taken), len(chosen) - 1)].name
            leftovers = []
            for snap in reversed(taken):
                try:
                    await self._apply("discard", snap["provider"], layer.id, snap["data"])
                except Exception as e2:
                    leftovers.append(f"; discarding {snap['provider']}'s snapshot failed: {e2}")
            self.registry.drop_state(self.registry.context(failed, layer.id))
            self._drop_checkpoint(layer.id)
            raise CowfsError(f"checkpoint failed: provider {failed!r}: {e}; "
                             "nothing was taken" + "".join(leftovers),
                             errors.DAEMON_ERROR) from None
        info = self.store.get_layer(layer.id).to_dict()
        self.store.audit("checkpoint", layer=layer.id, message=message,
                         snapshots=[t["provider"] for t in taken],
                         **({"agent": agent} if agent else {}))
        merged = await self._enforce_max_layers()
        if merged:
            info["merged"] = merged
        return info

    def _drop_checkpoint(self, layer_id: int) -> None:
        """Undo a checkpoint that failed (or a crash interrupted) while taking
        snapshots: its layer merges into the one below, so changes programs
        made meanwhile are kept, and the pending record is cleared."""
        top = self.store.top()
        if top is not None and top.id == layer_id and len(self.store.layers()) > 1:
            self.stack.commit()
        self.store.set_meta_json(S.K_PENDING, None)
        self._switched(fresh=False)

    def _resume_checkpoint(self, pending: dict) -> list[str]:
        """A crash interrupted a checkpoint's captures: discard what each
        provider may have taken for that layer, and drop the checkpoint."""
        layer, problems = pending["layer"], []
        for name in pending.get("providers", []):
            try:
                ctx = self.registry.context(name, layer)
                self.registry.get(name).forget(ctx)
                self.registry.drop_state(ctx)
            except Exception as e:
                problems.append(f"discarding what provider {name} took for layer {layer} "
                                f"failed: {e}")
        self._drop_checkpoint(layer)
        return [f"a checkpoint (layer {layer}) was interrupted while taking snapshots of "
                f"{', '.join(pending.get('providers', []))}: what they took was discarded and "
                f"the layer merged into the one below"] + problems

    async def _enforce_max_layers(self) -> list[int]:
        """--max-layers: merge the oldest layers above the base into it
        (their snapshots are discarded), so undo back to the base is kept."""
        merged = []
        limit = self.store.limits().get("max_layers")
        while limit and len(self.store.layers()) - 1 > limit:
            merged.append(self.stack.merge_into_base())
            await self._carry_out()
        return merged

    # -- group operations (see Stack: the pending record) -----------------------------

    async def _apply(self, do: str, name: str, layer: int, data: dict) -> dict | None:
        """Restore or discard one provider snapshot; a restore may return a
        post-mortem."""
        provider = self.registry.get(name)
        ctx = self.registry.context(name, layer)
        if do == "restore":
            return await self._blocking(provider.restore, ctx, data)
        await self._blocking(provider.discard, ctx, data)
        self.registry.drop_state(ctx)
        return None

    async def _provider_steps(self, do: str) -> list[str]:
        """Run the pending record's *do* steps that have not finished, each
        marked in the store before it runs and after it; return what ran."""
        ran = []
        for i, step in enumerate(self.stack.pending().get("steps", [])):
            if step["do"] != do or step["state"] in FINISHED:
                continue
            what = f"{do} {step['provider']} of layer {step['layer']}"
            ran.append(what + (" (again: it was interrupted)" if step["state"] == "started"
                               else ""))
            self.stack.mark_step(i, state="started")
            t0 = time.perf_counter()
            try:
                postmortem = await self._apply(do, step["provider"], step["layer"], step["data"])
                result = {"state": "done"}
            except Exception as e:
                postmortem = getattr(e, "postmortem", None)
                result = {"state": "failed", "error": f"{what}: {e}"}
            if postmortem:  # kept (with the layer the workspace is back at) even on failure
                result["postmortem"] = {**postmortem, "layer": step["layer"], "time": time.time()}
            self.stack.mark_step(i, seconds=round(time.perf_counter() - t0, 3), **result)
        return ran

    async def _carry_out(self) -> tuple[dict | None, RollbackReport | None, list[str]]:
        """Carry out the pending group operation from where it stands:
        provider restores, the files, provider discards.  Returns the closed
        pending record, the file rollback's report (when it ran now) and the
        provider steps that ran now."""
        if self.stack.pending() is None:
            return None, None, []
        ran = await self._provider_steps("restore")
        report = None
        pending = self.stack.pending()
        if files_left(pending):
            before = self.store.top()
            try:
                report = self.stack.apply_files()
            finally:
                if self.fs is not None:
                    # a rollback of every layer opens a fresh base, one that
                    # keeps what a redo needs a segment: memory knows all
                    # they hold (nothing); a redo's layers are known from the
                    # store
                    top = self.store.top()
                    self._switched(fresh=pending["op"] == "rollback" and top is not None
                                   and before is not None and (
                                       top.id > before.id or
                                       redo.segment(self.store) is not None), undo=True)
            if self.fs is not None:
                invalid = self.fs.after_undo(report.touched)
                self.fs.layer_switched(after_undo=True)
                await self._invalidate(*invalid)
        ran += await self._provider_steps("discard")
        return self.stack.finish(), report, ran

    def _switched(self, fresh: bool, undo: bool = False) -> None:
        """The open layer changed: the recorder follows it (*fresh*: opened
        by this process), and files written through passthrough are
        captured whole in it (after an *undo*, the caller does that once the
        inode table knows where the undo put everything)."""
        self.recorder.reset(fresh=fresh)
        if self.fs is not None and not undo:
            self.fs.layer_switched()

    def _give_back_redo(self) -> bool:
        """A change found no room (--max-store, a full disk) while the last
        rollback still holds what a redo needs: that goes (the change is
        tried again).  False when nothing was held."""
        st = redo.state(self.store)
        if st is None or (st["state"] != redo.READY and st.get("segment") is None):
            return False
        self.recorder.flush()
        self.stack.discard_redo("the store needed the room it held for a change made since",
                                fallback=True)
        self.recorder.reset(fresh=False)
        return True

    async def _resume(self) -> list[str]:
        """Finish the group operation a crash interrupted (at mount, before
        serving); the warnings that say what was done."""
        op = self.stack.pending().get("op", "operation")
        record, report, ran = await self._carry_out()
        warnings = []
        if report is not None:
            warnings.append(f"finished an interrupted {op} ({count(report.applied, 'step')}"
                            + (f", {len(report.failures)} failed" if report.failures else "")
                            + ")")
            warnings += report.failures
        if ran:
            warnings.append(f"finished the provider work of an interrupted {op}: "
                            + ", ".join(ran))
        return warnings + step_failures(record)

    async def _finish_leftover(self) -> None:
        """A group operation left pending by an unexpected error is carried
        out before a new one is planned over it."""
        if self.stack.pending() is not None:
            record, report, _ = await self._carry_out()
            log.warning("finished a pending %s: %s", record.get("op"),
                        step_failures(record) + (report.failures if report else []))

    async def op_commit(self) -> dict:
        await self._flush()
        await self._finish_leftover()
        kept = self._audit_changes(self.store.top().id, hashes=self._audit_level() == "hashes")
        info = self.stack.commit()
        self.store.audit_many([{"event": "commit", "layer": info["committed"],
                                "into": info["into"], "changes": len(kept)}]
                              + [c | {"layer": info["committed"]} for c in kept])
        self._switched(fresh=info["into"] is None)
        freed = info.pop("freed", [])
        if self.fs is not None:
            self.fs.after_commit(freed)
        # The merged (or now permanent) layer's snapshots are no longer needed:
        # a rollback goes back to the older snapshots of the layer below.  The
        # commit recorded their discards as pending; carry them out.
        record, _, _ = await self._carry_out()
        failures = step_failures(record)
        if failures:
            info["warnings"] = failures
        return info

    async def op_rollback(self, to: int | None = None, keep_redo: bool = True,
                          yes: bool = False) -> dict:
        """Roll back the top layer, or down to and including layer *to*.  A
        rollback of the top layer when it is the base layer (everything
        since the mount) is refused unless *yes* (naming it with *to* is
        explicit enough)."""
        await self._flush()
        await self._finish_leftover()
        # An unknown id, or nothing to roll back, fails before anything runs.
        self.stack.plan_rollback(to, keep_redo=keep_redo, base=yes)
        undone = self._audit_changes(self.stack.pending()["to"], hashes=False)
        # Providers first (they were taken after their layer was opened), last
        # first; then the files; then the dropped snapshots are discarded.
        record, report, _ = await self._carry_out()
        steps = record["steps"]
        result = report.to_dict()
        result["restored"] = [{"provider": s["provider"], "layer": s["layer"],
                               "seconds": s["seconds"]}
                              for s in steps if s["do"] == "restore" and s["state"] == "done"]
        # (kept with the layer the workspace is back at)
        result["postmortems"] = [s["postmortem"] for s in steps if s.get("postmortem")]
        failures = report.failures + step_failures(record)
        self.store.audit_many([{"event": "rollback", "layer": result["top"],
                                "dropped": result["dropped"], "failures": failures}]
                              + [c | {"undone": True} for c in undone])
        if failures:
            raise errors.PartialFailure(
                "rollback finished with failures:\n  " + "\n  ".join(failures))
        return result

    async def op_redo(self) -> dict:
        """Undo the last rollback, exactly, if nothing changed since;
        otherwise say why not and change nothing."""
        await self._flush()
        await self._finish_leftover()
        st = self.stack.plan_redo()
        _, report, _ = await self._carry_out()
        result = report.to_dict()
        redone = self._audit_changes(st["to"], hashes=False)
        self.store.audit_many([{"event": "redo", "layer": result["top"],
                                "restored": result["restored"], "failures": report.failures}]
                              + [c | {"redone": True} for c in redone])
        if report.failures:
            raise errors.PartialFailure(
                "redo finished with failures:\n  " + "\n  ".join(report.failures))
        return result

    async def op_provider_add(self, name: str, type: str, capture: str = "",
                              restore: str = "", discard: str = "",
                              container: str = "", domain: str = "",
                              diagnostics: str = "", health: str = "") -> dict:
        if type == "docker":
            config = {"type": type, "container": container}
        elif type == "libvirt":
            config = {"type": type, "domain": domain, "diagnostics": diagnostics,
                      "health": health}
        else:
            config = {"type": type, "capture": capture, "restore": restore, "discard": discard}
        self.registry.add(name, config)
        return {"name": name}

    async def op_provider_remove(self, name: str) -> dict:
        in_use = [layer.id for layer in self.store.layers()
                  if any(s["provider"] == name for s in layer.snapshots)]
        if in_use:
            raise CowfsError(f"provider {name!r} has snapshots in layers "
                             f"{', '.join(map(str, in_use))}; roll back or commit them first",
                             errors.USAGE)
        self.registry.remove(name)
        return {"name": name}

    async def op_provider_list(self) -> dict:
        return {"providers": [{"name": n, **c} for n, c in self.registry.configs().items()]}

    async def op_status(self, paths: list | None = None) -> dict:
        """The open layer's net changes (under *paths*), the store's usage,
        the changes --max-store refused since the mount, the redo note."""
        await self._flush()
        refused = self.fs.refused if self.fs is not None and self.fs.refused["count"] else None
        return self.stack.status(paths=path_list(paths)) | {
            "usage": self.stack.usage(), "refused": refused, "redo": self.stack.redo_note(),
            "engine": self.engine_info()}

    async def op_gc(self) -> dict:
        """Free what nothing needs: unused chunks, grave files no record
        holds, stale index entries; report what was freed."""
        await self._flush()
        result = self.stack.gc()
        self.recorder.reset(fresh=False)
        return result

    async def op_changes(self, since: int | None = None, paths: list | None = None) -> dict:
        """Net changes since layer *since* was opened (default: the top),
        under *paths* if given."""
        await self._flush()
        top = self.store.top()
        since = top.id if since is None else since
        return {"since": since, "changes": self.stack.changes_since(since, path_list(paths))}

    # -- reading the past (cowfs/past.py) ---------------------------------------------

    def _history(self, layer: int | None) -> History:
        """The history since *layer* (default: the open layer) was opened,
        kept while the store does not change."""
        top = self.store.top()
        layer = top.id if layer is None else layer
        key = (layer, self.store._next_seq, tuple(x.id for x in self.store.layers()))
        cached = self._history_cache
        if cached is None or cached[0] != key:
            cached = (key, History(self.store, self.stack.resolver, layer, self.hidden))
            self._history_cache = cached
        return cached[1]

    async def op_show(self, layer: int | None = None, path: str = "", offset: int = 0,
                      size: int = SHOW_PAGE, missing_ok: bool = False) -> dict:
        """What *path* was when *layer* was opened: its status, and a page of
        its bytes (base64), its symlink target or its directory entries."""
        await self._flush()
        h = self._history(layer)
        obj = h.need(wpath(path)) if not missing_ok else h.object_at(wpath(path))
        if obj is None:
            return {"path": path, "kind": None, "layer": h.layer}
        return describe_past(h, obj, offset, max(0, min(size, SHOW_PAGE))) | {"layer": h.layer}

    async def op_diff(self, since: int | None = None, paths: list | None = None,
                      text_limit: int = 8 << 20) -> dict:
        """Changes since layer *since* was opened, each with both sides'
        sizes and hashes and, for text, a unified diff."""
        await self._flush()
        h = self._history(since)
        changes = self.stack.changes_since(h.layer, path_list(paths))
        return {"since": h.layer, "changes": [diff_entry(h, c, text_limit) for c in changes]}

    async def op_view(self, layer: int, mountpoint: str) -> dict:
        """`cowfs view`: mount the tree as it was when *layer* was opened,
        read-only, at *mountpoint*, in a process of its own."""
        self.store.get_layer(layer)
        await self._flush()
        if self.fs is None:   # offline, in the command itself: Ctrl-C must reach the wait
            return start_view(self.rootfd, self.store.dirfd, layer, mountpoint, self.hidden)
        return await self._blocking(
            start_view, self.rootfd, self.store.dirfd, layer, mountpoint, self.hidden)

    def _audit_level(self) -> str:
        return self.store.limits().get("audit") or "hashes"

    def _audit_changes(self, since: int, hashes: bool) -> list[dict]:
        """Change events for what changed since layer *since* opened: path,
        kind, writer and, with *hashes*, both sides' sizes and xxh3 (files
        up to AUDIT_HASH_LIMIT; larger ones get sizes only).  None at audit
        level "events"."""
        if self._audit_level() == "events":
            return []
        try:
            if not hashes:
                return [{"event": "change", **c} for c in self.stack.changes_since(since)]
            h = History(self.store, self.stack.resolver, since, self.hidden)
            out = []
            for c in self.stack.changes_since(since):
                d = diff_entry(h, c, text_limit=0, hash_limit=AUDIT_HASH_LIMIT)
                out.append({"event": "change", "path": d["path"], "kind": d["kind"],
                            "from": d.get("from"), "who": d.get("who"),
                            "before": d.get("old"), "after": d.get("new")})
            return out
        except Exception:
            log.exception("audit: could not list the changes of layer %s", since)
            return []

    async def op_audit(self, after: int = 0, since_layer: int | None = None,
                       limit: int = 10000) -> dict:
        """Audit events after number *after* (or from layer *since_layer*'s
        checkpoint on), at most *limit*."""
        if since_layer is not None and not self.store.layer_existed(since_layer):
            raise errors.UnknownLayer(f"no layer {since_layer} (layers so far: 1 to "
                                      f"{self.store.last_layer_id()})")
        events = []
        started = since_layer is None
        for e in self.store.audit_events(after):
            if not started:
                started = e.get("event") == "checkpoint" and e.get("layer") == since_layer \
                    or (e.get("layer") or 0) >= since_layer
                if not started:
                    continue
            events.append(e)
            if len(events) >= limit:
                break
        return {"events": events}

    async def op_audit_prune(self, days: float) -> dict:
        """Drop audit events older than *days* (the audit's own retention)."""
        if days < 0:
            raise CowfsError("bad request: days must not be negative", errors.USAGE)
        return {"pruned": self.store.prune_audit(time.time() - days * 86400)}

    async def op_audit_note(self, event: str, fields: dict) -> dict:
        """An event a client carried out through the mount (restore)."""
        if event not in ("restore",) or len(json.dumps(fields)) > 1 << 20:
            raise CowfsError("bad request: unknown audit event", errors.USAGE)
        self.store.audit(event, layer=self.store.top().id, **fields)
        return {}

    async def op_annotate(self, layer: int, run: dict) -> dict:
        """Record a `cowfs run` step on a layer."""
        required = {"command": str, "outcome": str, "exit_status": int}
        for key, kind in required.items():
            if not isinstance(run.get(key), kind) or isinstance(run.get(key), bool):
                raise CowfsError(f"bad request: a run record needs {key!r} ({kind.__name__})",
                                 errors.USAGE)
        if len(json.dumps(run)) > 64 << 10:
            raise CowfsError("bad request: the run record is too large", errors.USAGE)
        self.store.get_layer(layer)
        self.store.append_to_layer(layer, "runs", [run])
        return {"layer": layer}

    async def op_check(self, full: bool = False) -> dict:
        """The stack's quick consistency check, or with *full* `cowfs check`
        (chunk hashes too).  Both run on the trio thread: the file system's
        handlers wait, so the store cannot change while it is read."""
        await self._flush()
        if not full:
            return {"problems": self.stack.check()}
        return fsck.check(self.store).to_dict()

    async def op_repair(self) -> dict:
        """`cowfs check --repair`: check, repair what can be repaired without
        inventing data, check again (with the handlers waiting throughout)."""
        await self._flush()
        done = fsck.repair(self.store, fsck.check(self.store), self.stack.discard_redo)
        self.recorder.reset(fresh=False)
        return {"repaired": done, **fsck.check(self.store).to_dict()}

    async def op_log(self, limit: int | None = None) -> dict:
        """The layers, oldest first (with *limit*: that many of the newest)."""
        await self._flush()
        if limit is not None and limit < 1:
            raise CowfsError("bad request: limit must be positive", errors.USAGE)
        return {"layers": self.stack.log(limit), "redo": self.stack.redo_note()}

    async def op_unmount(self, lazy: bool = False) -> dict:
        """Unmount; the daemon then exits.  *lazy*: detach the mount even
        while processes use it (umount -l); the daemon goes on serving
        them, and exits when the kernel lets the mount go after the last
        one.  The answer names them ("users"; "pid": this daemon)."""
        await self._flush()
        self.store.sync()
        ours = [m for m in mounts()     # (not in the table any more once detached)
                if m.mountpoint == self.mountpoint and m.fstype == FSTYPE]
        try:
            await self._blocking(unmount, self.mountpoint, lazy)
        except OSError as e:
            if e.errno == errno.EBUSY:
                users = await self._blocking(mount_users, ours[-1]) if ours else []
                raise AlreadyMounted(
                    f"{self.mountpoint} is busy: "
                    + (f"used by {processes(users)}" if users else
                       "a process has a file or its working directory there")
                    + "; close them, or use --lazy") from None
            raise CowfsError(f"unmount failed: {e.strerror}") from None
        self.unmounted_by_request = True
        sd_notify("STOPPING=1")
        result = {"unmounted": self.mountpoint, "pid": os.getpid()}
        if lazy and ours:
            result["users"] = await self._blocking(mount_users, ours[-1])
            if result["users"]:
                log.info("detached %s; serving the processes still using it until the "
                         "last one leaves: %s", self.mountpoint,
                         ", ".join(map(str, result["users"])))
        return result


def path_list(paths: list | None) -> list[str]:
    """Workspace-relative paths from a request."""
    if not all(isinstance(p, str) for p in paths or ()):
        raise CowfsError("bad request: paths are strings", errors.USAGE)
    return list(paths or ())


def check_agent_record(agent: dict) -> None:
    """An agent record (op_checkpoint) names its agent and event (strings)
    and is small."""
    for key in ("agent", "event"):
        if not isinstance(agent.get(key), str) or not agent[key]:
            raise CowfsError(f"bad request: an agent record needs {key!r} (a string)",
                             errors.USAGE)
    if len(json.dumps(agent)) > 16 << 10:
        raise CowfsError("bad request: the agent record is too large", errors.USAGE)


def within(path: str, top: str) -> bool:
    """*path* is *top* or lies below it (both absolute and normalised)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def already_mounted(rec: MountRecord) -> AlreadyMounted:
    where = "over itself" if rec.mountpoint == rec.workspace else f"at {rec.mountpoint}"
    return AlreadyMounted(f"{rec.workspace} is already mounted {where} (cowfs daemon pid "
                          f"{rec.pid}); 'cowfs unmount {rec.mountpoint}' first")


ENGINES = ("auto", "kernel", "pyfuse3")


def make_engine(choice: str, ops: Ops):
    """The FUSE engine to serve *ops* with: *choice* "kernel", "pyfuse3",
    or "auto" (the kernel engine wherever it can run)."""
    from . import kernel_engine, pyfuse3_engine
    why_not = kernel_engine.available()
    if choice == "kernel":
        if why_not:
            raise NoFuse(f"the kernel engine cannot run here: {why_not}")
        return kernel_engine.Engine(ops, "chosen with --engine kernel")
    if choice == "auto" and not why_not:
        return kernel_engine.Engine(ops, "the default where it can run")
    return pyfuse3_engine.Engine(ops, "chosen with --engine pyfuse3" if choice == "pyfuse3"
                                 else f"the kernel engine cannot run here: {why_not}")


def step_failures(record: dict | None) -> list[str]:
    """The failed provider steps of a closed pending record, by name."""
    return [s["error"] for s in (record or {}).get("steps", ()) if s["state"] == "failed"]


VIEW_MODULE = "cowfs.view"
VIEW_TIMEOUT = 60.0


def start_view(rootfd: int, store_dirfd: int, layer: int, mountpoint: str,
               hidden: bytes | None) -> dict:
    """Start the view process (cowfs/view.py) with the workspace root and
    the store as open fds; return once its mount is live.  A directory
    that is a mount point already is refused; if the start fails in any
    way, nothing of the view is left (process or mount)."""
    mp = os.path.realpath(mountpoint)
    there = mount_table().get(mp)
    if there == VIEW_FSTYPE:
        raise AlreadyMounted(f"a cowfs view is already mounted at {mp}; 'cowfs unmount {mp}' "
                             "ends it")
    if there is not None:
        raise AlreadyMounted(f"{mp} is already a mount point ({there}); a view needs a "
                             "directory of its own")
    if not os.path.isdir(mp):
        raise BadWorkspace(f"view mount point {mountpoint} is not a directory")
    root = os.open(B.proc(rootfd), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    store = os.open(B.proc(store_dirfd), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        args = ["--root-fd", str(root), "--store-fd", str(store), "--layer", str(layer)]
        if hidden:
            args += ["--hidden", os.fsdecode(hidden)]
        return start_and_wait(VIEW_MODULE, args + [mp], (root, store), VIEW_TIMEOUT,
                              f"mounting the view at {mp}",
                              abandon=functools.partial(abandon_view, mp))
    finally:
        os.close(root)
        os.close(store)


def abandon_view(mountpoint: str, proc: subprocess.Popen) -> None:
    """A view process whose start failed: kill it and clear the mount it
    may have left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    clear_view(mountpoint)


def clear_view(mountpoint: str) -> None:
    """Detach the view mounted at *mountpoint* (its process, if it still
    runs, ends once nothing uses the mount).  start_view made sure nothing
    else was mounted there."""
    for _ in range(8):
        if mount_table().get(mountpoint) != VIEW_FSTYPE:
            return
        try:
            unmount(mountpoint, lazy=True)
        except OSError as e:
            log.error("cannot clear the view at %s: %s", mountpoint, e.strerror)
            return


TREE_OPS = ("rollback", "commit", "redo")   # refused on drift; the drift record follows them


def offline(workspace: str, store: str | None, op: str, **args) -> dict:
    """Run control operation *op* on the store of an unmounted workspace;
    the result carries the warnings of opening it (a resumed rollback, a
    cleared dead mount) in "warnings"."""
    daemon = Daemon(workspace, store=store)
    daemon.open_offline()
    try:
        if op in TREE_OPS:
            recorded = daemon.store.get_meta_json(S.K_DRIFT)
            drift = daemon.stack.drift(recorded) if recorded else []
            if drift:
                raise Drift(f"{', '.join(drift[:10])}: changed while not mounted, after the "
                            "layers changed them; mount with --accept-drift first")
        try:
            result = trio.run(functools.partial(getattr(daemon, "op_" + op), **args))
        finally:  # what a rollback or commit changed (also when it partly failed)
            if op in TREE_OPS and daemon.store.get_meta_json(S.K_DRIFT):
                daemon.record_fingerprint()
    finally:
        daemon.close_offline()
    result["warnings"] = daemon.warnings + result.get("warnings", [])
    result["mounted"] = False
    return result


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
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


MOUNT_OPTIONS = ("chunk_size", "max_store", "max_layers")


def serve(workspace: str, mountpoint: str | None, store: str | None,
          report: Callable[[dict], None], foreground: bool, **options) -> int:
    """Prepare, mount and serve until unmounted.  *report* is called once,
    with {"ok": True, "warnings": [...]} when the mount is live, or with the
    error that prevented it.  *options*: MOUNT_OPTIONS."""
    daemon = Daemon(workspace, mountpoint, store, **options)
    try:
        daemon.prepare()
        setup_logging(daemon.store_dir, foreground)
        def ready() -> None:
            report({"ok": True, "warnings": daemon.warnings, "pid": os.getpid(),
                    "mountpoint": daemon.mountpoint})
            sd_notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=mounted {daemon.mountpoint}")

        daemon.mount(ready)
    except CowfsError as e:
        report({"ok": False, **e.to_dict()})
        return e.code
    except OSError as e:
        report({"ok": False, "code": errors.DAEMON_ERROR,
                "error": f"cannot mount {workspace}: {e.strerror or e}"})
        return errors.DAEMON_ERROR
    daemon.run()
    return 0


def spawn(workspace: str, mountpoint: str | None = None, store: str | None = None,
          timeout: float = 120, **options) -> dict:
    """Start a daemon for *workspace* in its own session and wait until the
    mount is live; return its report (warnings, pid) or raise its error."""
    args = []
    if store:
        args += ["--store", os.path.abspath(store)]
    for name, value in options.items():
        if isinstance(value, list):
            for item in value:
                args += [f"--{name.replace('_', '-')}", item]
        elif value is True:
            args.append(f"--{name.replace('_', '-')}")
        elif value is not None and value is not False:
            args += [f"--{name.replace('_', '-')}", str(value)]
    args.append(os.path.abspath(workspace))
    if mountpoint:
        args.append(os.path.abspath(mountpoint))
    return start_and_wait("cowfs.daemon", args, (), timeout, f"mounting {workspace}")


def start_and_wait(module: str, args: list[str], pass_fds: tuple, timeout: float,
                   what: str, abandon: Callable[[subprocess.Popen], None] | None = None
                   ) -> dict:
    """Start ``python -m module --ready-fd N args...`` in its own session
    and wait for the one JSON line it reports on N once its mount is live
    (or failed); return it, or raise the error it reported.  If waiting
    fails (no report in time, an unreadable one, an interrupt), *abandon*
    is called with the process and must leave nothing of it behind."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", module, "--ready-fd", str(w), *args],
                                pass_fds=(w, *pass_fds), start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    try:
        msg = read_report(r, proc, timeout, f"the {module} process (pid {proc.pid})", what)
    except BaseException:
        if abandon is not None:
            abandon(proc)
        raise
    finally:
        os.close(r)
    if not msg.get("ok"):
        proc.wait()
        raise errors.from_dict(msg)
    return msg


def read_report(fd: int, proc: subprocess.Popen, timeout: float, who: str, what: str) -> dict:
    """The one JSON object *proc* writes on *fd*, within *timeout* seconds."""
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        if not wait_readable(fd, deadline - time.monotonic()):
            raise CowfsError(f"{who} did not report within {timeout:.0f} s while {what}",
                             errors.DAEMON_ERROR)
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
    if not buf:
        try:
            status = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = "still running"
        raise CowfsError(f"{who} exited ({status}) without {what}", errors.DAEMON_ERROR)
    try:
        msg = json.loads(buf)
    except ValueError:
        msg = None
    if not isinstance(msg, dict):
        raise CowfsError(f"{who} sent an unreadable report while {what}: {buf[:60]!r}",
                         errors.DAEMON_ERROR)
    return msg


def detach(ready_fd: int) -> Callable[[dict], None]:
    """For a process started by start_and_wait: stdio to /dev/null, and the
    function that reports (once) on *ready_fd*."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)

    def report(msg: dict) -> None:
        try:
            os.write(ready_fd, json.dumps(msg).encode() + b"\n")
            os.close(ready_fd)
        except OSError:
            pass
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cowfs-daemon")
    p.add_argument("--ready-fd", type=int, required=True)
    p.add_argument("--store")
    for name in MOUNT_OPTIONS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int)
    p.add_argument("--accept-drift", action="store_true")
    p.add_argument("--ignore", action="append")
    p.add_argument("--audit", choices=AUDIT_LEVELS)
    p.add_argument("--engine", choices=ENGINES)
    p.add_argument("workspace")
    p.add_argument("mountpoint", nargs="?")
    a = p.parse_args(argv)
    return serve(a.workspace, a.mountpoint, a.store, detach(a.ready_fd), foreground=False,
                 accept_drift=a.accept_drift, ignore=a.ignore, audit=a.audit,
                 engine=a.engine, **{name: getattr(a, name) for name in MOUNT_OPTIONS})


if __name__ == "__main__":
    sys.exit(main())
