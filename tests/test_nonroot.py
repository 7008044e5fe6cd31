"""A user other than root mounts a workspace, on either engine: the kernel
engine mounts through fusermount3's descriptor passing (as libfuse does
for pyfuse3), serves without passthrough (which needs CAP_SYS_ADMIN), and
unmounts with fusermount3 -u; checkpoint, status and an exact rollback
work as for root.

Everything the user does runs in a child forked from this process and
switched to the user (tests/users.py).  On a stock Debian /dev/fuse is 0666; where it is not
(a container's device node), the test makes it so while it runs."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import cowfs
from cowfs.layers import treesnap
from cowfs.service import daemon
from cowfs.system.mounts import mounts

from . import users

USER = pwd.getpwnam("nobody")  # fusermount3 wants a user name for the uid


def preload() -> None:
    """Import every module of cowfs here, so that a child switched to the
    user needs to read none."""
    for info in pkgutil.walk_packages(cowfs.__path__, "cowfs."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:  # an optional extra that is not installed
            pass
    import lmdb  # noqa: E401,F401


def as_user(fn: Callable[..., Any], *args: Any) -> Any:
    return users.run_as(USER.pw_uid, USER.pw_gid, fn, *args)


def cowfs_cmd(cwd: str, *args: str) -> tuple[int, str, str]:
    return users.cowfs_as(USER.pw_uid, USER.pw_gid, cwd, list(args))


def shell(script: str, cwd: str) -> None:
    """A shell script run by the user (real programs on the mount)."""
    r = subprocess.run(
        [
            "setpriv",
            f"--reuid={USER.pw_uid}",
            f"--regid={USER.pw_gid}",
            "--clear-groups",
            "sh",
            "-ec",
            'cd "$1"; ' + script,
            "sh",
            cwd,
        ],
        cwd="/",  # (root may not enter the user's mount)
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": "/"},
    )
    assert r.returncode == 0, r.stderr


@pytest.fixture
def fuse_for_users(fuse):
    mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    if mode & 0o006 != 0o006:
        os.chmod("/dev/fuse", mode | 0o666)
    try:
        yield
    finally:
        os.chmod("/dev/fuse", mode)


class UserMount:
    """A workspace of the user's, mounted by a daemon running as the user."""

    def __init__(self, base: Path, engine: str):
        self.path = str(base / "ws")
        self.engine = engine
        self.pid = 0

    def start(self) -> dict:
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the daemon
            code = 99
            try:
                os.close(r)
                os.setsid()
                users.become(USER.pw_uid, USER.pw_gid)
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)

                def report(msg: dict) -> None:
                    os.write(w, json.dumps(msg).encode() + b"\n")
                    os.close(w)

                code = daemon.serve(
                    self.path, None, None, report, foreground=False, engine=self.engine
                )
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            return json.loads(f.readline() or b"{}")

    def mounted(self) -> list:
        return [m for m in mounts() if m.mountpoint == self.path]

    def stop(self) -> None:
        """However the test ended: no mount, no daemon."""
        if self.mounted():
            subprocess.run(["umount", "-l", self.path], check=False)
        if self.pid:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                done, _ = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    break
                time.sleep(0.1)
            else:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)


@pytest.fixture(params=["kernel", "pyfuse3"])
def user_mount(request, fuse_for_users):
    preload()
    base = Path(tempfile.mkdtemp(prefix="cowfs-user-"))
    os.chmod(base, 0o755)
    ws = base / "ws"
    ws.mkdir()
    (ws / "dir").mkdir()
    (ws / "a.txt").write_text("alpha\n")
    (ws / "dir" / "b.txt").write_text("beta\n" * 1000)
    os.symlink("a.txt", ws / "link")
    shutil.chown(base / "ws", USER.pw_uid, USER.pw_gid)
    for p in ws.rglob("*"):
        os.lchown(p, USER.pw_uid, USER.pw_gid)
    m = UserMount(base, request.param)
    try:
        yield m
    finally:
        m.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_a_user_mounts_checkpoints_rolls_back_and_unmounts(user_mount):
    m = user_mount
    report = m.start()
    assert report.get("ok"), report
    (entry,) = m.mounted()
    assert entry.fstype == "fuse.cowfs"
    assert f"user_id={USER.pw_uid}" in entry.options.split(","), entry.options
    flags = as_user(lambda: os.statvfs(m.path).f_flag)
    assert flags & os.ST_NOSUID and flags & os.ST_NODEV, flags

    code, out, err = cowfs_cmd(m.path, "--json", "status")
    assert code == 0, err
    engine = json.loads(out)["engine"]
    assert engine["name"] == m.engine
    if m.engine == "kernel":  # a user may not hand the kernel backing files
        assert "passthrough" not in engine["features"], engine

    before = as_user(treesnap.snapshot, m.path)
    assert sorted(before) == [b".", b"a.txt", b"dir", b"dir/b.txt", b"link"]
    code, _, err = cowfs_cmd(m.path, "checkpoint", "-m", "try")
    assert code == 0, err
    shell(
        "echo more >> a.txt; rm dir/b.txt; mkdir -p new/deep; cp a.txt new/deep/c;"
        " mv dir gone; chmod 600 a.txt; ln -sf gone link; tar cf t.tar new",
        m.path,
    )
    code, out, err = cowfs_cmd(m.path, "--json", "status")
    assert code == 0, err
    kinds = {c["path"]: c["kind"] for c in json.loads(out)["changes"]}
    assert kinds["a.txt"] == "M" and kinds["t.tar"] == "A" and kinds["gone"] == "R", kinds

    code, _, err = cowfs_cmd(m.path, "rollback")
    assert code == 0, err
    treesnap.assert_same(before, as_user(treesnap.snapshot, m.path))

    code, out, err = cowfs_cmd("/", "unmount", m.path)
    assert code == 0, err
    assert not m.mounted()
    _, status = os.waitpid(m.pid, 0)
    m.pid = 0
    assert os.waitstatus_to_exitcode(status) == 0
    after = treesnap.snapshot(m.path)  # the directory itself, as it was
    treesnap.assert_same(before, after)
    assert os.stat(Path(m.path) / ".cowfs").st_uid == USER.pw_uid
