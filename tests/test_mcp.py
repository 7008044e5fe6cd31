"""`cowfs mcp`: the workspace's operations as MCP tools, driven by the
official MCP SDK's own stdio client against ``python -m cowfs mcp -C WS``
on real mounts, and its stdio transport spoken to in raw lines."""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import sys
import time

import anyio
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

import cowfs
from cowfs.interface.mcpserver import MAX_LINE
from cowfs.layers import treesnap
from cowfs.system.mounts import is_cowfs_mount

from .helpers import COWFS

TOOLS = {
    "status",
    "diff",
    "show",
    "log",
    "checkpoint",
    "rollback",
    "commit",
    "redo",
    "restore",
    "run",
    "fork",
    "forks",
    "adopt",
    "drop",
}


def serve(path, steps, *extra: str, errlog=None):
    """Start ``cowfs mcp -C PATH`` through the SDK's stdio client, run
    ``await steps(session)`` and return what it returns."""
    env = {k: os.environ[k] for k in ("PYTHONPATH", "COWFS_ENGINE") if k in os.environ}
    params = StdioServerParameters(
        command=sys.executable,
        # (the tests run as root, which must say so: --as root)
        args=[
            *("-m", "cowfs", "mcp", "-C", str(path)),
            *(() if "--as" in extra else ("--as", "root")),
            *extra,
        ],
        env=env,
        cwd="/",
    )

    async def main():
        async with stdio_client(params, errlog=errlog or sys.stderr) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await steps(session)

    return anyio.run(main)


async def ok(session: ClientSession, tool: str, **args) -> dict:
    res = await session.call_tool(tool, args)
    assert not res.is_error, f"{tool} {args}: {res.content[0].text}"
    return res.structured_content


async def fails(session: ClientSession, tool: str, **args) -> tuple[int, str]:
    res = await session.call_tool(tool, args)
    assert res.is_error, f"{tool} {args} succeeded: {res.content[0].text}"
    return res.structured_content["code"], res.content[0].text


def test_the_tools_are_listed_with_schemas_named_as_the_cli_options(mounted):
    async def steps(s):
        return s.server_info, {t.name: t for t in (await s.list_tools()).tools}

    info, tools = serve(mounted.path, steps)
    assert (info.name, info.version) == ("cowfs", cowfs.__version__)  # (was "")
    assert set(tools) == TOOLS
    for t in tools.values():
        assert t.description and t.input_schema["type"] == "object"
        assert "\n " not in t.description, t.description  # (no docstring indentation)
    props = {name: set(t.input_schema.get("properties", {})) for name, t in tools.items()}
    assert {"to", "dry_run", "no_redo", "yes", "skip_damaged"} <= props["rollback"]
    assert {"layer", "paths", "stat", "name_status", "max_bytes"} <= props["diff"]
    assert {"paths", "from"} <= props["restore"]
    assert {
        "command",
        "verify",
        "message",
        "on_fail",
        "on_success",
        "timeout",
        "max_bytes",
    } <= props["run"]
    assert props["checkpoint"] == {"message"}
    assert tools["run"].input_schema["required"] == ["command"]


def test_checkpoint_change_through_the_mount_roll_back_exactly(mounted):
    ws = mounted
    before = ws.snapshot()

    async def steps(s):
        layer = (await ok(s, "checkpoint", message="before the edits"))["id"]
        (ws / "a.txt").write_text("changed\n")
        (ws / "dir" / "b.txt").rename(ws / "moved.txt")
        (ws / "new").mkdir()
        (ws / "new" / "c.bin").write_bytes(os.urandom(100_000))
        os.symlink("a.txt", ws / "link")
        os.chmod(ws / "a.txt", 0o600)
        status = await ok(s, "status")
        kinds = {c["path"]: c["kind"] for c in status["changes"]}
        assert kinds["a.txt"] == "M" and kinds["new/c.bin"] == "A" and kinds["link"] == "A"
        assert all("who" not in c for c in status["changes"])
        dry = await ok(s, "rollback", to=layer, dry_run=True)
        assert {c["path"] for c in dry["changes"]} == {c["path"] for c in status["changes"]}
        after = ws.snapshot()
        done = await ok(s, "rollback", to=layer)
        assert done["dropped"] == [layer] and not done.get("failures")
        treesnap.assert_same(before, ws.snapshot())
        await ok(s, "redo")
        treesnap.assert_same(after, ws.snapshot())
        log = await ok(s, "log")
        assert [x["message"] for x in log["layers"]][-1] == "before the edits"

    serve(ws.path, steps)


def test_a_bad_layer_id_is_a_tool_error_and_the_server_goes_on(mounted, tmp_path):
    errlog = (tmp_path / "server.err").open("w+")

    async def steps(s):
        code, text = await fails(s, "rollback", to=999)
        assert code == 4 and "no layer 999" in text and text.endswith("(exit code 4)")
        code, _ = await fails(s, "show", layer=999, path="a.txt")
        assert code == 4
        code, _ = await fails(s, "diff", layer=999)
        assert code == 4
        code, text = await fails(s, "restore", paths=["nowhere"])
        assert code == 1 and "nowhere" in text
        code, _ = await fails(s, "commit")  # the base layer holds nothing
        assert code == 1
        assert (await ok(s, "checkpoint", message="still serving"))["id"] == 2
        assert (await ok(s, "status"))["changes"] == []

    serve(mounted.path, steps, errlog=errlog)
    errlog.seek(0)
    assert "Traceback" not in errlog.read()


def test_a_rollback_of_the_base_layer_needs_yes(mounted):
    ws = mounted
    before = ws.snapshot()
    (ws / "session.txt").write_text("everything since the mount\n")
    changed = ws.snapshot()

    async def steps(s):
        code, text = await fails(s, "rollback")
        assert code == 14 and "base layer" in text
        treesnap.assert_same(changed, ws.snapshot())  # nothing was changed
        await ok(s, "rollback", yes=True)
        treesnap.assert_same(before, ws.snapshot())

    serve(ws.path, steps)


def test_run_captures_output_and_rolls_back_a_failing_step(mounted):
    ws = mounted
    before = ws.snapshot()

    async def steps(s):
        r = await ok(s, "run", command="echo out; echo err >&2; echo x > new.txt; exit 3")
        assert (r["outcome"], r["exit_status"], r["ok"]) == ("rolled back", 3, False)
        assert (r["stdout"], r["stderr"]) == ("out\n", "err\n")
        assert r["changes"] == [{"path": "new.txt", "kind": "A"}]
        treesnap.assert_same(before, ws.snapshot())
        r = await ok(
            s, "run", command=["sh", "-c", "cat; echo y >> a.txt"], verify="grep -q nothing a.txt"
        )
        assert (r["outcome"], r["verify_status"]) == ("rolled back", 1)
        treesnap.assert_same(before, ws.snapshot())  # cat read nothing: stdin is empty
        r = await ok(s, "run", command="sleep 600", timeout=1)
        assert (r["exit_status"], r["outcome"]) == (124, "rolled back")
        assert "timed out" in r["error"]
        r = await ok(
            s,
            "run",
            command="seq 1 100000 > numbers; seq 1 100000",
            cwd="dir",
            max_bytes=1000,
            message="numbers",
        )
        assert (r["outcome"], r["exit_status"]) == ("kept", 0)
        assert r["layer"] == (await ok(s, "log"))["layers"][-1]["id"]
        assert len(r["stdout"].encode()) < 1200 and "left out" in r["stdout"]
        assert r["stdout"].startswith("1\n2\n") and r["stdout"].endswith("100000\n")
        assert (ws / "dir" / "numbers").read_text().endswith("\n100000\n")
        code, _ = await fails(s, "run", command="true", cwd="../..")
        assert code == 2

    serve(ws.path, steps)


def test_diff_is_cut_at_its_byte_limit_and_show_reads_the_past(mounted):
    ws = mounted

    async def steps(s):
        layer = (await ok(s, "checkpoint"))["id"]
        (ws / "big.txt").write_text("".join(f"line {i}\n" for i in range(5000)))
        (ws / "a.txt").write_text("alpha\nomega\n")
        d = await ok(s, "diff", max_bytes=2000)
        assert d["cut"] and len(d["text"].encode()) < 2200 and "cut at" in d["text"]
        assert {c["path"] for c in d["changes"]} == {"big.txt", "a.txt"}
        d = await ok(s, "diff", paths=["a.txt"])
        assert not d["cut"] and "+omega" in d["text"] and "big.txt" not in d["text"]
        d = await ok(s, "diff", name_status=True)
        assert sorted(d["text"].splitlines()) == ["A\tbig.txt", "M\ta.txt"]
        shown = await ok(s, "show", layer=layer, path="a.txt")
        assert shown["text"] == "alpha\n" and not shown["binary"]
        shown = await ok(s, "show", layer=1, path="dir")
        assert shown["entries"] == ["b.txt"]
        (ws / "blob").write_bytes(bytes(range(256)) * 4)
        layer2 = (await ok(s, "checkpoint"))["id"]
        (ws / "blob").unlink()
        shown = await ok(s, "show", layer=layer2, path="blob")
        assert shown["binary"] and shown["size"] == 1024
        restored = await ok(s, "restore", paths=["a.txt"], **{"from": layer})
        assert restored["restored"] == ["a.txt"]
        assert (ws / "a.txt").read_text() == "alpha\n"

    serve(ws.path, steps)


def test_the_server_outlives_an_unmount(mounted):
    ws = mounted

    async def steps(s):
        await ok(s, "checkpoint", message="one")
        ws.unmount()
        code, text = await fails(s, "status")
        assert code == 3 and "not inside a mounted cowfs workspace" in text
        ws.mount()
        assert [x["message"] for x in (await ok(s, "log"))["layers"]][-1] == "one"

    serve(ws.path, steps)


def test_an_unmounted_workspace_is_refused_or_mounted_with_mount(workspace):
    (workspace / "f").write_text("x\n")
    r = subprocess.run(
        [*COWFS, "mcp", "-C", str(workspace.path), "--as", "root"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert r.returncode == 3 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "not inside a mounted cowfs workspace" in r.stderr

    async def steps(s):
        assert is_cowfs_mount(str(workspace.path))
        layer = (await ok(s, "checkpoint"))["id"]
        (workspace / "f").write_text("y\n")
        await ok(s, "rollback", to=layer)
        return (workspace / "f").read_text()

    assert serve(workspace.path, steps, "--mount") == "x\n"
    assert is_cowfs_mount(str(workspace.path))  # it stays mounted


@pytest.mark.parametrize("args", [["-C"], ["--bogus"]])
def test_usage_errors_are_one_line(args):
    r = subprocess.run(
        [*COWFS, "mcp", *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1


class Raw:
    """``cowfs mcp -C PATH --as root`` spoken to in raw lines: bytes written
    to its stdin, each answer line read from its stdout with a timeout."""

    def __init__(self, path, errlog):
        env = {k: os.environ[k] for k in ("PYTHONPATH", "COWFS_ENGINE") if k in os.environ}
        self.proc = subprocess.Popen(
            [*COWFS, "mcp", "-C", str(path), "--as", "root"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errlog,
            env=env,
            cwd="/",
        )
        self.buf = b""
        self.ids = iter(range(1000, 2000))

    def send(self, line: bytes) -> None:
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            ready = left > 0 and select.select([self.proc.stdout], [], [], left)[0]
            assert ready, f"no answer within {timeout} s"
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            assert chunk, f"the server ended (exit status {self.proc.wait()})"
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def request(self, method: str, **params) -> dict:
        rid = next(self.ids)
        self.send(
            json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}).encode()
        )
        got = self.answer()
        assert got["id"] == rid, got
        return got

    def start(self) -> None:
        init = self.request(
            "initialize",
            protocolVersion="2025-06-18",
            capabilities={},
            clientInfo={"name": "raw", "version": "1"},
        )
        assert "result" in init, init
        self.send(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}')

    def tool(self, name: str, **args) -> dict:
        got = self.request("tools/call", name=name, arguments=args)
        assert not got["result"]["isError"], got
        return got["result"]["structuredContent"]

    def close(self) -> int:
        try:
            self.proc.stdin.close()
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


CHECKPOINT = (
    b'{"jsonrpc":"2.0","id":%s,"method":"tools/call",'
    b'"params":{"name":"checkpoint","arguments":{"message":%s}}}'
)
DEEP = 150  # arrays in arrays: over the 100 levels a message may nest, fine for the JSON parser

MALFORMED = [
    # (line, code, id): parse errors have id null
    (b"{bad", -32700, None),
    (b'{"jsonrpc": "2.0", "id": 1, "method": "ping"', -32700, None),
    (b"[" * 100_000 + b"]" * 100_000, -32700, None),
    (b'{"jsonrpc":"2.0","id":2,"method":"ping","params":{"a":"\xff"}}', -32700, None),
    (b'{"jsonrpc":"2.0","id":3,"method":"ping","params":{"a":NaN}}', -32700, None),
    # parsed, but no request to serve: the request's id when it has one
    (CHECKPOINT % (b"5", rb'"\ud800"'), -32600, 5),
    (CHECKPOINT % (b'"six"', rb'"a\udcffb"'), -32600, "six"),
    (b"1", -32600, None),
    (b'"a string"', -32600, None),
    (b"null", -32600, None),
    (b"[]", -32600, None),
    (b'[{"jsonrpc":"2.0","id":7,"method":"ping"}]', -32600, None),
    (b'{"id":8,"method":"ping"}', -32600, 8),
    (b'{"jsonrpc":"1.0","id":9,"method":"ping"}', -32600, 9),
    (b'{"jsonrpc":"2.0","id":10}', -32600, 10),
    (b'{"jsonrpc":"2.0","id":11,"method":["ping"]}', -32600, 11),
    (b'{"jsonrpc":"2.0","id":12,"method":"tools/call","params":"x"}', -32600, 12),
    (b'{"jsonrpc":"2.0","id":true,"method":"ping"}', -32600, None),
    (b'{"jsonrpc":"2.0","id":null,"method":"ping"}', -32600, None),
    (b'{"jsonrpc":"2.0","method":1}', -32600, None),
    (
        b'{"jsonrpc":"2.0","id":13,"method":"ping","params":{"a":%s}}'
        % (b"[" * DEEP + b"]" * DEEP),
        -32600,
        13,
    ),
]


@pytest.mark.parametrize("line, code, rid", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_line_gets_its_json_rpc_error_and_the_server_goes_on(
    mounted, tmp_path, line, code, rid
):
    errlog = (tmp_path / "server.err").open("w+")
    raw = Raw(mounted.path, errlog)
    try:
        raw.start()
        raw.send(line)
        got = raw.answer()
        assert got["jsonrpc"] == "2.0" and "result" not in got, got
        assert (got["id"], got["error"]["code"]) == (rid, code), got
        assert got["error"]["message"].startswith(
            "Parse error: " if code == -32700 else "Invalid Request: "
        )
        raw.send(b"")  # a blank line is no message: nothing answers it
        assert raw.request("ping") == {"jsonrpc": "2.0", "id": 1001, "result": {}}
        layer = raw.tool("checkpoint", message="after")["id"]
        assert [x["message"] for x in raw.tool("log")["layers"]] == ["base", "after"]
        assert layer == 2  # (the checkpoint refused above made none)
    finally:
        assert raw.close() == 0
    errlog.seek(0)
    assert "Traceback" not in errlog.read()


def test_a_line_over_1_mib_is_refused_with_its_id(mounted, tmp_path):
    errlog = (tmp_path / "server.err").open("w+")
    raw = Raw(mounted.path, errlog)

    def line(rid: int, size: int) -> bytes:
        empty = CHECKPOINT % (b"%d" % rid, b'""')
        return empty.replace(b'""}', b'"' + b"x" * (size - len(empty)) + b'"}')

    try:
        raw.start()
        raw.send(line(21, MAX_LINE + 1))
        got = raw.answer()
        assert (got["id"], got["error"]["code"]) == (21, -32600), got
        assert f"{MAX_LINE + 1:,} bytes" in got["error"]["message"]
        assert f"at most {MAX_LINE:,}" in got["error"]["message"]
        raw.send(line(22, 5_000_000))
        got = raw.answer()
        assert (got["id"], got["error"]["code"]) == (22, -32600), got
        raw.send(line(23, MAX_LINE))  # at the limit: served
        assert raw.answer()["id"] == 23
        assert len(raw.tool("log")["layers"]) == 2  # only the one at the limit
    finally:
        assert raw.close() == 0
    errlog.seek(0)
    assert "Traceback" not in errlog.read()


def test_a_5_mb_checkpoint_message_is_refused_to_the_sdk_client(mounted):
    async def steps(s):
        with pytest.raises(MCPError) as e:
            await s.call_tool("checkpoint", {"message": "m" * 5_000_000})
        assert e.value.code == -32600 and f"at most {MAX_LINE:,}" in e.value.message
        assert (await ok(s, "checkpoint", message="small"))["id"] == 2

    serve(mounted.path, steps)


def test_a_name_that_is_not_utf8_comes_back_with_its_bytes(mounted):
    os.close(os.open(os.fsencode(mounted.path) + b"/new\xfe", os.O_CREAT | os.O_WRONLY, 0o644))

    async def steps(s):
        [change] = (await ok(s, "status"))["changes"]
        assert change["path"] == "new\ufffd"  # (UTF-8 cannot carry the byte itself)
        assert base64.b64decode(change["path_bytes"]) == b"new\xfe"
        diff = await ok(s, "diff")
        assert 'diff --cowfs A "new\\376"' in diff["text"]
        assert base64.b64decode(diff["changes"][0]["path_bytes"]) == b"new\xfe"
        assert (await ok(s, "checkpoint", message="still serving"))["id"] == 2

    serve(mounted.path, steps)


def test_forks_through_mcp_make_run_adopt_and_drop(mounted):
    """A model makes two forks, runs a command in each (at the workspace's
    own path), sees the conflict its second adopt would make, and keeps
    one side."""
    from .test_forks import clear_forks

    async def steps(s):
        await ok(s, "fork", name="a", message="try a")
        await ok(s, "fork", name="b")
        ran = await ok(s, "run", command="echo A > a.txt && pwd", fork="a")
        assert ran["ok"] and ran["stdout"].strip() == str(mounted.path)
        await ok(s, "run", command="echo B > a.txt", fork="b")
        rows = (await s.call_tool("forks", {})).structured_content["result"]
        listed = {r["name"]: r for r in rows}
        assert listed["a"]["message"] == "try a" and listed["a"]["changes"] == 1
        adopted = await ok(s, "adopt", name="a")
        code, text = await fails(s, "adopt", name="b")
        assert code == 15 and "a.txt (fork: M, workspace: M)" in text, text
        await ok(s, "adopt", name="b", paths={"a.txt": "parent"})
        return adopted

    try:
        adopted = serve(mounted.path, steps)
        assert (mounted / "a.txt").read_text() == "A\n"
        assert adopted["layer"] == mounted.log()[-2]["id"]
        assert mounted.json("forks") == []
    finally:
        clear_forks(mounted.path)
