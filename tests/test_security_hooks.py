"""`cowfs hooks install|uninstall` run by root in a workspace where an agent
(an unprivileged user, here "nobody") plants symlinks: at the temporary
names a settings file used to be written through
(``settings.json.cowfs-<pid>``, for the pids to come), at the settings file
itself and at its directory, each pointing at a victim -- root's 0600 file
(valid JSON, so that it would be merged) or 0700 directory outside the
workspace.  The victim stays byte for byte as it was and root's; nothing of
it reaches the workspace; the agent's links are refused, never followed."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pwd
from pathlib import Path

import pytest

from cowfs.errors import USAGE
from cowfs.interface import agents, cli
from cowfs.layers import treesnap

from . import users

AGENT = pwd.getpwnam("nobody")
A = agents.AGENTS["claude-code"]
SECRET = b'{"secret": "root only"}\n'
PLANTED = 3000  # temporary names planted for the pids to come


def as_agent(fn, *args):
    return users.run_as(AGENT.pw_uid, AGENT.pw_gid, fn, *args)


def in_dir(where: Path, fn, *args):
    """fn(dirfd, *args) run by the agent on the directory *where* (through
    a descriptor: the test's directories above it are root's alone)."""
    fd = os.open(where, os.O_PATH | os.O_DIRECTORY)
    try:
        return as_agent(fn, fd, *args)
    finally:
        os.close(fd)


def plant_temp_names(settings_dir: Path, target: str) -> list[str]:
    """The agent's symlinks at ``settings.json.cowfs-<pid>`` -> *target*, for
    this process (whose pid the command run here has) and the next pids."""
    with open("/proc/sys/kernel/ns_last_pid") as f:
        last = int(f.read())
    names = [f"settings.json.cowfs-{pid}" for pid in [os.getpid(), *range(last, last + PLANTED)]]
    names = list(dict.fromkeys(names))

    def plant(fd: int, names: list[str]) -> None:
        for n in names:
            os.symlink(target, n, dir_fd=fd)

    in_dir(settings_dir, plant, names)
    return names


def plant_link(where: Path, name: str, target: str) -> None:
    """The agent puts a symlink -> *target* at *where*/*name* (replacing
    what is there, as a rename does)."""

    def plant(fd: int) -> None:
        os.symlink(target, name + ".new", dir_fd=fd)
        os.rename(name + ".new", name, src_dir_fd=fd, dst_dir_fd=fd)

    in_dir(where, plant)
    assert os.lstat(where / name).st_uid == AGENT.pw_uid


def cowfs(ws, *args: str) -> tuple[int, str, str]:
    """The cowfs command run in this process (its pid is one the agent
    planted a temporary name for): (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["-C", str(ws.path), *args])
    assert "Traceback" not in err.getvalue()
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def victim(tmp_path):
    """Root's 0600 JSON file outside the workspace; afterwards byte for byte
    as it was, root's, 0600."""
    v = tmp_path / "victim.json"
    v.write_bytes(SECRET)
    os.chmod(v, 0o600)
    before = os.stat(v)
    yield v
    after = os.stat(v)
    assert v.read_bytes() == SECRET
    assert (after.st_uid, after.st_gid, after.st_mode, after.st_mtime_ns, after.st_ino) == (
        before.st_uid,
        before.st_gid,
        before.st_mode,
        before.st_mtime_ns,
        before.st_ino,
    )


@pytest.fixture
def agents_settings_dir(mounted):
    """The workspace's .claude, the agent's (as a directory the agent made)."""
    d = mounted / ".claude"
    d.mkdir()
    os.chown(d, AGENT.pw_uid, AGENT.pw_gid)
    return d


def untouched_links(d: Path, names: list[str], target: Path) -> None:
    for n in names:
        assert os.readlink(d / n) == str(target)


def test_install_refuses_a_planted_settings_symlink_and_writes_through_no_temp_name(
    mounted, victim, agents_settings_dir
):
    ws, d = mounted, agents_settings_dir
    names = plant_temp_names(d, str(victim))
    plant_link(d, "settings.json", str(victim))
    for _ in range(2):  # in this process (a planted pid), and as a command of its own
        code, out, err = cowfs(ws, "hooks", "install", "claude-code")
        assert code == USAGE, (code, out, err)
        assert f"{d}/settings.json is a symlink owned by another user" in err, err
        assert "nothing was changed" in err and len(err.strip().splitlines()) == 1, err
        r = ws.cowfs("hooks", "install", "--per-tool", "claude-code", check=False)
        assert r.returncode == USAGE and "is a symlink owned by another user" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert os.readlink(d / "settings.json") == str(victim)
    untouched_links(d, names, victim)
    assert sorted(os.listdir(d)) == sorted([*names, "settings.json"])  # no file of ours left


def test_install_writes_a_real_file_past_planted_temp_names(mounted, victim, agents_settings_dir):
    ws, d = mounted, agents_settings_dir
    names = plant_temp_names(d, str(victim))
    code, out, err = cowfs(ws, "hooks", "install", "claude-code")
    assert code == 0, err
    ws.cowfs("hooks", "install", "--per-tool", "claude-code")  # (a command of its own)
    st = os.lstat(d / "settings.json")
    assert st.st_uid == 0 and os.path.isfile(d / "settings.json") and st.st_nlink == 1
    assert not os.path.islink(d / "settings.json")
    text = (d / "settings.json").read_text()
    assert set(json.loads(text)["hooks"]) == {A.prompt_event, A.tool_event}
    assert "secret" not in text
    untouched_links(d, names, victim)
    assert sorted(os.listdir(d)) == sorted([*names, "settings.json"])

    r = ws.cowfs("--json", "hooks", "uninstall", "claude-code")
    assert json.loads(r.stdout)["removed"]
    assert sorted(os.listdir(d)) == sorted(names)
    untouched_links(d, names, victim)


def test_uninstall_refuses_a_settings_file_swapped_for_a_symlink(
    mounted, tmp_path, agents_settings_dir
):
    """Installed for real; then the agent puts a link to root's copy of
    those very settings (our hooks in them, so uninstall would rewrite
    it) in their place."""
    ws, d = mounted, agents_settings_dir
    ws.cowfs("hooks", "install", "claude-code")
    victim = tmp_path / "root-settings.json"
    victim.write_bytes((d / "settings.json").read_bytes())
    os.chmod(victim, 0o600)
    before = victim.read_bytes()
    names = plant_temp_names(d, str(victim))
    plant_link(d, "settings.json", str(victim))
    code, out, err = cowfs(ws, "hooks", "uninstall", "claude-code")
    assert code == USAGE and "is a symlink owned by another user" in err, (code, err)
    assert victim.read_bytes() == before and os.stat(victim).st_mode & 0o777 == 0o600
    assert os.readlink(d / "settings.json") == str(victim)
    untouched_links(d, names, victim)


def test_a_planted_settings_directory_is_not_followed(mounted, tmp_path):
    """The agent (owning the workspace root here) makes .claude a link to
    root's 0700 directory that holds settings of its own."""
    ws = mounted
    victim = tmp_path / "root-claude"
    victim.mkdir(mode=0o700)
    (victim / "settings.json").write_bytes(SECRET)
    before = treesnap.snapshot(victim)
    os.chown(ws.path, AGENT.pw_uid, AGENT.pw_gid)
    plant_link(ws.path, ".claude", str(victim))
    for action in ("install", "uninstall"):
        code, out, err = cowfs(ws, "hooks", action, "claude-code")
        assert code == USAGE, (code, out, err)
        assert f"{ws.path}/.claude is a symlink owned by another user" in err, err
    treesnap.assert_same(before, treesnap.snapshot(victim))
    assert sorted(os.listdir(victim)) == ["settings.json"]


def test_a_settings_link_of_roots_own_is_followed_and_kept(mounted):
    """A symlink root made, in a directory only root may change, is
    followed: the file it leads to gets the hooks, the link stays, and
    uninstall leaves that file ({}), not a dangling link."""
    ws = mounted
    (ws / "shared.json").write_text('{"model": "opus"}\n')
    (ws / ".claude").mkdir(mode=0o755)
    os.symlink("../shared.json", ws / ".claude" / "settings.json")
    code, out, err = cowfs(ws, "hooks", "install", "claude-code")
    assert code == 0, err
    assert os.readlink(ws / ".claude" / "settings.json") == "../shared.json"
    assert set(json.loads((ws / "shared.json").read_text())) == {"model", "hooks"}
    code, out, err = cowfs(ws, "hooks", "uninstall", "claude-code")
    assert code == 0, err
    assert (ws / "shared.json").read_text() == '{"model": "opus"}\n'
    os.unlink(ws / ".claude" / "settings.json")
    (ws / "shared.json").write_text("{}\n")
    os.symlink("../shared.json", ws / ".claude" / "settings.json")
    cowfs(ws, "hooks", "install", "claude-code")
    code, out, err = cowfs(ws, "--json", "hooks", "uninstall", "claude-code")
    assert code == 0 and not json.loads(out)["removed"], (out, err)
    assert (ws / "shared.json").read_text() == "{}\n"
    assert os.path.islink(ws / ".claude" / "settings.json")
