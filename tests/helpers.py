"""Helpers the tests share (the fixtures are in conftest.py): the real
``cowfs`` command, a workspace and its mount, process lookups."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from cowfs.layers import treesnap
from cowfs.system.mounts import MountRecord, is_cowfs_mount, pid_alive

COWFS = [sys.executable, "-m", "cowfs"]


def run(*args, check: bool = True) -> subprocess.CompletedProcess:
    """Run the real ``cowfs`` command."""
    cmd = [*COWFS, *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if check and r.returncode != 0:
        raise AssertionError(f"cowfs {' '.join(cmd[3:])} exited {r.returncode}: {r.stderr.strip()}")
    return r


class Workspace:
    """A workspace directory and its (optional) cowfs mount over itself."""

    def __init__(self, path: Path):
        self.path = path
        self.mounted = False
        self.store: Path | None = None  # given with mount --store (where daemon.log is)

    def __truediv__(self, other) -> Path:
        return self.path / other

    def mount(self, *extra) -> None:
        run("mount", *extra, self.path)
        assert is_cowfs_mount(str(self.path))
        self.mounted = True

    def unmount(self) -> None:
        run("unmount", self.path)
        self.mounted = False
        assert not is_cowfs_mount(str(self.path))

    def cowfs(self, *args, check=True) -> subprocess.CompletedProcess:
        return run("-C", self.path, *args, check=check)

    def json(self, *args):
        return json.loads(self.cowfs("--json", *args).stdout)

    def checkpoint(self, message: str = "") -> int:
        return self.json("checkpoint", "-m", message)["id"]

    def rollback(self, to: int | None = None) -> dict:
        """(--yes: the base layer too, as the tests mean it)"""
        return self.json("rollback", "--yes", *(["--to", to] if to is not None else []))

    def commit(self) -> dict:
        return self.json("commit")

    def status(self) -> list[dict]:
        return self.json("status")["changes"]

    def log(self) -> list[dict]:
        return self.json("log")

    def snapshot(self, **kw) -> treesnap.Snapshot:
        return treesnap.snapshot(self.path, **kw)

    def daemon_pid(self) -> int | None:
        rec = MountRecord.load(str(self.path))
        return rec.pid if rec else None

    def kill(self) -> None:
        """kill -9 the daemon (the mount stays behind, dead)."""
        pid = self.daemon_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while pid_alive(pid):
            assert time.monotonic() < deadline, f"the daemon {pid} outlived kill -9"
            time.sleep(0.01)

    def teardown(self) -> None:
        pid = self.daemon_pid()
        if is_cowfs_mount(str(self.path)):
            try:
                # (a daemon held up -- say in a provider's restore that a
                # failed test never lets finish -- is killed below)
                ok = (
                    subprocess.run(
                        [*COWFS, "unmount", "--lazy", str(self.path)],
                        capture_output=True,
                        timeout=60,
                    ).returncode
                    == 0
                )
            except subprocess.TimeoutExpired:
                ok = False
            if not ok or is_cowfs_mount(str(self.path)):
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
        if pid is not None and pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        rec = MountRecord.load(str(self.path))
        if rec is not None:
            rec.remove()
        self.mounted = False

    def daemon_errors(self) -> list[str]:
        """Errors the daemon logged (a handler that failed unexpectedly
        answers EIO and logs it): a test fails on any it did not expect."""
        log = (self.store or self.path / ".cowfs") / "daemon.log"
        if self.mounted or not log.exists():
            return []
        return [
            line
            for line in log.read_text(errors="replace").splitlines()
            if " ERROR " in line or "Traceback" in line
        ]


def helper_of(ws: Workspace) -> int:
    """The pid of the daemon's helper process (its only child)."""
    pid = ws.daemon_pid()
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    assert len(children) == 1, children
    return children[0]


def backing_dir(where: Workspace | Path) -> Path:
    """The daemon's fd on the root of the workspace mounted at *where*, as
    a path that reaches the backing directory underneath the mount (to see
    what the kernel's attribute cache would hide; root reads it)."""
    path = where.path if isinstance(where, Workspace) else where
    rec = MountRecord.load(str(path))
    if rec is None:
        raise AssertionError(f"{path} is not mounted")
    for fd in Path(f"/proc/{rec.pid}/fd").iterdir():
        try:
            if os.readlink(fd) == str(path):
                return fd
        except FileNotFoundError:  # closed meanwhile (the daemon is running)
            continue
    raise AssertionError("the daemon holds no fd on the workspace root")


def plain(changes: list[dict]) -> list[dict]:
    """Changes without who made them (for comparing paths and kinds)."""
    return [{k: v for k, v in c.items() if k != "who"} for c in changes]


@contextlib.contextmanager
def managed_workspace(path: Path) -> Iterator[Workspace]:
    """A new, empty workspace directory that is always unmounted (and its
    daemon killed) afterwards; fails if the daemon logged errors."""
    ws = Workspace(path)
    ws.path.mkdir()
    try:
        yield ws
    finally:
        ws.teardown()
    errors = ws.daemon_errors()
    assert not errors, f"the daemon of {path} logged errors:\n" + "\n".join(errors)


@contextlib.contextmanager
def reachable_workspace(prefix: str) -> Iterator[Workspace]:
    """A ``managed_workspace`` (not mounted) in a new directory every user
    can reach (it and the workspace mode 0755), for tests in which another
    user works in it; removed afterwards (no mount followed)."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(base, 0o755)
    try:
        with managed_workspace(base / "ws") as ws:
            os.chmod(ws.path, 0o755)
            yield ws
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


# what a fork's overlay (and a container runtime's, in part) is mounted with
OVERLAY_OPTIONS = "index=on,redirect_dir=on,metacopy=on,xino=on"


def mount(*args: str) -> None:
    """mount(8) with *args*."""
    subprocess.run(["mount", *args], check=True, capture_output=True)


def unmount_all(path: Path) -> None:
    """Unmount whatever is mounted at *path* (lazily, each mount stacked there)."""
    for _ in range(4):  # (stacked mounts come off one at a time)
        if subprocess.run(["mountpoint", "-q", str(path)]).returncode != 0:
            return
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


class Overlay:
    """An overlay mounted at *merged* over *lower* (frozen), with a private
    upper; ``unmount`` and ``mount`` again give it a new device number
    where another mount took its old one meanwhile."""

    def __init__(self, base: Path, lower: Path):
        self.lower = lower  # (not written while mounted)
        self.upper = base / "upper"
        self.work = base / "work"
        self.merged = base / "merged"
        for d in (self.upper, self.work, self.merged):
            d.mkdir()

    def mount(self) -> None:
        opts = f"lowerdir={self.lower},upperdir={self.upper},workdir={self.work},{OVERLAY_OPTIONS}"
        mount("-t", "overlay", "cowfs-test", "-o", opts, str(self.merged))

    def unmount(self) -> None:
        unmount_all(self.merged)


def view_processes(where: Path) -> list[int]:
    """Pids of the view processes (``python -m ...view``) started for the
    directory *where*."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        module = argv[argv.index(b"-m") + 1 : argv.index(b"-m") + 2] if b"-m" in argv else []
        if module and module[0].endswith(b"view") and os.fsencode(where) in argv:
            found.append(int(pid))
    return found
