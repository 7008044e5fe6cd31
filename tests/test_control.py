"""The control channel under abuse: garbage, huge and stalled requests,
many concurrent clients, other users, and two mounts at once.

Everything goes through real mounts and the daemon's real Unix socket: the
protocol is one JSON request line, one JSON response line
(``{"ok": true, "result": {...}}`` or ``{"ok": false, "error": ..., "code": N}``).
A request the daemon cannot or must not serve gets an error answer or a
closed connection, never changes the stack, and never hurts the mount.
"""

from __future__ import annotations

import errno
import json
import os
import random
import selectors
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from cowfs.errors import NO_STORE, NOT_MOUNTED, NOT_OWNER, UNKNOWN_LAYER, USAGE
from cowfs.layers import treesnap
from cowfs.service import control
from cowfs.system.mounts import MountRecord, is_cowfs_mount, pid_alive, runtime_dir

from . import users
from .helpers import COWFS, Workspace, managed_workspace, plain

MiB = 1 << 20
OTHER_UID = 1234
CLOSED_ERRNOS = (errno.EPIPE, errno.ECONNRESET)


# -- talking to the daemon by hand ------------------------------------------------------


def record(ws: Workspace) -> MountRecord:
    rec = MountRecord.load(str(ws.path))
    assert rec is not None, f"no mount record for {ws.path}"
    return rec


def connect(path: str, timeout: float = 10.0) -> socket.socket:
    """A blocking connect (waits while the listen backlog is full), then
    *timeout* for everything else."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.settimeout(timeout)
    return s


def read_all(s: socket.socket) -> bytes:
    """Everything the daemon sends until it closes (a reset counts as closed)."""
    data = bytearray()
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        pass
    return bytes(data)


def exchange(path: str, payload: bytes, timeout: float = 10.0) -> bytes:
    """Send *payload*, end our side (so the daemon sees EOF instead of waiting
    for the rest of a line), and return what comes back before the close."""
    with connect(path, timeout) as s:
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except OSError as e:  # the daemon may close early (a request too long)
            if e.errno not in CLOSED_ERRNOS:
                raise
        return read_all(s)


def parse_answer(data: bytes) -> dict | None:
    """None for a closed connection; otherwise the one JSON line, checked
    for shape.  Raises AssertionError describing a malformed answer."""
    if not data:
        return None
    assert data.endswith(b"\n") and data.count(b"\n") == 1, (
        f"the answer is not exactly one line: {data[:300]!r}"
    )
    resp = json.loads(data)
    assert isinstance(resp, dict) and isinstance(resp.get("ok"), bool), (
        f"the answer is not a response object: {data[:300]!r}"
    )
    if not resp["ok"]:
        assert isinstance(resp.get("error"), str) and resp["error"], resp
        assert isinstance(resp.get("code"), int) and resp["code"] != 0, resp
    return resp


def stack_state(rec: MountRecord) -> list[dict]:
    """The whole stack as the daemon reports it (log), minus timings."""
    return control.call(rec, "log", timeout=30)["layers"]


def daemon_alive(ws: Workspace, pid: int) -> str | None:
    """Why the mount is not healthy, or None: same daemon, still mounted,
    record in place, and it answers a ping."""
    if not pid_alive(pid):
        return f"the daemon (pid {pid}) is gone"
    if not is_cowfs_mount(str(ws.path)):
        return f"{ws.path} is no longer mounted"
    rec = MountRecord.load(str(ws.path))
    if rec is None or rec.pid != pid:
        return f"the mount record changed: {rec}"
    try:
        got = control.call(rec, "ping", timeout=10)
    except Exception as e:
        return f"ping failed: {type(e).__name__}: {e}"
    if got.get("pid") != pid:
        return f"ping answered {got}"
    return None


def assert_mount_works(ws: Workspace, pid: int) -> None:
    """The full check after abuse: same daemon, file I/O through the mount,
    checkpoint / status / log through the CLI, and an exact rollback."""
    why = daemon_alive(ws, pid)
    assert why is None, why
    before = ws.snapshot()
    layer = ws.checkpoint("health check")
    probe = ws / "health-probe.bin"
    data = os.urandom(100_000)
    probe.write_bytes(data)
    assert probe.read_bytes() == data
    with open(ws / "a.txt", "a") as f:
        f.write("appended\n")
    assert {"path": "health-probe.bin", "kind": "A"} in plain(ws.status())
    assert ws.log()[-1]["id"] == layer
    for cmd in (["log"], ["status"]):  # the human forms must not crash either
        r = ws.cowfs(*cmd, check=False)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (
            f"cowfs {cmd[0]} exited {r.returncode}: {r.stderr.strip()}"
        )
    ws.rollback(to=layer)
    treesnap.assert_same(before, ws.snapshot())
    assert ws.daemon_pid() == pid and pid_alive(pid)


def brief(layers: list[dict]) -> str:
    """A stack in one line: id, message and runs of each layer."""
    return (
        "["
        + ", ".join(
            f"{layer['id']} {layer['message']!r}"
            + (f" runs={layer['runs']!r}" if layer.get("runs") else "")
            for layer in layers
        )
        + "]"
    )


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


# -- 1. garbage ----------------------------------------------------------------------------


def _random_payloads(base: int) -> list[tuple[str, bytes]]:
    rnd = random.Random(20260101)
    out = [
        ("nothing at all", b""),
        ("a bare newline", b"\n"),
        ("CRLF", b"\r\n"),
        ("spaces", b"   \n"),
        ("NULs", b"\0" * 64 + b"\n"),
        ("an unterminated object", b'{"op": "ping"'),
        ("a truncated object", b'{"op": "ping"\n'),
        ("trailing garbage after the object", b'{"op": "ping"} xyz\n'),
        ("two objects on one line", b'{"op": "ping"}{"op": "log"}\n'),
        ("invalid UTF-8", b"\xff\xfe\xfd\n"),
        ("invalid UTF-8 in a string", b'{"op": "ping\xff"}\n'),
        ("an overlong UTF-8 slash", b'{"op": "\xc0\xafping"}\n'),
        ("a lone surrogate escape", b'{"op": "\\ud800"}\n'),
        ("Python syntax", b"{'op': 'ping'}\n"),
    ]
    for size in (1, 7, 100, 4095, 65536, 65537, 300_000, MiB - 1, MiB + 100_000):
        body = rnd.randbytes(size)
        out.append((f"{size} random bytes", body))
        out.append((f"{size} random bytes and a newline", body + b"\n"))
        text = bytes(rnd.choice(b'{}[]":,01tfn \\') for _ in range(min(size, 200_000)))
        out.append((f"{len(text)} bytes of JSON punctuation and a newline", text + b"\n"))
    return out


NOT_OBJECTS = [
    ("an array", b'["op", "ping"]\n'),
    ("an empty array", b"[]\n"),
    ("a string", b'"ping"\n'),
    ("a number", b"42\n"),
    ("a float", b"1e999\n"),
    ("null", b"null\n"),
    ("true", b"true\n"),
    ("NaN", b"NaN\n"),
    ("an object without op", b'{"cmd": "ping"}\n'),
    ("an empty object", b"{}\n"),
    ("op null", b'{"op": null}\n'),
    ("op a number", b'{"op": 1}\n'),
    ("op a list", b'{"op": ["ping"]}\n'),
    ("op an object", b'{"op": {"ping": 1}}\n'),
    ("op true", b'{"op": true}\n'),
]

UNKNOWN_OPS = [
    ("an unknown op", b'{"op": "frobnicate"}\n'),
    ("an empty op", b'{"op": ""}\n'),
    ("op in capitals", b'{"op": "PING"}\n'),
    ("op with a space", b'{"op": "ping "}\n'),
    ("op with a NUL", b'{"op": "ping\\u0000"}\n'),
    ("op with its prefix", b'{"op": "op_ping"}\n'),
    ("a dunder op", b'{"op": "__init__"}\n'),
    ("a private method", b'{"op": "_connection"}\n'),
    ("another private method", b'{"op": "_flush"}\n'),
    ("the main loop", b'{"op": "_main"}\n'),
    ("an 800 KiB op", b'{"op": "' + b"x" * (800 << 10) + b'"}\n'),
]


def _bad_arguments(base: int) -> list[tuple[str, bytes]]:
    """Requests for real ops with wrong, missing or extra arguments.  *base*
    is the id of an existing layer below the top (a valid target)."""
    run = {"command": "true", "exit_status": 0, "outcome": "committed", "duration": 0.1}
    cases = [  # ordered so that one wrongly served cannot mask the next
        ("ping with an argument", {"op": "ping", "x": 1}),
        ("log with self", {"op": "log", "self": 1}),
        ("status with a layer", {"op": "status", "layer_id": base}),
        ("unmount with an extra argument", {"op": "unmount", "lazy": True, "now": 1}),
        ("commit with an argument", {"op": "commit", "into": base}),
        ("changes since a string", {"op": "changes", "since": "x"}),
        ("changes since a list", {"op": "changes", "since": []}),
        ("annotate without arguments", {"op": "annotate"}),
        ("annotate without run", {"op": "annotate", "layer": base}),
        ("annotate a string layer", {"op": "annotate", "layer": str(base), "run": run}),
        ("annotate an unknown layer", {"op": "annotate", "layer": 99999, "run": run}),
        ("annotate with a string run", {"op": "annotate", "layer": base, "run": "x"}),
        ("annotate with an empty run", {"op": "annotate", "layer": base, "run": {}}),
        ("checkpoint with an extra argument", {"op": "checkpoint", "message": "m", "force": True}),
        ("checkpoint with a numeric message", {"op": "checkpoint", "message": 5}),
        ("checkpoint with a list message", {"op": "checkpoint", "message": ["m"]}),
        ("checkpoint with an object message", {"op": "checkpoint", "message": {"m": 1}}),
        ("rollback with an extra argument", {"op": "rollback", "to": None, "force": 1}),
        ("rollback to a string", {"op": "rollback", "to": str(base)}),
        ("rollback to a fraction", {"op": "rollback", "to": base + 0.5}),
        ("rollback to -1", {"op": "rollback", "to": -1}),
        ("rollback to 2**64", {"op": "rollback", "to": 1 << 64}),
        ("rollback to an unknown layer", {"op": "rollback", "to": 99999}),
        ("rollback to a list", {"op": "rollback", "to": [base]}),
        ("rollback to an object", {"op": "rollback", "to": {"id": base}}),
    ]
    out = [(name, json.dumps(req).encode() + b"\n") for name, req in cases]
    out += [
        ("rollback to NaN", b'{"op": "rollback", "to": NaN}\n'),
        ("rollback to Infinity", b'{"op": "rollback", "to": Infinity}\n'),
        ("rollback to a 5000-digit number", b'{"op": "rollback", "to": ' + b"9" * 5000 + b"}\n"),
    ]
    # last: served, it would drop every layer
    out.append(("rollback to true", b'{"op": "rollback", "to": true}\n'))
    return out


DEEP = 100_000  # far beyond Python's recursion limit, far below MAX_REQUEST

GROUPS = {
    "random-bytes": (_random_payloads, (USAGE,)),
    "not-an-object": (lambda base: NOT_OBJECTS, (USAGE,)),
    "unknown-op": (lambda base: UNKNOWN_OPS, (USAGE,)),
    "bad-arguments": (_bad_arguments, (USAGE, UNKNOWN_LAYER)),
    # each on its own mount: one that kills the daemon cannot hide the others
    "nested-arrays": (
        lambda base: [("deeply nested arrays", b"[" * DEEP + b"]" * DEEP + b"\n")],
        (USAGE,),
    ),
    "nested-argument": (
        lambda base: [
            (
                "a deeply nested argument",
                b'{"op": "ping", "x": ' + b"[" * DEEP + b"]" * DEEP + b"}\n",
            )
        ],
        (USAGE,),
    ),
    "nested-objects": (
        lambda base: [("deeply nested objects", b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"\n")],
        (USAGE,),
    ),
}


@pytest.mark.parametrize("group", GROUPS)
def test_garbage_gets_an_error_or_a_close_and_the_mount_keeps_working(mounted, group):
    """Each request of the group gets an error answer with the documented
    code (or a closed connection), changes neither the stack nor the tree,
    and leaves the same daemon serving; afterwards the mount works fully."""
    ws = mounted
    rec, pid = record(ws), ws.daemon_pid()
    # a stack with something to lose: two layers, changes in both
    base = ws.checkpoint("below")
    (ws / "in-below").write_text("below\n")
    ws.checkpoint("top")
    (ws / "a.txt").write_text("changed on top\n")
    make, codes = GROUPS[group]
    payloads = make(base)

    problems: list[str] = []
    tree, state = ws.snapshot(), stack_state(rec)
    for name, payload in payloads:
        t0 = time.monotonic()
        try:
            data = exchange(rec.socket, payload)
        except Exception as e:
            problems.append(f"{name}: the exchange failed: {type(e).__name__}: {e}")
            data = b""
        took = time.monotonic() - t0
        why = daemon_alive(ws, pid)
        if why is not None:
            time.sleep(2)  # (only for the failure's message: what it is 2 s later)
            later = daemon_alive(ws, pid)
            raise AssertionError(
                f"after sending {name} ({len(payload)} bytes): {why}"
                + (f"; 2 s later: {later}" if later and later != why else "")
                + "".join(f"\n  earlier: {p}" for p in problems)
            )
        if took > 5:
            problems.append(f"{name}: took {took:.1f} s")
        try:
            resp = parse_answer(data)
        except (AssertionError, ValueError) as e:
            problems.append(f"{name}: {e}")
            resp = None
        if resp is not None:
            if resp["ok"]:
                problems.append(f"{name}: served: {json.dumps(resp)[:300]}")
            elif resp["code"] not in codes:
                problems.append(
                    f"{name}: answered code {resp['code']} "
                    f"(expected one of {codes}): {resp['error'][:200]}"
                )
        new_tree, new_state = ws.snapshot(), stack_state(rec)
        if new_state != state:
            problems.append(f"{name}: the stack changed: {brief(state)} -> {brief(new_state)}")
        diffs = treesnap.compare(tree, new_tree)
        if diffs:
            problems.append(f"{name}: the tree changed: {diffs[:5]}")
        tree, state = new_tree, new_state
    try:
        assert_mount_works(ws, pid)
    except AssertionError as e:
        problems.append(f"after all requests the mount does not work: {e}")
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


def test_valid_requests_in_odd_framing_are_served(mounted):
    """The positive control for the garbage tests: a request split across
    writes, with trailing bytes after its newline, or with spaces, is served."""
    ws = mounted
    rec, pid = record(ws), ws.daemon_pid()
    with connect(rec.socket) as s:
        for piece in (b'{"o', b'p": "pi', b'ng"', b"}", b"\n"):
            s.sendall(piece)
            time.sleep(0.05)  # the pause is what is tested: each piece its own read
        resp = parse_answer(read_all(s))
    assert resp == {"ok": True, "result": resp["result"]} and resp["result"]["pid"] == pid
    resp = parse_answer(exchange(rec.socket, b'  {"op": "ping"}  \nignored garbage \xff'))
    assert resp["ok"] and resp["result"]["pid"] == pid
    resp = parse_answer(exchange(rec.socket, b'{"op": "checkpoint", "message": "x\\ny"}\n'))
    assert resp["ok"] and resp["result"]["message"] == "x\ny"
    assert ws.log()[-1]["message"] == "x\ny"


# -- 2. a huge request ----------------------------------------------------------------------


def stream(
    path: str, total: int, prefix: bytes = b"", suffix: bytes = b"", budget: float = 30.0
) -> dict:
    """Stream *prefix*, *total* filler bytes and *suffix* as one message;
    report how far it got, how the daemon reacted and how long it took."""
    t0 = time.monotonic()
    block = b"a" * MiB
    sent, err = 0, None
    s = connect(path, timeout=budget)
    with s:
        try:
            s.sendall(prefix)
            while sent < total:
                s.sendall(block[: total - sent])
                sent += min(MiB, total - sent)
            s.sendall(suffix)
            s.shutdown(socket.SHUT_WR)
        except TimeoutError:
            err = "timeout"
        except OSError as e:
            if e.errno not in CLOSED_ERRNOS:
                raise
            err = errno.errorcode[e.errno]
        try:
            data = read_all(s)
        except TimeoutError:
            data, err = b"", "timeout reading the answer"
    return {"sent": sent, "err": err, "data": data, "took": time.monotonic() - t0}


def test_a_100_mib_request_is_refused_quickly_in_bounded_memory(mounted):
    ws = mounted
    rec, pid = record(ws), ws.daemon_pid()
    ws.checkpoint("before the flood")
    state, tree = stack_state(rec), ws.snapshot()
    rss0 = rss_kib(pid)
    try:  # reset the peak so VmHWM measures only what follows
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        peak_known = True
    except OSError:
        peak_known = False

    big = 100 * MiB
    results = {
        "100 MiB without a newline": stream(rec.socket, big),
        "100 MiB and a newline": stream(rec.socket, big, suffix=b"\n"),
        "a 100 MiB checkpoint message": stream(
            rec.socket, big, prefix=b'{"op": "checkpoint", "message": "', suffix=b'"}\n'
        ),
    }
    parallel: dict[int, dict] = {}

    def flood(i: int) -> None:
        parallel[i] = stream(rec.socket, big, suffix=b"\n" if i % 2 else b"")

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    results |= {f"100 MiB from 4 clients at once (#{i})": r for i, r in parallel.items()}
    assert len(parallel) == 4, "a flooding client hung"

    for name, r in results.items():
        assert r["took"] < 20, f"{name}: took {r['took']:.1f} s ({r})"
        assert r["err"] in (None, "EPIPE", "ECONNRESET"), f"{name}: {r['err']}"
        resp = parse_answer(r["data"])
        assert resp is None or not resp["ok"], f"{name}: served: {r['data'][:300]!r}"
    rss1 = rss_kib(pid)
    grown = (rss1 - rss0) // 1024
    assert grown < 50, f"the daemon's RSS grew by {grown} MiB ({rss0} -> {rss1} KiB)"
    if peak_known:
        peak = (rss_kib(pid, "VmHWM") - rss0) // 1024
        assert peak < 50, f"the daemon's RSS peaked {peak} MiB above where it started"
    assert stack_state(rec) == state
    treesnap.assert_same(tree, ws.snapshot())
    assert_mount_works(ws, pid)


# -- 3. stalled clients -------------------------------------------------------------------------


def test_stalled_clients_do_not_block_others_and_are_closed(mounted):
    ws = mounted
    rec, pid = record(ws), ws.daemon_pid()
    state = stack_state(rec)
    t0 = time.monotonic()
    stalled: list[tuple[str, socket.socket]] = []
    others: list[socket.socket] = []
    try:
        for i in range(100):  # more than the listen backlog (64)
            stalled.append((f"silent #{i}", connect(rec.socket)))
        half = connect(rec.socket)
        half.sendall(b'{"op": "checkpoint", "message": "half a li')
        stalled.append(("half a line", half))
        slow = connect(rec.socket)
        others.append(slow)
        slow.sendall(b'{"op": "pi')

        # meanwhile, everybody else is served promptly
        t = time.monotonic()
        layer = ws.checkpoint("while stalled")
        took = time.monotonic() - t
        assert took < 5, f"a checkpoint took {took:.1f} s while clients stalled"
        t = time.monotonic()
        (ws / "during-stall").write_text("x\n")
        assert plain(ws.status()) == [{"path": "during-stall", "kind": "A"}]
        for _ in range(10):
            control.call(rec, "ping", timeout=5)
        took = time.monotonic() - t
        assert took < 5, f"file I/O, status and 10 pings took {took:.1f} s"
        # a slow client that does finish its line is served
        time.sleep(1)  # the slowness is what is tested
        slow.sendall(b'ng"}\n')
        resp = parse_answer(read_all(slow))
        slow.close()
        assert resp is not None and resp["ok"] and resp["result"]["pid"] == pid

        # the stalled connections are closed by the daemon (its read timeout is 30 s)
        sel = selectors.DefaultSelector()
        for name, s in stalled:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, name)
        deadline = t0 + 36
        open_ = {name for name, _ in stalled}
        while open_ and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
                try:
                    data = key.fileobj.recv(65536)
                except ConnectionResetError:
                    data = b""
                except BlockingIOError:
                    continue
                if data:
                    resp = parse_answer(data)  # an error answer is all right
                    assert resp is not None and not resp["ok"], (
                        f"{key.data}: served: {data[:300]!r}"
                    )
                    continue
                sel.unregister(key.fileobj)
                open_.discard(key.data)
        sel.close()
        assert not open_, (
            f"{len(open_)} stalled connections still open "
            f"{time.monotonic() - t0:.0f} s after connecting: "
            f"{sorted(open_)[:5]}"
        )
    finally:
        for s in [s for _, s in stalled] + others:
            s.close()
    # the half line never ran, the checkpoint made meanwhile is there
    assert [layer_["id"] for layer_ in stack_state(rec)] == [x["id"] for x in state] + [layer]
    assert all("half" not in str(layer_["message"]) for layer_ in stack_state(rec))
    assert_mount_works(ws, pid)


# -- 4. many clients at once -----------------------------------------------------------------


def test_fifty_concurrent_clients_are_all_answered_correctly(mounted):
    ws = mounted
    rec, pid = record(ws), ws.daemon_pid()
    before_tree = ws.snapshot()
    before_ids = [layer["id"] for layer in ws.log()]
    n = 50
    barrier = threading.Barrier(n)
    results: dict[int, dict] = {}
    failures: dict[int, str] = {}

    def client(i: int) -> None:
        try:
            barrier.wait(30)
            st = control.call(rec, "status", timeout=60)
            lg = control.call(rec, "log", timeout=60)
            cp = control.call(rec, "checkpoint", timeout=60, message=f"client {i}")
            (ws / f"from-client-{i}").write_text(f"{i}\n")
            st2 = control.call(rec, "status", timeout=60)
            results[i] = {"status": st, "log": lg, "checkpoint": cp, "status2": st2}
        except Exception as e:
            failures[i] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    took = time.monotonic() - t0
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not failures, failures
    assert len(results) == n

    ids = sorted(r["checkpoint"]["id"] for r in results.values())
    first = before_ids[-1] + 1
    assert ids == list(range(first, first + n)), f"layer ids not unique and consecutive: {ids}"
    for i, r in results.items():
        cp = r["checkpoint"]
        assert cp["message"] == f"client {i}" and isinstance(cp["daemon_ms"], float)
        # the top a client sees after its own checkpoint is its layer or a later one
        assert r["status2"]["id"] >= cp["id"]
        assert isinstance(r["status"]["changes"], list)
        assert r["status"]["id"] in [before_ids[-1], *ids]
        seen = [layer["id"] for layer in r["log"]["layers"]]
        assert seen == list(range(seen[0], seen[0] + len(seen)))
        assert seen[: len(before_ids)] == before_ids
    log = ws.log()
    assert [layer["id"] for layer in log] == before_ids + ids
    by_id = {r["checkpoint"]["id"]: f"client {i}" for i, r in results.items()}
    assert {layer["id"]: layer["message"] for layer in log[len(before_ids) :]} == by_id
    # since the burst began: exactly the files the clients created
    net = control.call(rec, "changes", since=first)["changes"]
    assert sorted(plain(net), key=lambda c: c["path"]) == sorted(
        ({"path": f"from-client-{i}", "kind": "A"} for i in range(n)), key=lambda c: c["path"]
    )
    assert ws.daemon_pid() == pid
    ws.rollback(to=first)
    treesnap.assert_same(before_tree, ws.snapshot())
    assert [layer["id"] for layer in ws.log()] == before_ids
    assert took < 60, f"50 clients took {took:.1f} s"
    assert_mount_works(ws, pid)


def test_clients_beyond_the_listen_backlog_wait_their_turn(mounted):
    """More clients than the daemon's listen backlog (64) arrive while the
    daemon cannot accept for a moment (here: SIGSTOP for one second; in
    life, a long rollback running on its loop).  The real client has a 60 s
    timeout: it must wait its turn, not fail at once."""
    ws = mounted
    rec, pid = record(ws), ws.daemon_pid()
    n = 200
    failures: list[str] = []
    answered = []

    def client() -> None:
        try:
            answered.append(control.call(rec, "ping", timeout=60)["pid"])
        except Exception as e:
            failures.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client) for _ in range(n)]
    os.kill(pid, signal.SIGSTOP)
    try:
        for t in threads:
            t.start()
        time.sleep(1)  # the stall is what is tested: clients meet a stopped daemon
    finally:
        os.kill(pid, signal.SIGCONT)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not failures, f"{len(failures)} of {n} clients failed, e.g. {failures[0]}"
    assert answered == [pid] * n
    assert_mount_works(ws, pid)


# -- 5. other users ------------------------------------------------------------------------------


def as_other_user(path: str, payloads: list[bytes], uid: int = OTHER_UID) -> list[dict]:
    """In a forked child running as *uid*: connect to *path* once per payload,
    send it, read the answer.  One dict per payload: connect_errno, or the
    answer's bytes (latin-1) and any send/recv errno."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = []
            for payload in payloads:
                item: dict = {}
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(10)
                try:
                    s.connect(path)
                except OSError as e:
                    item["connect_errno"] = e.errno
                else:
                    try:
                        s.sendall(payload)
                        s.shutdown(socket.SHUT_WR)
                    except OSError as e:
                        item["send_errno"] = e.errno
                    data = b""
                    try:
                        while chunk := s.recv(65536):
                            data += chunk
                    except OSError as e:
                        item["recv_errno"] = e.errno
                    item["data"] = data.decode("latin-1")
                s.close()
                out.append(item)
            os.write(w, json.dumps({"uid": os.getuid(), "items": out}).encode())
        except BaseException as e:
            os.write(w, json.dumps({"child_error": repr(e)}).encode())
        finally:
            os._exit(0)
    os.close(w)
    buf = b""
    with os.fdopen(r, "rb") as f:
        buf = f.read()
    os.waitpid(child, 0)
    res = json.loads(buf)
    assert "child_error" not in res, res
    assert res["uid"] == uid
    return res["items"]


def test_another_user_is_refused(mounted):
    ws = mounted
    rec, pid = record(ws), ws.daemon_pid()
    ws.checkpoint("mine")
    (ws / "a.txt").write_text("mine\n")
    state, tree = stack_state(rec), ws.snapshot()
    requests = [
        b'{"op": "checkpoint", "message": "intruder"}\n',
        b'{"op": "rollback", "to": null}\n',
        b'{"op": "commit"}\n',
        b'{"op": "annotate", "layer": 1, "run": {}}\n',
        b'{"op": "unmount", "lazy": true}\n',
        b'{"op": "ping"}\n',
    ]

    # the runtime directory alone keeps other users out
    rdir = os.path.dirname(rec.socket)
    assert rdir == runtime_dir()
    assert stat.S_IMODE(os.stat(rdir).st_mode) == 0o700 and os.stat(rdir).st_uid == 0
    assert stat.S_IMODE(os.stat(rec.socket).st_mode) & 0o077 == 0
    for item in as_other_user(rec.socket, requests):
        assert item.get("connect_errno") == errno.EACCES, item

    # past the directory (a hard link to the socket in a world-searchable
    # directory, the socket itself made writable for everybody), SO_PEERCRED
    # must still refuse: this leaves the shared runtime directory alone
    mode = stat.S_IMODE(os.stat(rec.socket).st_mode)
    linkdir = tempfile.mkdtemp(prefix="cowfs-ctl-test-", dir=os.path.dirname(rdir))
    link = os.path.join(linkdir, "s")
    try:
        os.chmod(linkdir, 0o755)
        os.link(rec.socket, link)
        os.chmod(link, 0o666)
        items = as_other_user(link, requests)
    finally:
        os.chmod(rec.socket, mode)
        try:
            os.unlink(link)
        except FileNotFoundError:
            pass
        os.rmdir(linkdir)
    assert stat.S_IMODE(os.stat(rec.socket).st_mode) == mode
    for req, item in zip(requests, items, strict=False):
        assert "connect_errno" not in item, (req, item)  # it did reach the daemon
        resp = parse_answer(item["data"].encode("latin-1"))
        assert resp is None or (
            not resp["ok"]
            and resp["code"] == NOT_OWNER
            and "belongs to another user (uid 0)" in resp["error"]
        ), (req, item)
    assert any(item["data"] for item in items), "no refusal was ever answered"
    why = daemon_alive(ws, pid)
    assert why is None, why
    assert stack_state(rec) == state
    treesnap.assert_same(tree, ws.snapshot())
    assert_mount_works(ws, pid)


def cli_as_other_user(cwd: Path, args: list[str], uid: int = OTHER_UID) -> tuple[int, str, str]:
    """The cowfs command's main() run by *uid* in *cwd*."""

    return users.cowfs_as(uid, uid, cwd, args)


@pytest.fixture
def reachable(fuse):
    """A workspace in a directory other users can reach (tmp_path's are not)."""
    base = Path(tempfile.mkdtemp(prefix="cowfs-test-"))
    os.chmod(base, 0o755)
    try:
        with managed_workspace(base / "ws") as ws:
            (ws / "a.txt").write_text("alpha\n")
            ws.mount()
            yield ws
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


def test_another_users_commands_say_whose_workspace_it_is(reachable):
    """Not "the daemon is gone; run cowfs mount": the workspace belongs to
    someone else, with its own exit code -- mounted or not."""
    ws = reachable
    os.chmod(ws.path, 0o755)
    tree = ws.snapshot()
    for args in (["status"], ["-C", ".", "rollback"], ["--json", "log"], ["checkpoint"]):
        code, out, err = cli_as_other_user(ws.path, args)
        assert code == NOT_OWNER, (args, code, out, err)
        assert (
            f"mounted at {ws.path} belongs to another user (uid 0); only that user or "
            "root may control it" in err
        ), err
        assert "cowfs mount" not in err
    assert json.loads(cli_as_other_user(ws.path, ["--json", "status"])[1])["code"] == NOT_OWNER
    ws.unmount()
    code, _, err = cli_as_other_user(ws.path, ["status"])
    assert code == NOT_OWNER and "store" in err and "belongs to another user (uid 0)" in err, err
    treesnap.assert_same(tree, ws.snapshot())


# -- 6. two workspaces -----------------------------------------------------------------------------


@pytest.fixture
def second(tmp_path):
    with managed_workspace(tmp_path / "ws2") as ws:  # "ws" is a prefix of it on purpose
        yield ws


def cowfs_in(cwd: Path, *args) -> subprocess.CompletedProcess:
    """The real command run from *cwd*, without -C."""
    return subprocess.run(
        [*COWFS, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_two_workspaces_are_controlled_independently(workspace, second, tmp_path):
    one, two = workspace, second
    for ws, tag in ((one, "one"), (two, "two")):
        (ws / "deep" / "er" / "still").mkdir(parents=True)
        (ws / "deep" / "er" / "still" / "f.txt").write_text(f"{tag}\n")
        (ws / "top.txt").write_text(f"{tag}\n")
        ws.mount()
    r1, r2 = record(one), record(two)
    assert r1.pid != two.daemon_pid() and r1.socket != r2.socket
    assert control.call(r1, "ping")["workspace"] == str(one.path)
    assert control.call(r2, "ping")["workspace"] == str(two.path)

    deep1 = one / "deep" / "er" / "still"
    deep2 = two / "deep" / "er" / "still"
    start1, start2 = one.snapshot(), two.snapshot()

    # -C with paths nested inside each (a directory, a file) picks the right one
    id1 = json.loads(
        subprocess.run(
            [*COWFS, "-C", str(deep1), "--json", "checkpoint", "-m", "in one"],
            capture_output=True,
            text=True,
        ).stdout
    )["id"]
    id2 = json.loads(
        subprocess.run(
            [*COWFS, "-C", str(deep2 / "f.txt"), "--json", "checkpoint", "-m", "in two"],
            capture_output=True,
            text=True,
        ).stdout
    )["id"]
    assert one.log()[-1]["message"] == "in one" and two.log()[-1]["message"] == "in two"
    assert "in two" not in [layer["message"] for layer in one.log()]
    assert "in one" not in [layer["message"] for layer in two.log()]

    (deep1 / "f.txt").write_text("one, changed\n")
    (one / "only-in-one").write_text("1\n")
    (deep2 / "new-in-two").write_text("2\n")
    os.unlink(two / "top.txt")
    # without -C: the working directory decides
    r = cowfs_in(deep1, "--json", "status")
    assert r.returncode == 0, r.stderr
    assert sorted(c["path"] for c in json.loads(r.stdout)["changes"]) == [
        "deep/er/still/f.txt",
        "only-in-one",
    ]
    r = cowfs_in(deep2, "--json", "status")
    assert r.returncode == 0, r.stderr
    assert sorted(c["path"] for c in json.loads(r.stdout)["changes"]) == [
        "deep/er/still/new-in-two",
        "top.txt",
    ]
    r = cowfs_in(tmp_path, "status")  # (in no workspace: no store, none made)
    assert r.returncode == NO_STORE, r.stderr

    # concurrent checkpoints in both: each stack counts on its own
    got: dict[str, list[int]] = {"one": [], "two": []}

    def burst(rec: MountRecord, key: str) -> None:
        for i in range(10):
            got[key].append(control.call(rec, "checkpoint", message=f"{key} {i}")["id"])

    ts = [
        threading.Thread(target=burst, args=(r1, "one")),
        threading.Thread(target=burst, args=(r2, "two")),
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert got["one"] == list(range(id1 + 1, id1 + 11)), got
    assert got["two"] == list(range(id2 + 1, id2 + 11)), got

    # rolling one back leaves the other alone
    live2 = two.snapshot()
    log2 = two.log()
    r = cowfs_in(deep1, "--json", "rollback", "--to", id1)
    assert r.returncode == 0, r.stderr
    treesnap.assert_same(start1, one.snapshot())
    treesnap.assert_same(live2, two.snapshot())
    assert two.log() == log2
    # and the other way round
    live1 = one.snapshot()
    log1 = one.log()
    r = subprocess.run(
        [*COWFS, "-C", str(deep2), "rollback", "--to", str(id2)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    treesnap.assert_same(start2, two.snapshot())
    treesnap.assert_same(live1, one.snapshot())
    assert one.log() == log1

    # unmounting one leaves the other working
    pid2 = two.daemon_pid()
    one.unmount()
    r = one.cowfs("checkpoint", check=False)
    assert r.returncode == NOT_MOUNTED, r.stderr
    assert one.json("status")["mounted"] is False  # read from its store directly
    assert_mount_works(two, pid2)


def test_a_request_over_the_limit_is_refused_with_a_reason(mounted):
    """A 5 MB checkpoint message: a usage error saying why (exit 2), not a
    broken pipe; and a raw request over the limit gets an answer too."""
    from cowfs.errors import USAGE, CowfsError
    from cowfs.interface.api import Workspace

    ws = Workspace.attach(str(mounted.path))
    with pytest.raises(CowfsError) as e:
        ws.checkpoint("m" * (5 << 20))
    assert e.value.code == USAGE and "too large" in str(e.value)
    r = stream(ws.record.socket, 2 * MiB)
    resp = parse_answer(r["data"])
    assert resp is not None and resp["code"] == USAGE and "larger than" in resp["error"], r
    assert ws.checkpoint("small") > 0
