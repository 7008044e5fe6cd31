"""tools/install: cowfs built as a wheel and installed, with its extras,
into a virtual environment made with the system's Python, under a
temporary prefix, and run by a real unprivileged user ("nobody", in
processes of its own, with a clean environment): the command's version,
an agent CLI's hook as the installed settings call it, against a workspace
root mounted with the installed cowfs, and `cowfs mcp` driven by the MCP
SDK's client.  Then installing again upgrades in place, what is in the way
is refused, and --uninstall removes what the install made.

The install is built once for the module (slow: pip builds the wheel and
fetches, or builds, the dependencies)."""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

import cowfs

from .helpers import Workspace, reachable_workspace

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "tools" / "install"
AGENT = pwd.getpwnam("nobody")
SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def clean_env() -> dict[str, str]:
    """An environment as a login gives it: none of this test run's Python
    settings (PYTHONPATH would load the checkout's cowfs)."""
    return {"PATH": PATH, "HOME": "/", "LANG": "C.UTF-8"} | {
        k: v for k, v in os.environ.items() if k == "COWFS_ENGINE"
    }


def as_agent(argv: list[str]) -> list[str]:
    """*argv* run as the agent (a process of its own, its groups cleared)."""
    ids = [f"--reuid={AGENT.pw_uid}", f"--regid={AGENT.pw_gid}", "--clear-groups"]
    return [SETPRIV, *ids, "--", *argv]


@dataclass
class Install:
    base: Path
    prefix: Path
    bindir: Path

    @property
    def command(self) -> Path:
        return self.bindir / "cowfs"

    def run(self, *args: str, agent: bool = False, **kw) -> subprocess.CompletedProcess:
        """The installed command (as root, or as the agent), in a clean environment."""
        argv = [str(self.command), *args]
        return subprocess.run(
            as_agent(argv) if agent else argv,
            env=clean_env(),
            cwd="/",
            capture_output=True,
            text=True,
            timeout=300,
            **kw,
        )

    def tool(self, *args: str, prefix: Path | None = None, bindir: Path | None = None):
        """tools/install with this install's (or the given) directories."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return subprocess.run(
            [
                str(INSTALL),
                "--prefix",
                str(prefix or self.prefix),
                "--bin",
                str(bindir or self.bindir),
                *args,
            ],
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=1800,
        )


@pytest.fixture(scope="module")
def installed() -> Iterator[Install]:
    base = Path(tempfile.mkdtemp(prefix="cowfs-install-"))
    os.chmod(base, 0o755)  # (the agent goes through it)
    inst = Install(base, base / "opt" / "cowfs", base / "bin")
    try:
        r = inst.tool()
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"cowfs {cowfs.__version__} in {inst.prefix}" in r.stdout, r.stdout
        assert "(checked as user nobody)" in r.stdout, r.stdout
        yield inst
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def shared_ws(installed: Install, fuse) -> Iterator[Workspace]:
    """A workspace that root mounts with the installed cowfs, granting the
    agent `step`, in a directory the agent can reach; a directory of the
    agent's own in it."""
    with reachable_workspace("cowfs-install-ws-") as ws:
        (ws / "a.txt").write_text("alpha\n")
        (ws / "mine").mkdir()
        os.chown(ws / "mine", AGENT.pw_uid, AGENT.pw_gid)
        r = installed.run("mount", "--allow", AGENT.pw_name, str(ws.path))
        ws.mounted = r.returncode == 0
        assert ws.mounted, r.stderr
        yield ws


def test_every_user_can_run_the_installed_command(installed: Install):
    inst = installed
    assert os.readlink(inst.command) == str(inst.prefix / "bin" / "cowfs")
    cfg = (inst.prefix / "pyvenv.cfg").read_text()
    assert "home = /usr/bin\n" in cfg, cfg  # made with the system's Python
    for where in (inst.prefix, inst.bindir):
        for path in [where, *where.rglob("*")]:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            mode = stat.S_IMODE(st.st_mode)
            assert mode & 0o004 and not mode & 0o022, f"{path}: {oct(mode)}"
            if stat.S_ISDIR(st.st_mode):
                assert mode & 0o001, f"{path}: {oct(mode)}"

    r = inst.run("--version", agent=True)
    assert r.returncode == 0 and r.stdout == f"cowfs {cowfs.__version__}\n", (r.stdout, r.stderr)
    # the installed package (no other), and its extras load as the agent too
    probe = (
        "import cowfs, pyfuse3, mcp, docker, libvirt; "
        "from cowfs.interface import mcpserver; print(cowfs.__file__)"
    )
    r = subprocess.run(
        as_agent([str(inst.prefix / "bin" / "python"), "-c", probe]),
        env=clean_env(),
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{inst.prefix}/lib/"), r.stdout


def test_the_installed_hooks_run_as_the_agent_take_its_checkpoints(
    installed: Install, shared_ws: Workspace
):
    """`cowfs hooks install claude-code --per-tool` by root with the
    installed cowfs; each hook command as the settings hold it, run by the
    agent through a shell with the event's JSON on stdin, as Claude Code
    runs it."""
    ws = shared_ws
    r = installed.run("-C", str(ws.path), "hooks", "install", "--per-tool", "claude-code")
    assert r.returncode == 0, r.stderr
    hooks = json.loads((ws / ".claude" / "settings.json").read_text())["hooks"]
    command = {event: groups[0]["hooks"][0]["command"] for event, groups in hooks.items()}
    assert set(command) == {"UserPromptSubmit", "PreToolUse"}
    for line in command.values():  # the installed cowfs, not this test run's
        assert line.startswith(shlex.quote(str(installed.prefix / "bin" / "cowfs")) + " "), line

    def hook(event: str, payload: dict) -> None:
        r = subprocess.run(
            as_agent(["sh", "-c", command[event]]),
            input=json.dumps(payload),
            env=clean_env(),
            cwd=ws.path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0 and "systemMessage" not in r.stdout, (r.stdout, r.stderr)

    base = {"session_id": "s-install", "cwd": str(ws.path), "permission_mode": "default"}
    hook(
        "UserPromptSubmit",
        base | {"hook_event_name": "UserPromptSubmit", "prompt": "fix the build"},
    )
    r = subprocess.run(
        as_agent(["sh", "-c", "echo edit > mine/f"]), cwd=ws.path, env=clean_env(), timeout=60
    )
    assert r.returncode == 0
    hook(
        "PreToolUse",
        base
        | {
            "hook_event_name": "PreToolUse",
            "tool_name": "Bash",
            "tool_input": {"command": "make test"},
            "tool_use_id": "toolu_1",
        },
    )
    layers = [x for x in ws.log() if x.get("agent")]
    assert [x["message"] for x in layers] == ["fix the build", "Bash: make test"]
    turn, tool = layers[0]["agent"], layers[1]["agent"]
    assert (turn["agent"], turn["kind"], turn["session"]) == ("claude-code", "prompt", "s-install")
    assert (tool["kind"], tool["tool"]) == ("tool", "Bash")
    assert layers[0]["changes"] == 1  # the agent's edit belongs to the turn


def test_cowfs_mcp_as_the_agent_serves_the_sdk_client(installed: Install, shared_ws: Workspace):
    ws = shared_ws
    params = StdioServerParameters(
        command=SETPRIV,
        args=as_agent([str(installed.command), "mcp", "-C", str(ws.path)])[1:],
        env=clean_env(),
        cwd="/",
    )

    async def main():
        async with stdio_client(params, errlog=sys.stderr) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                tools = {t.name for t in (await s.list_tools()).tools}
                made = await s.call_tool("checkpoint", {"message": "from the agent's MCP"})
                status = await s.call_tool("status", {})
                return s.server_info, tools, made, status

    info, tools, made, status = anyio.run(main)
    assert (info.name, info.version) == ("cowfs", cowfs.__version__)
    assert {"status", "checkpoint", "rollback", "diff", "run"} <= tools, tools
    assert not made.is_error, made.content[0].text
    assert not status.is_error, status.content[0].text
    assert status.structured_content["changes"] == []
    assert ws.log()[-1]["message"] == "from the agent's MCP"


def test_installing_again_upgrades_in_place(installed: Install):
    inst = installed
    python = os.lstat(inst.prefix / "bin" / "python").st_ino
    (code,) = inst.prefix.glob("lib/python3*/site-packages/cowfs/__init__.py")
    before = os.stat(code).st_mtime_ns
    r = inst.tool()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "making the environment" not in r.stdout, r.stdout  # the same one, upgraded
    assert os.lstat(inst.prefix / "bin" / "python").st_ino == python
    assert os.stat(code).st_mtime_ns > before  # cowfs itself installed afresh
    assert os.readlink(inst.command) == str(inst.prefix / "bin" / "cowfs")
    assert inst.run("--version", agent=True).stdout == f"cowfs {cowfs.__version__}\n"


def test_what_is_in_the_way_is_refused_and_left_alone(installed: Install, tmp_path):
    inst = installed
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep").write_text("not cowfs\n")
    r = inst.tool(prefix=other, bindir=tmp_path / "bin")
    assert r.returncode == 3, r.stderr
    assert r.stderr == (
        f"install: {other} exists and is not a cowfs install (no .cowfs-install): "
        "choose another --prefix or remove it\n"
    )
    r = inst.tool("--uninstall", prefix=other, bindir=tmp_path / "bin")
    assert r.returncode == 3 and "not removed" in r.stderr, r.stderr
    assert sorted(os.listdir(other)) == ["keep"]

    foreign = inst.base / "bin2"
    foreign.mkdir()
    (foreign / "cowfs").write_text("#!/bin/sh\n")
    r = inst.tool(bindir=foreign)
    assert r.returncode == 3 and "is not a cowfs install's symlink" in r.stderr, r.stderr
    assert (foreign / "cowfs").read_text() == "#!/bin/sh\n"

    closed = tmp_path / "closed"  # (tmp_path's own directories are root's 0700)
    r = inst.tool(prefix=closed / "cowfs", bindir=closed / "bin")
    assert r.returncode == 3 and "other users cannot reach" in r.stderr, r.stderr
    assert not closed.exists()

    # a directory another user made (or may write) is no place for what root runs
    nobody = pwd.getpwnam("nobody")
    planted = inst.base / "planted"
    planted.mkdir()
    os.chown(planted, nobody.pw_uid, nobody.pw_gid)
    r = inst.tool(prefix=planted, bindir=inst.base / "bin3")
    assert r.returncode == 3, r.stderr
    assert f"{planted} belongs to uid {nobody.pw_uid}" in r.stderr, r.stderr
    shared = inst.base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # (no sticky bit: anyone may rename what is in it)
    r = inst.tool(prefix=shared / "cowfs", bindir=inst.base / "bin3")
    assert r.returncode == 3 and f"others may write {shared} (mode 777)" in r.stderr, r.stderr
    assert os.listdir(planted) == [] and os.listdir(shared) == []

    r = inst.tool("--frobnicate")
    assert r.returncode == 2 and "unknown argument --frobnicate" in r.stderr, r.stderr


def test_uninstall_removes_the_install_but_not_while_it_runs(installed: Install):
    """(Last: it takes the module's install away.)"""
    inst = installed
    running = subprocess.Popen(
        [str(inst.prefix / "bin" / "python"), "-c", "import time; time.sleep(300)"],
        env=clean_env(),
    )
    try:
        r = inst.tool("--uninstall")
        assert r.returncode == 3 and str(running.pid) in r.stderr, r.stderr
        assert "nothing removed" in r.stderr, r.stderr
        assert inst.command.is_symlink() and inst.prefix.is_dir()
    finally:
        running.kill()
        running.wait()
    # another user's process named as the install's Python (anyone may name
    # one so) is told of, and does not stop the uninstall
    nobody = pwd.getpwnam("nobody")
    named = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={nobody.pw_uid}",
            f"--regid={nobody.pw_gid}",
            "--clear-groups",
            "bash",
            "-c",
            f"exec -a {inst.prefix}/bin/python sleep 300",
        ],
        env=clean_env(),
    )
    try:
        deadline = time.monotonic() + 10
        while str(inst.prefix) not in Path(f"/proc/{named.pid}/cmdline").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = inst.tool("--uninstall")
    finally:
        named.kill()
        named.wait()
    assert r.returncode == 0, r.stderr
    assert f"processes of other users run cowfs of {inst.prefix} (pids {named.pid})" in r.stderr
    assert r.stdout == f"install: removed {inst.command} {inst.prefix}\n", r.stdout
    assert not inst.command.is_symlink() and not inst.prefix.exists()
    assert inst.bindir.is_dir()  # (the directory stays)
    r = inst.tool("--uninstall")
    assert r.returncode == 0 and "nothing removed" in r.stdout, r.stdout
