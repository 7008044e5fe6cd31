"""Starting a view or a daemon without starting Python: a process that has
imported what they run (the zygote) makes each as a fork of itself.

A workspace's daemon starts its zygote at its first fork (a fork is a view
and a daemon: started as new interpreters they cost about 0.6 s each, most
of it imports; forked from the zygote, milliseconds).  The two talk over a
socket pair no other process can reach: a request names the module and
its arguments and carries the descriptors the new process gets, at the
numbers the requester gave them; the answer carries a pidfd of the new
process.  The new process is what ``python -m MODULE ARGS`` would have
been: a session of its own, its command line saying so, its standard
streams /dev/null (the module's ``detach`` reports as ever).  The zygote
starts no thread; it ends when its daemon does (the socket closes), and
the processes it made live on.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import gc
import importlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading

log = logging.getLogger("cowfs.zygote")

# How a process of cowfs is started as root: -P, no directory of the
# caller's (its working directory: perhaps a workspace another user
# writes) on the module path.
PYTHON = (sys.executable, "-P", "-m")
PRELOAD = ("cowfs.fuse.view", "cowfs.service.daemon")
# (and what they import only once they run)
IMPORTS = (*PRELOAD, "cowfs.fuse.kernel_engine", "cowfs.fuse.pyfuse3_engine")
MAX_FDS = 16
HIGH_FD = 1024  # (received descriptors wait above this while others close)
CMDLINE = 8192  # (room for the command lines of the processes it makes)


def start_detached(argv: list[str], pass_fds: tuple[int, ...]) -> subprocess.Popen:
    """``python -P -m`` *argv* (a module and its arguments) in a session of
    its own, from /, with *pass_fds* and /dev/null for its standard streams."""
    return subprocess.Popen(
        [*PYTHON, *argv],
        pass_fds=pass_fds,
        start_new_session=True,
        cwd="/",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


class Child:
    """A process the zygote made, as ``start_and_wait`` uses a Popen: it is
    not this process's child, so it is followed through a pidfd (its exit
    status is the zygote's to collect: ``returncode`` is "exited")."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self.returncode: int | str | None = None

    def poll(self) -> int | str | None:
        if self.returncode is None and _readable(self._pidfd, 0):
            self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | str:
        if self.returncode is None:
            if not _readable(self._pidfd, timeout):
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            self._ended()
        assert self.returncode is not None
        return self.returncode

    def _ended(self) -> None:
        self.returncode = "exited"
        os.close(self._pidfd)

    def __del__(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)


def _readable(fd: int, timeout: float | None) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(None if timeout is None else max(0, int(timeout * 1000))))


class Zygote:
    """The daemon's side: start the zygote, ask it for processes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the zygote unless it runs (it answers once its imports
        are done: a first request waits for them)."""
        with self._lock:
            if self._sock is not None:
                return
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self._proc = start_detached(
                    [__name__, str(theirs.fileno()), " " * CMDLINE], (theirs.fileno(),)
                )
            except BaseException:
                mine.close()
                raise
            finally:
                theirs.close()
            self._sock = mine

    def spawn(self, module: str, args: list[str], fds: tuple[int, ...]) -> Child | None:
        """``python -m module args`` with *fds* at their numbers, made by
        the zygote; None when there is no zygote to ask (not started, or
        it ended: the caller starts the process itself)."""
        if module not in PRELOAD or len(fds) > MAX_FDS:
            return None
        with self._lock:
            if self._sock is None:
                return None
            request = json.dumps({"module": module, "args": args, "fds": list(fds)}).encode()
            try:
                socket.send_fds(self._sock, [request], list(fds))
                msg, got, _, _ = socket.recv_fds(self._sock, 65536, 1)
            except OSError as e:
                log.warning("the zygote is gone (%s): starting processes afresh", e)
                self._close()
                return None
            if not msg:
                log.warning("the zygote ended: starting processes afresh")
                self._close()
                return None
            answer = json.loads(msg)
            if "pid" not in answer or len(got) != 1:
                for fd in got:
                    os.close(fd)
                raise OSError(answer.get("errno", errno.EIO), answer.get("error", "zygote"))
            return Child(answer["pid"], got[0])

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            self._proc = None

    def stop(self) -> None:
        with self._lock:
            self._close()


# the zygote of this process (a daemon's), once started
ZYGOTE = Zygote()


# -- the zygote's side ------------------------------------------------------


def serve(sock: socket.socket) -> None:
    os.chdir("/")
    for name in IMPORTS:
        importlib.import_module(name)
    # (what is here now is never collected: a child's collector leaves the
    # pages it shares with the zygote unwritten)
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGCHLD, lambda *_: _reap())
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 65536, MAX_FDS)
        except ConnectionResetError:
            return
        if not msg:
            return  # (the daemon ended)
        try:
            request = json.loads(msg)
            if request["module"] not in PRELOAD or len(request["fds"]) != len(fds):
                raise OSError(errno.EINVAL, "a request the zygote does not take")
            pid, pidfd = _fork(sock, request, fds)
        except OSError as e:
            sock.send(json.dumps({"error": str(e), "errno": e.errno or errno.EIO}).encode())
            continue
        finally:
            for fd in fds:
                os.close(fd)
        try:
            socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [pidfd])
        finally:
            os.close(pidfd)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _fork(sock: socket.socket, request: dict, fds: list[int]) -> tuple[int, int]:
    # (no child is reaped before its pidfd is open)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        pid = os.fork()
        if pid == 0:
            _child(sock, request, fds)  # (never returns)
        return pid, os.pidfd_open(pid)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})


def _child(sock: socket.socket, request: dict, fds: list[int]) -> None:
    code = 1
    try:
        sock.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.setsid()
        # the descriptors at the numbers the requester gave, nothing else
        # open: each first copied above every number involved, the rest closed
        wanted = request["fds"]
        base = max(HIGH_FD, *(n + 1 for n in wanted), *(fd + 1 for fd in fds))
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, base) for fd in fds]
        os.closerange(3, base)
        os.closerange(max(high) + 1, os.sysconf("SC_OPEN_MAX"))
        for fd, want in zip(high, wanted, strict=True):
            os.dup2(fd, want)
        for fd in high:
            os.close(fd)
        module, args = request["module"], request["args"]
        _set_cmdline([*PYTHON, module, *args])
        sys.argv = [module, *args]
        code = importlib.import_module(module).main(args)
        logging.shutdown()
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        code = 1
    finally:
        os._exit(code or 0)


def _set_cmdline(argv: list[str]) -> None:
    """What /proc/PID/cmdline (ps, pgrep) shows: *argv*, as if started so
    (written over the zygote's own, which a blank argument makes long
    enough; the rest of it NUL bytes)."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])
    raw = b"\0".join(os.fsencode(a) for a in argv)[: end - start - 1]
    ctypes.memmove(start, raw.ljust(end - start, b"\0"), end - start)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
