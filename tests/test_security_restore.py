"""A restore raced by the agent: an unprivileged user inside the mount
swaps the directory being restored for a symlink to a root-only directory
outside the workspace, or replaces a setuid file being restored with a
symlink to a root-owned program, over and over while root's restore runs
-- through the CLI, the Python API and the MCP server.  The restore is
made by the daemon through its own operations, fd-relative, so nothing
outside the workspace changes, whatever the timing."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cowfs.interface.api import Workspace as ApiWorkspace
from cowfs.layers import treesnap
from cowfs.system.backing import RENAME_EXCHANGE, renameat2

from . import users
from .helpers import managed_workspace
from .test_mcp import ok, serve

AGENT = pwd.getpwnam("nobody")


@contextlib.contextmanager
def agent_racing(step: Callable[[], None], seconds: float = 120.0) -> Iterator[None]:
    """*step* run over and over by the agent user (a forked child that is
    that user) while the block runs (and at most *seconds*); errors of a
    step are part of the race and ignored."""
    child = os.fork()
    if child == 0:  # pragma: no cover - the agent
        try:
            users.become(AGENT.pw_uid, AGENT.pw_gid)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                try:
                    step()
                except OSError:
                    pass
        finally:
            os._exit(0)
    try:
        time.sleep(0.2)  # (the agent is at it before the restore starts)
        yield
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


@pytest.fixture
def reachable(fuse):
    """A mounted workspace in a directory the agent can reach (tmp_path's
    are not), with a little content."""
    base = Path(tempfile.mkdtemp(prefix="cowfs-agent-"))
    os.chmod(base, 0o755)
    try:
        with managed_workspace(base / "ws") as ws:
            (ws / "a.txt").write_text("alpha\n")
            os.chmod(ws.path, 0o755)
            ws.mount()
            yield ws
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _victim(tmp_path: Path) -> Path:
    """A root-only directory outside the workspace, with a secret, a
    subdirectory and a copy of a program."""
    v = tmp_path / "victim"
    v.mkdir(mode=0o700)
    (v / "secret").write_text("root only\n")
    os.chmod(v / "secret", 0o600)
    (v / "sub").mkdir()
    (v / "sub" / "keep").write_text("kept\n")
    shutil.copy2("/usr/bin/id", v / "id")
    os.chmod(v / "id", 0o755)
    return v


def _agent_dir(ws) -> Path:
    """A directory in the workspace that belongs to the agent (made
    through the mount, so the layers know it)."""
    d = ws / "agent"
    d.mkdir()
    os.chown(d, AGENT.pw_uid, AGENT.pw_gid)
    return d


def _swap(d: Path, other: Path) -> Callable[[], None]:
    """The agent's move: exchange the directory being restored and a
    symlink to the victim (both names in a directory of its own)."""
    parent = os.fsencode(d.parent)
    a, b = os.fsencode(d.name), os.fsencode(other.name)

    def step() -> None:
        fd = os.open(parent, os.O_PATH | os.O_DIRECTORY)
        try:
            renameat2(fd, a, fd, b, RENAME_EXCHANGE)
        finally:
            os.close(fd)

    return step


def _prepare_tree(ws, tmp_path: Path, files: int = 1500) -> tuple[Path, Path, int]:
    victim = _victim(tmp_path)
    agent = _agent_dir(ws)
    d = agent / "d"
    d.mkdir()
    for i in range(files):
        (d / f"f{i:04d}").write_text(f"file {i}\n")
    os.chmod(d, 0o777)
    (d / "inner").mkdir(mode=0o777)
    layer = ws.checkpoint("before the agent")

    def agent_work() -> None:
        for name in os.listdir(d):
            p = d / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        os.symlink(victim, agent / "s")

    users.run_as(AGENT.pw_uid, AGENT.pw_gid, agent_work)
    ws.checkpoint("the restore")
    return victim, d, layer


def _unharmed(victim: Path, before: treesnap.Snapshot) -> None:
    treesnap.assert_same(before, treesnap.snapshot(victim))
    st = os.stat(victim)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)


def test_a_restore_raced_with_directory_swaps_never_touches_the_victim(reachable, tmp_path):
    ws = reachable
    victim, d, layer = _prepare_tree(ws, tmp_path)
    before = treesnap.snapshot(victim)
    with agent_racing(_swap(d, d.parent / "s")):
        ws.cowfs("restore", "--from", str(layer), "agent/d")
    _unharmed(victim, before)


@pytest.mark.xfail(
    reason="known bug: a restore raced by renames of the directory it restores can "
    "succeed having restored none of its names (its history of where objects are "
    "now is not refreshed with the agent's concurrent renames); about 1 run in 5",
    strict=False,
)
def test_a_restore_raced_with_directory_swaps_restores_the_whole_tree(reachable, tmp_path):
    """The workspace holds the restored tree after the race, at d or where
    the agent swapped it to -- or the restore fails; never a success with
    the tree missing."""
    ws = reachable
    _, d, layer = _prepare_tree(ws, tmp_path)
    with agent_racing(_swap(d, d.parent / "s")):
        r = ws.cowfs("restore", "--from", str(layer), "agent/d", check=False)
    if r.returncode != 0:  # (refused or failed in the race: one clear line)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
        return
    sizes = {
        p.name: len(os.listdir(p)) if p.is_dir() and not p.is_symlink() else os.readlink(p)
        for p in (d, d.parent / "s")
        if os.path.lexists(p)
    }
    assert 1501 in sizes.values(), (sizes, ws.json("status", "-u"))


def test_a_restore_through_the_api_raced_with_swaps_is_harmless(reachable, tmp_path):
    ws = reachable
    victim, d, layer = _prepare_tree(ws, tmp_path, files=300)
    before = treesnap.snapshot(victim)
    with agent_racing(_swap(d, d.parent / "s")):
        ApiWorkspace.attach(ws.path).restore(["agent/d"], layer)
    _unharmed(victim, before)


def test_a_restore_through_mcp_raced_with_swaps_is_harmless(reachable, tmp_path):
    ws = reachable
    victim, d, layer = _prepare_tree(ws, tmp_path, files=300)
    before = treesnap.snapshot(victim)

    async def steps(s):
        return await ok(s, "restore", paths=["agent/d"], **{"from": layer})

    with agent_racing(_swap(d, d.parent / "s")):
        serve(ws.path, steps)
    _unharmed(victim, before)


def test_a_setuid_file_replaced_by_a_symlink_mid_restore_gives_no_root(reachable, tmp_path):
    ws = reachable
    victim = _victim(tmp_path)
    agent = _agent_dir(ws)
    big = agent / "tool"
    with open(big, "wb") as f:
        f.write(os.urandom(1 << 20) * 64)
    os.chmod(big, 0o4755)  # root's setuid program, in the agent's directory
    layer = ws.checkpoint()
    users.run_as(AGENT.pw_uid, AGENT.pw_gid, os.unlink, str(big))
    ws.checkpoint()
    before = treesnap.snapshot(victim)
    target = str(victim / "id")

    def replace() -> None:
        try:
            os.unlink(big)
        except FileNotFoundError:
            pass
        os.symlink(target, big)

    with agent_racing(replace):
        ws.cowfs("restore", "--from", str(layer), "agent/tool", check=False)
    _unharmed(victim, before)
    assert not os.stat(victim / "id").st_mode & stat.S_ISUID
    for p in agent.iterdir():  # a setuid file there is the restored one, whole
        st = os.lstat(p)
        if st.st_mode & stat.S_ISUID:
            assert st.st_size == 64 << 20 and not stat.S_ISLNK(st.st_mode)


def test_an_offline_restore_never_reads_roots_file_swapped_in_for_the_past():
    """Unmounted, the agent reaches the backing directory itself.  Its file
    f was renamed to g in the layer (g still holds f's past: its bytes are
    read from it), and a new f made.  While root restores f from the
    layer, the agent exchanges g with root's 0600 file beside it, over and
    over: the restore must read the past from the object it found at g
    (or fail), never root's file under that name -- whose bytes would land
    in the agent's restored 0644 file."""
    base = Path(tempfile.mkdtemp(prefix="cowfs-offread-"))
    os.chmod(base, 0o755)
    try:
        with managed_workspace(base / "ws") as ws:
            os.chmod(ws.path, 0o755)
            mine = ws / "agent"
            mine.mkdir()
            (mine / "f").write_text("the agent's old text\n")
            os.chown(mine, AGENT.pw_uid, AGENT.pw_gid)
            os.chown(mine / "f", AGENT.pw_uid, AGENT.pw_gid)
            (mine / "secret").write_text("ROOT SECRET 0600\n")
            os.chmod(mine / "secret", 0o600)
            ws.mount()
            layer = ws.checkpoint()
            users.run_as(AGENT.pw_uid, AGENT.pw_gid, os.rename, str(mine / "f"), str(mine / "g"))
            users.run_as(AGENT.pw_uid, AGENT.pw_gid, lambda: (mine / "f").write_text("new\n"))
            ws.unmount()
            fd = os.open(mine, os.O_PATH | os.O_DIRECTORY)
            try:
                with agent_racing(
                    lambda: renameat2(fd, b"g", fd, b"secret", RENAME_EXCHANGE), seconds=60
                ):
                    for _ in range(40):
                        ws.cowfs("restore", "--from", str(layer), "agent/f", check=False)
                        assert b"ROOT SECRET" not in (mine / "f").read_bytes()
                        # (a restore refused halfway leaves the new text)
                        assert (mine / "f").read_bytes() in (b"new\n", b"the agent's old text\n")
                if b"ROOT SECRET" in (mine / "g").read_bytes():  # (left exchanged)
                    renameat2(fd, b"g", fd, b"secret", RENAME_EXCHANGE)
            finally:
                os.close(fd)
            # with nothing swapped, the restore reads the past from g
            (mine / "f").write_text("new\n")
            ws.cowfs("restore", "--from", str(layer), "agent/f")
            assert (mine / "f").read_bytes() == b"the agent's old text\n"
            assert (mine / "secret").read_bytes() == b"ROOT SECRET 0600\n"
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)
