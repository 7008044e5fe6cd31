"""Forks against what could take their fork point or their mounts away:
a commit of a base layer that holds a fork's records, ``--at`` a mount
point, ``--at`` a path that is not the directory's own name."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cowfs.errors import ALREADY_MOUNTED, REFUSED
from cowfs.layers import treesnap
from cowfs.system.mounts import is_cowfs_mount, mounts, path_key, runtime_dir

from .helpers import COWFS, managed_workspace
from .test_forks import drop_when_unused, fork, fork_mounts, forks_of, parent  # noqa: F401  (the fixture)


def test_a_commit_of_the_base_keeps_a_fork_made_before_any_change(parent):  # noqa: F811
    ws = parent  # (just mounted: the base layer starts where the fork's layer does)
    at_fork = ws.snapshot()
    f = fork(ws, "a")
    (ws / "src" / "a.txt").write_text("after the fork\n")
    ws.commit()  # (the fork's layer into the base layer: kept)
    r = ws.cowfs("commit", check=False)
    assert r.returncode == REFUSED and "fork a" in r.stderr, r.stderr
    time.sleep(1.1)
    treesnap.assert_same(at_fork, treesnap.snapshot(f))
    ws.cowfs("drop", "a")
    ws.commit()


def test_fork_at_a_mount_point_is_refused_and_leaves_that_mount(parent, tmp_path):  # noqa: F811
    ws = parent
    with managed_workspace(tmp_path / "other") as other:
        other.mount()
        r = ws.cowfs("fork", "--at", str(other.path), "a", check=False)
        assert r.returncode == ALREADY_MOUNTED and "mount point" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        assert is_cowfs_mount(str(other.path))  # (not taken down on the way)
        assert other.status() == [] and forks_of(ws) == {}


def test_fork_at_a_path_through_a_link_is_bound_and_dropped_by_its_own_name(
    parent,  # noqa: F811
    tmp_path,
):
    ws = parent
    (tmp_path / "real").mkdir()
    os.symlink("real", tmp_path / "link")
    r = ws.cowfs("fork", "--at", str(tmp_path / "link"), "a")
    assert f"mounted at {tmp_path / 'real'}" in r.stdout, (r.stdout, r.stderr)
    assert forks_of(ws)["a"]["at"] == [str(tmp_path / "real")]
    assert (tmp_path / "real" / "src" / "a.txt").read_text() == "alpha\n"
    ws.cowfs("drop", "a")
    assert not any(m.mountpoint == str(tmp_path / "real") for m in mounts())
    assert not fork_mounts(ws.path) and forks_of(ws) == {}
    assert os.listdir(Path(tmp_path / "real")) == []
    assert not os.path.exists(os.path.join(runtime_dir(), "forks", path_key(str(ws.path))))


def test_an_unmount_of_the_workspace_leaves_its_forks_and_their_users_alone(parent, tmp_path):  # noqa: F811
    ws = parent
    fork(ws, "a")
    (tmp_path / "at").mkdir()
    ws.cowfs("fork", "--at", str(tmp_path / "at"), "b")
    user = subprocess.Popen(["sleep", "60"], cwd=tmp_path / "at")
    try:
        time.sleep(0.2)
        ws.unmount()
        assert any(m.mountpoint == str(tmp_path / "at") for m in mounts())
        (tmp_path / "at" / "made.txt").write_text("while the workspace is unmounted\n")
        ws.mount()
        rows = forks_of(ws)
        assert rows["a"]["mounted"] and rows["b"]["mounted"], rows
        assert rows["b"]["users"] == [user.pid]
        assert (tmp_path / "at" / "made.txt").exists()
    finally:
        user.kill()
        user.wait()
    ws.cowfs("drop", "b")
    assert not any(m.mountpoint == str(tmp_path / "at") for m in mounts())


@pytest.mark.parametrize("args", [["fork", "b"], ["drop", "a"], ["forks"]])
def test_fork_commands_refuse_the_fork_option(parent, args):  # noqa: F811
    ws = parent
    fork(ws, "a")
    r = ws.cowfs("--fork", "a", *args, check=False)
    assert r.returncode == 2 and "--fork does not apply" in r.stderr, r.stderr
    assert sorted(forks_of(ws)) == ["a"] and forks_of(ws)["a"]["mounted"]


# A process run in fork a (by `run --fork`, so in a mount namespace of its
# own) that becomes nobody and then hides how it holds the fork: what the
# main thread shows of it says nothing.
HIDDEN_USER = r"""
import ctypes, os, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
how = sys.argv[1]
held = os.open("src", os.O_RDONLY | os.O_DIRECTORY)  # (in the fork)
os.setgroups([]); os.setgid(65534); os.setuid(65534)
ready = threading.Event()

def holder():
    if how == "unshared":  # its own descriptors and directories, then the fork's
        assert libc.unshare(0x400 | 0x200) == 0  # CLONE_FILES | CLONE_FS
        os.fchdir(held)
    ready.set()
    while True:
        time.sleep(1)

threading.Thread(target=holder).start()
ready.wait()
if how == "unshared":
    os.close(held)  # (the main thread's: its copy is the thread's own)
    os.chdir("/")
print("ready", flush=True)
if how == "leader-exited":
    libc.syscall(60, 0)  # SYS_exit: the main thread alone ends, a zombie
else:
    while True:
        time.sleep(1)
"""


@pytest.mark.parametrize("how", ["leader-exited", "unshared"])
def test_an_unprivileged_process_hiding_its_use_of_a_fork_in_a_thread_still_holds_it(
    parent,  # noqa: F811
    how,
):
    """A thread that unshared its descriptors and directories, or that
    outlived the main thread, still uses the fork: listed as its user,
    and drop and adopt are refused while it runs (they looked at the main
    thread alone, and went on)."""
    ws = parent
    fork(ws, "a")
    user = subprocess.Popen(
        [*COWFS, "run", "--fork", "a", "--", sys.executable, "-c", HIDDEN_USER, how],
        cwd=ws.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert user.stdout is not None and user.stdout.readline() == b"ready\n"
        pid = _the_nobody_process(user.pid)
        if how == "leader-exited":
            deadline = time.monotonic() + 30
            while _state(pid) != "Z":
                assert time.monotonic() < deadline, "the main thread never ended"
                time.sleep(0.05)
        assert pid in forks_of(ws)["a"]["users"]  # (beside `cowfs run`, waiting for it)
        for cmd in (["adopt", "a"], ["drop", "a"]):
            r = ws.cowfs(*cmd, check=False)
            assert r.returncode == ALREADY_MOUNTED and str(pid) in r.stderr, r.stderr
        assert forks_of(ws)["a"]["mounted"]
    finally:
        os.killpg(user.pid, signal.SIGKILL)
        user.wait()
    drop_when_unused(ws, "a")


def _the_nobody_process(top: int) -> int:
    """The process below *top* (the `cowfs run`) that runs as nobody."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.getsid(int(name)) == top and os.stat(f"/proc/{name}").st_uid == 65534:
                found.append(int(name))
    assert len(found) == 1, found
    return found[0]


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
