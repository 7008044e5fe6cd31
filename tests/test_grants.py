"""Who may ask for what: root mounts a workspace and grants the agent's
account operations (`cowfs mount --allow`); the agent, a real
unprivileged user, asks through the CLI, the API and the MCP server.
Granted `step`, it checkpoints, rolls back and restores; it never reads
through `show`, `diff` or `restore` what it could not read itself, never
runs anything as root, and a user with no grant is refused (exit 13)."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from cowfs.errors import NOT_OWNER, USAGE
from cowfs.system.mounts import VIEW_FSTYPE, mount_table, socket_path

from . import users
from .helpers import COWFS, managed_workspace, reachable_workspace

AGENT = pwd.getpwnam("nobody")
STRANGER = 1234  # a user the workspace grants nothing
SECRET = "root's secret\n"


@pytest.fixture
def granted(fuse):
    """A workspace mounted by root in a directory other users can reach,
    granting the agent `step` and group 1235 `read`; a root-only secret and
    a directory of the agent's own in its base layer."""
    with reachable_workspace("cowfs-grants-") as ws:
        (ws / "secret").write_text(SECRET)
        os.chmod(ws / "secret", 0o600)
        (ws / "private").mkdir(mode=0o700)
        (ws / "private" / "notes").write_text("root's notes\n")
        os.chmod(ws / "private" / "notes", 0o644)  # (readable, below a closed dir)
        (ws / "mine").mkdir()
        (ws / "mine" / "f").write_text("agent's file\n")
        for p in (ws / "mine", ws / "mine" / "f"):
            os.chown(p, AGENT.pw_uid, AGENT.pw_gid)
        ws.mount("--allow", AGENT.pw_name, "--allow", "@1235:read")
        yield ws


def agent(ws, *args: str, uid: int = AGENT.pw_uid, gid: int = AGENT.pw_gid):
    """`cowfs ARGS` run by *uid* inside the workspace (in a child switched
    to that user: this interpreter is where other users cannot run it):
    (exit, stdout, stderr)."""
    import importlib.readers  # noqa: F401  (what the child needs, loaded here)

    from cowfs.escalation import policy

    policy.Policy.load()
    return users.cowfs_as(uid, gid, ws.path, list(args))


def test_a_grant_makes_the_socket_reachable_and_only_that(granted):
    ws = granted
    shared = socket_path(str(ws.path), shared=True)
    assert os.stat(shared).st_mode & 0o777 == 0o666
    assert os.stat(os.path.dirname(shared)).st_mode & 0o777 == 0o755
    code, out, err = agent(ws, "--json", "status")
    assert code == 0, err
    assert "changes" in json.loads(out) and "mounted" not in json.loads(out)  # (the daemon)


def test_the_agent_granted_step_checkpoints_rolls_back_and_restores(granted):
    ws = granted
    code, out, err = agent(ws, "--json", "checkpoint", "-m", "agent's step")
    assert code == 0, err
    layer = json.loads(out)["id"]
    users.run_as(AGENT.pw_uid, AGENT.pw_gid, (ws / "mine" / "f").write_text, "changed\n")
    code, _, err = agent(ws, "restore", "--from", str(layer), "mine/f")
    assert code == 0, err
    assert (ws / "mine" / "f").read_text() == "agent's file\n"
    assert os.stat(ws / "mine" / "f").st_uid == AGENT.pw_uid
    users.run_as(AGENT.pw_uid, AGENT.pw_gid, (ws / "mine" / "g").write_text, "new\n")
    code, _, err = agent(ws, "rollback", "--to", str(layer))
    assert code == 0, err
    assert not (ws / "mine" / "g").exists()


def test_the_agent_never_reads_what_it_could_not_read_itself(granted):
    ws = granted
    layer = ws.checkpoint("before")
    (ws / "secret").write_text("root's new secret\n")
    (ws / "private" / "notes").write_text("root's new notes\n")
    code, out, err = agent(ws, "show", f"{layer}:secret")
    assert code == NOT_OWNER and "secret" not in out and out == "", (code, out, err)
    code, out, err = agent(ws, "show", f"{layer}:private/notes")
    assert code == NOT_OWNER and out == "", (code, out, err)
    code, out, err = agent(ws, "--json", "diff", str(layer))
    assert code == 0, err
    entries = {c["path"]: c for c in json.loads(out)["changes"]}
    for path in ("secret", "private/notes"):
        assert entries[path]["unreadable"] is True
        assert not {"diff", "old", "new"} & set(entries[path]), entries[path]
    assert "secret\n" not in out and "notes\n" not in out
    code, out, err = agent(ws, "diff", str(layer))
    assert code == 0 and "root's" not in out and "not readable by you" in out, out
    # nor through a restore, which would put the bytes where it can read them
    code, _, err = agent(ws, "restore", "--from", str(layer), "secret")
    assert code == NOT_OWNER, err
    assert (ws / "secret").read_text() == "root's new secret\n"
    # root reads everything
    assert ws.cowfs("show", f"{layer}:secret").stdout == SECRET


def test_the_agent_cannot_restore_what_it_may_not_change(granted):
    ws = granted
    layer = ws.checkpoint()
    os.chmod(ws / "secret", 0o644)  # readable now, but root's
    (ws / "secret").write_text("edited by root\n")
    tree = ws.snapshot()
    code, _, err = agent(ws, "restore", "--from", str(layer), "secret")
    assert code == NOT_OWNER and "nothing restored" in err, err
    assert ws.snapshot() == tree


def test_run_runs_the_command_as_the_agent(granted):
    ws = granted
    code, _, err = agent(ws, "run", "--", "sh", "-c", "id -u > mine/who")
    assert code == 0, err
    assert (ws / "mine" / "who").read_text().strip() == str(AGENT.pw_uid)
    assert os.stat(ws / "mine" / "who").st_uid == AGENT.pw_uid


def test_a_user_without_a_grant_is_refused_and_a_reader_only_reads(granted):
    ws = granted
    tree = ws.snapshot()
    for args in (["status"], ["checkpoint"], ["rollback", "--yes"], ["show", "1:secret"]):
        code, _, err = agent(ws, *args, uid=STRANGER, gid=STRANGER)
        assert code == NOT_OWNER and "belongs to another user (uid 0)" in err, (args, err)
    code, _, err = agent(ws, "status", uid=STRANGER, gid=1235)  # (the group reads)
    assert code == 0, err
    code, _, err = agent(ws, "checkpoint", uid=STRANGER, gid=1235)
    assert code == NOT_OWNER and "not checkpoint" in err, err
    # the agent may step, but not manage the workspace
    for args in (["unmount", str(ws.path)], ["gc"], ["check"]):
        code, _, err = agent(ws, *args)
        assert code == NOT_OWNER, (args, err)
    assert ws.snapshot() == tree


def test_an_unknown_user_in_allow_is_a_usage_error(tmp_path):
    with managed_workspace(tmp_path / "ws") as ws:
        r = ws.cowfs("mount", "--allow", "no-such-user-here", ws.path, check=False)
        assert r.returncode == USAGE and "no user" in r.stderr, r.stderr
        assert not ws.mounted


def _mcp(ws, steps, *args: str, env: dict | None = None):
    env = {k: os.environ[k] for k in ("PYTHONPATH", "COWFS_ENGINE") if k in os.environ} | (
        env or {}
    )
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "cowfs", "mcp", "-C", str(ws.path), *args],
        env=env,
        cwd="/",
    )

    async def main():
        async with stdio_client(params, errlog=sys.stderr) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await steps(session)

    return anyio.run(main)


def test_mcp_as_root_must_say_as_whom(granted):
    r = subprocess.run(
        [*COWFS, "mcp", "-C", str(granted.path)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert r.returncode == USAGE and "--as USER" in r.stderr, r.stderr


def test_mcp_as_the_agent_runs_as_the_agent_and_shows_only_its_own(granted):
    ws = granted
    layer = ws.checkpoint()

    async def steps(s):
        ran = await s.call_tool("run", {"command": "id -u; cat secret", "max_bytes": 1000})
        shown = await s.call_tool("show", {"path": "secret", "layer": layer})
        mine = await s.call_tool("show", {"path": "mine/f", "layer": layer})
        return ran, shown, mine

    ran, shown, mine = _mcp(ws, steps, "--as", AGENT.pw_name)
    text = ran.content[0].text
    assert str(AGENT.pw_uid) in text and SECRET not in text, text
    assert shown.is_error and shown.structured_content["code"] == NOT_OWNER, shown
    assert SECRET not in shown.content[0].text
    assert not mine.is_error and "agent's file" in mine.content[0].text


def test_a_view_for_the_agent_goes_only_on_its_own_directory_and_shows_only_its_own(granted):
    ws = granted
    layer = ws.checkpoint()
    (ws / "secret").write_text("root's new secret\n")
    home = ws.path.parent / "agent-home"
    home.mkdir()
    where = home / "view"
    where.mkdir()
    for p in (home, where):
        os.chown(p, AGENT.pw_uid, AGENT.pw_gid)
    etc = home / "etc-link"
    users.run_as(AGENT.pw_uid, AGENT.pw_gid, os.symlink, "/etc", str(etc))
    root_dir = ws.path.parent / "roots"
    root_dir.mkdir()
    try:
        for target in (etc, root_dir):  # (root's directories, one through its own link)
            code, _, err = agent(ws, "view", str(layer), str(target))
            assert code == NOT_OWNER and "belongs to uid 0" in err, (target, err)
        assert "/etc" not in mount_table() and str(root_dir) not in mount_table()
        code, _, err = agent(ws, "view", str(layer), str(where))
        assert code == 0, err
        assert mount_table().get(str(where)) == VIEW_FSTYPE
        assert (where / "mine" / "f").read_text() == "agent's file\n"  # (root reads all)

        def read(p: str) -> str:
            try:
                return open(p).read()
            except PermissionError:
                return "EACCES"

        assert users.run_as(AGENT.pw_uid, AGENT.pw_gid, read, str(where / "secret")) == "EACCES"
        assert users.run_as(AGENT.pw_uid, AGENT.pw_gid, read, str(where / "mine" / "f")) == (
            "agent's file\n"
        )
    finally:
        subprocess.run([*COWFS, "unmount", str(where)], capture_output=True)
        if str(where) in mount_table():
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
    assert str(where) not in mount_table()


def test_the_agent_cannot_name_a_container_or_vm_to_snapshot(granted):
    """Snapshotting and recreating a container acts as the daemon: only
    the owner adds one (`provider add`, or naming it himself)."""
    ws = granted

    def checkpoint(kw: dict) -> int:
        from cowfs.errors import CowfsError
        from cowfs.interface.api import Workspace

        try:
            Workspace.attach(str(ws.path)).checkpoint("x", **kw)
        except CowfsError as e:
            return e.code
        return 0

    for kw in ({"containers": ["someone-elses"]}, {"vms": ["a-domain"]}):
        assert users.run_as(AGENT.pw_uid, AGENT.pw_gid, checkpoint, kw) == NOT_OWNER
    assert ws.json("provider", "list") == []


def test_uncaptured_bytes_never_pass_for_old_ones(granted):
    """A file the agent could read when the layer was opened, closed to it
    since and rewritten where nothing captures it (a path the owner's
    .cowfsignore names): show and view of the past would read the live
    bytes -- they are refused.  And the agent's own .cowfsignore switches
    off nothing."""
    ws = granted
    (ws / ".cowfsignore").write_text("conf\nmine/\n")
    (ws / "conf").write_text("public v1\n")
    layer = ws.checkpoint()
    # (neither is captured: the path is ignored and no layer knows the file
    # -- one a layer knows stays captured wherever it is)
    os.chmod(ws / "conf", 0o600)
    ws.checkpoint()
    (ws / "conf").write_text("ROOT-PASSWORD=hunter2\n")
    code, out, err = agent(ws, "show", f"{layer}:conf")
    assert code == NOT_OWNER and "hunter2" not in out, (code, out, err)
    # an agent's .cowfsignore is not honoured
    os.unlink(ws / ".cowfsignore")
    users.run_as(AGENT.pw_uid, AGENT.pw_gid, (ws / "mine" / ".keep").write_text, "")
    os.chmod(ws.path, 0o777)
    try:
        users.run_as(AGENT.pw_uid, AGENT.pw_gid, (ws / ".cowfsignore").write_text, "conf\n")
    finally:
        os.chmod(ws.path, 0o755)
    ws.checkpoint()
    (ws / "conf").write_text("captured again\n")
    assert "conf" in {c["path"] for c in ws.status()}


def test_a_restore_needs_search_permission_on_every_directory_above(granted):
    ws = granted
    (ws / "rd").mkdir(mode=0o755)
    (ws / "rd" / "w").mkdir(mode=0o777)
    os.chmod(ws / "rd" / "w", 0o777)
    layer = ws.checkpoint()
    os.chmod(ws / "rd", 0o700)
    (ws / "rd" / "w" / "new").write_text("root's\n")
    code, _, err = agent(ws, "restore", "--from", str(layer), "rd/w/new")
    assert code == NOT_OWNER and "nothing restored" in err, err
    assert (ws / "rd" / "w" / "new").read_text() == "root's\n"


def test_a_run_record_is_checked_and_printed_harmlessly(granted):
    ws = granted
    code, out, _ = agent(ws, "--json", "checkpoint", "-m", "step")
    layer = json.loads(out)["id"]

    def annotate(run: dict) -> int:
        from cowfs.errors import CowfsError
        from cowfs.interface.api import Workspace

        try:
            Workspace.attach(str(ws.path)).call("annotate", layer=layer, run=run)
        except CowfsError as e:
            return e.code
        return 0

    base = {"command": "make", "outcome": "kept", "exit_status": 0}
    assert users.run_as(AGENT.pw_uid, AGENT.pw_gid, annotate, base | {"started": "S"}) == USAGE
    evil = base | {"outcome": "kept\x1b[2J\x1b]0;pwned\x07\nforged line"}
    assert users.run_as(AGENT.pw_uid, AGENT.pw_gid, annotate, evil) == 0
    text = ws.cowfs("log").stdout
    assert "\x1b" not in text and "\x07" not in text and "\nforged line" not in text, text
    assert "kept\\033[2J" in text


def test_the_agent_sees_no_other_users_command_lines(granted):
    ws = granted
    ws.checkpoint()
    subprocess.run(["sh", "-c", f"echo x > {ws.path}/by-root", "--password=S3CRET"], check=True)
    code, out, err = agent(ws, "--json", "status")
    assert code == 0, err
    (entry,) = [c for c in json.loads(out)["changes"] if c["path"] == "by-root"]
    assert entry["who"]["uid"] == 0 and "cmd" not in entry["who"]
    assert "S3CRET" not in out
    assert "S3CRET" in ws.cowfs("--json", "status").stdout  # (root's own)


def test_root_does_not_follow_the_agents_link_to_another_workspace(granted, tmp_path):
    ws = granted
    with managed_workspace(tmp_path / "other") as other:
        (other / "f").write_text("other\n")
        other.mount()
        other.checkpoint()
        (other / "f").write_text("changed\n")
        link = ws / "mine" / "proj"
        users.run_as(AGENT.pw_uid, AGENT.pw_gid, os.symlink, str(other.path), str(link))
        r = subprocess.run(
            [*COWFS, "-C", str(link), "rollback"], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == USAGE and "not followed" in r.stderr, r.stderr
        assert (other / "f").read_text() == "changed\n"


def test_the_agent_has_a_bounded_number_of_views(granted):
    ws = granted
    home = ws.path.parent / "views"
    home.mkdir()
    os.chown(home, AGENT.pw_uid, AGENT.pw_gid)
    made = []
    try:
        for i in range(5):
            d = home / f"v{i}"
            users.run_as(AGENT.pw_uid, AGENT.pw_gid, os.mkdir, str(d))
            code, _, err = agent(ws, "view", "1", str(d))
            if i < 4:
                assert code == 0, err
                made.append(d)
            else:
                assert code == 5 and "4 views" in err, err
    finally:
        for d in made:
            subprocess.run([*COWFS, "unmount", str(d)], capture_output=True)
    assert not any(str(d) in mount_table() for d in made)


def test_mcp_as_the_agent_hands_it_none_of_roots_environment(granted):
    ws = granted

    async def steps(s):
        return await s.call_tool("run", {"command": "env", "max_bytes": 20000})

    starter = {"SECRET_API_KEY": "key-456", "PATH": "/root/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    res = _mcp(ws, steps, "--as", AGENT.pw_name, env=starter)
    text = res.content[0].text
    assert "key-456" not in text and "/root/bin" not in text, text
    assert "USER=nobody" in text and "LANG=C.UTF-8" in text, text


def test_a_huge_sparse_file_costs_a_diff_or_status_what_it_holds(granted):
    """Making a file of a TiB that holds nothing costs the agent nothing:
    `diff` and `status` (which compares a file removed and made again with
    the one it replaced) read what the files hold, not their sizes."""
    ws = granted
    big = ws / "mine" / "big"
    fd = os.open(big, os.O_CREAT | os.O_WRONLY, 0o644)
    os.ftruncate(fd, 1 << 40)
    os.pwrite(fd, b"data in the middle", 1 << 39)
    os.close(fd)
    ws.checkpoint()
    os.unlink(big)
    fd = os.open(big, os.O_CREAT | os.O_WRONLY, 0o644)
    os.ftruncate(fd, 1 << 40)
    os.pwrite(fd, b"data in the middle", 1 << 39)
    os.close(fd)
    t0 = time.monotonic()
    code, out, err = agent(ws, "--json", "status", "--times")
    assert code == 0, err
    kinds = {c["path"]: c["kind"] for c in json.loads(out)["changes"]}
    assert kinds["mine/big"] == "t", kinds  # the same bytes (its mtime is new)
    code, out, err = agent(ws, "--json", "diff", "--times", "--", "mine/big")
    assert code == 0, err
    assert time.monotonic() - t0 < 60  # (a TiB read would take hours)
    code, out, err = agent(ws, "diff", "--times", "--", "mine/big")
    assert "sparse: not read" in out or out.strip() == "", out


def test_a_user_holding_control_connections_open_is_refused_more_and_no_one_else(granted):
    """The agent opens connections to the daemon and sends half a request
    on each, holding them (each may wait up to 30 s for the rest): past
    MAX_CONNECTIONS it is answered an error at once, while root's commands
    answer as quickly as ever; once it lets go, it is served again."""
    import socket as socketlib

    from cowfs.service.control import MAX_CONNECTIONS
    from cowfs.system.mounts import MountRecord

    ws = granted
    rec = MountRecord.load(str(ws.path))
    assert rec is not None
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the agent
        try:
            os.close(report_r)
            os.close(go_w)
            users.become(AGENT.pw_uid, AGENT.pw_gid)
            held, answers = [], []
            for _ in range(MAX_CONNECTIONS + 5):
                s = socketlib.socket(socketlib.AF_UNIX)
                s.settimeout(10)
                s.connect(rec.socket)
                s.send(b'{"op": "status"')
                held.append(s)
            for s in held[MAX_CONNECTIONS:]:  # (answered at once, then closed)
                answers.append(json.loads(s.makefile("rb").readline()))
            os.write(report_w, json.dumps(answers).encode())
            os.close(report_w)
            os.read(go_r, 1)
            for s in held:
                s.close()
        finally:
            os._exit(0)
    os.close(report_w)
    os.close(go_r)
    try:
        with os.fdopen(report_r, "rb") as f:
            answers = json.loads(f.read())
        t0 = time.monotonic()
        assert ws.json("status")["id"] >= 1
        assert time.monotonic() - t0 < 25  # (not the 30 s a held connection may take)
    finally:
        os.close(go_w)
        os.waitpid(pid, 0)
    assert len(answers) == 5
    for a in answers:
        assert a["ok"] is False and "requests open" in a["error"], a
    code, out, err = agent(ws, "--json", "status")
    assert code == 0, err


def _counted(ws) -> dict[int, tuple]:
    """Layer -> what its row keeps of its count (unmounted)."""
    from cowfs.storage.store import Store

    store = Store.open(str(ws / ".cowfs"), str(ws.path), create=False, readonly=True)
    try:
        return {x.id: x.counted for x in store.layers()}
    finally:
        store.close()


def test_a_layers_count_is_kept_once_counted_whatever_the_agent_does_above_it(granted):
    """`log` counts a layer below the open one against the tree when the
    layer above it was opened; that count is kept on the layer's row, so
    neither the agent's rollbacks above it nor a remount make the daemon
    read every later record again for each layer (which cost as many
    layers times all their records, every time)."""
    ws = granted

    def files(d: str, m: int) -> None:
        os.mkdir(d)
        for k in range(m):
            Path(d, f"f{k}").write_text(str(k))

    for i in range(4):
        users.run_as(AGENT.pw_uid, AGENT.pw_gid, files, str(ws / "mine" / f"t{i}"), 30)
        ws.checkpoint(f"turn {i}")
    code, out, err = agent(ws, "--json", "log")
    assert code == 0, err
    counts = {x["id"]: x["changes"] for x in json.loads(out)}
    users.run_as(AGENT.pw_uid, AGENT.pw_gid, (ws / "mine" / "junk").write_text, "j")
    code, _, err = agent(ws, "rollback", "--yes")
    assert code == 0, err
    ws.unmount()
    kept = _counted(ws)
    sealed = sorted(kept)[:-1]
    assert all(kept[i] for i in sealed), kept
    assert {i: kept[i][2] for i in sealed} == {i: counts[i] for i in sealed}
    ws.mount("--allow", AGENT.pw_name)
    code, out, err = agent(ws, "--json", "log")
    assert code == 0, err
    assert {x["id"]: x["changes"] for x in json.loads(out)} == {
        i: n for i, n in counts.items() if i in kept
    }
    ws.unmount()
    assert _counted(ws) == kept  # (read, not counted again)
    ws.mount("--allow", AGENT.pw_name)


def _peak(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise KeyError("VmHWM")


def test_a_diff_of_a_new_text_file_costs_the_daemon_memory_in_its_size(granted):
    """A new text file is diffed whatever its number of lines, made from
    the text in one piece: 8 MB of two-byte lines (4,000,000 lines) cost
    the daemon some times its size, not an object per line (600 MiB)."""
    ws = granted
    pid = ws.daemon_pid()
    assert pid is not None
    text = "".join(f"{i % 16:x}\n" for i in range(4_000_000))
    users.run_as(AGENT.pw_uid, AGENT.pw_gid, (ws / "mine" / "big.txt").write_text, text)
    before = _peak(pid)
    code, out, err = agent(ws, "--json", "diff", "--", "mine/big.txt")
    assert code == 0, err
    (entry,) = json.loads(out)["changes"]
    assert entry["added"] == 4_000_000
    assert entry["diff"].split("\n")[3:6] == ["+0", "+1", "+2"]
    assert _peak(pid) - before < 120 << 20, (_peak(pid) - before) >> 20
