"""Starting a cowfs process that mounts something (the daemon, a view) and
waiting for the one line it reports once its mount is live; the child's
side of that report (``detach``); and the read-only views of the past
(`cowfs view`), each in a process of its own."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from . import backing as B
from . import errors
from .control import wait_readable
from .errors import AlreadyMounted, BadWorkspace, CowfsError
from .mounts import VIEW_FSTYPE, mount_table, unmount

log = logging.getLogger("cowfs.launch")


VIEW_MODULE = "cowfs.view"
VIEW_TIMEOUT = 60.0


def start_view(
    rootfd: int, store_dirfd: int, layer: int, mountpoint: str, hidden: bytes | None
) -> dict:
    """Start the view process (cowfs/view.py) with the workspace root and
    the store as open fds; return once its mount is live.  A directory
    that is a mount point already is refused; if the start fails in any
    way, nothing of the view is left (process or mount)."""
    mp = os.path.realpath(mountpoint)
    there = mount_table().get(mp)
    if there == VIEW_FSTYPE:
        raise AlreadyMounted(
            f"a cowfs view is already mounted at {mp}; 'cowfs unmount {mp}' ends it"
        )
    if there is not None:
        raise AlreadyMounted(
            f"{mp} is already a mount point ({there}); a view needs a directory of its own"
        )
    if not os.path.isdir(mp):
        raise BadWorkspace(f"view mount point {mountpoint} is not a directory")
    root = os.open(B.proc(rootfd), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    store = os.open(B.proc(store_dirfd), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        args = ["--root-fd", str(root), "--store-fd", str(store), "--layer", str(layer)]
        if hidden:
            args += ["--hidden", os.fsdecode(hidden)]
        return start_and_wait(
            VIEW_MODULE,
            args + [mp],
            (root, store),
            VIEW_TIMEOUT,
            f"mounting the view at {mp}",
            abandon=functools.partial(abandon_view, mp),
        )
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


def start_and_wait(
    module: str,
    args: list[str],
    pass_fds: tuple,
    timeout: float,
    what: str,
    abandon: Callable[[subprocess.Popen], None] | None = None,
) -> dict:
    """Start ``python -m module --ready-fd N args...`` in its own session
    and wait for the one JSON line it reports on N once its mount is live
    (or failed); return it, or raise the error it reported.  If waiting
    fails (no report in time, an unreadable one, an interrupt), *abandon*
    is called with the process and must leave nothing of it behind."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--ready-fd", str(w), *args],
            pass_fds=(w, *pass_fds),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
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
            raise CowfsError(
                f"{who} did not report within {timeout:.0f} s while {what}", errors.DAEMON_ERROR
            )
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
    if not buf:
        status: int | str
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
        raise CowfsError(
            f"{who} sent an unreadable report while {what}: {buf[:60]!r}", errors.DAEMON_ERROR
        )
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
