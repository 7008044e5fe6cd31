"""Deadlines on the control channel, on real mounts: a daemon that is
stopped (SIGSTOP) makes every command -- and a second mount, and the API --
fail within the deadline ($COWFS_DEADLINE) with exit code 5 naming its pid,
never hang, and loses nothing; a daemon that is busy for longer than the
deadline (a rollback whose helper process is held, a provider that takes
its time) is waited for, because it keeps sending signs of life."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from cowfs.errors import NOT_ANSWERING, USAGE, NotAnswering
from cowfs.interface.api import Workspace as ApiWorkspace
from cowfs.layers import treesnap
from cowfs.service import control
from cowfs.system.mounts import MountRecord, stopped

from .helpers import COWFS, Workspace, helper_of

DEADLINE = 1.5  # seconds ($COWFS_DEADLINE in these tests)
BOUND = 20.0  # a command that meets a stopped daemon ends within this (or it hangs)


@contextlib.contextmanager
def held(pid: int) -> Iterator[None]:
    """Process *pid* stopped (SIGSTOP) while the block runs; always
    continued (SIGCONT) afterwards, before the fixture unmounts."""
    os.kill(pid, signal.SIGSTOP)
    try:
        while not stopped(pid):
            time.sleep(0.01)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def start(args: list, env: dict | None = None) -> subprocess.Popen:
    """The real ``cowfs`` command, with $COWFS_DEADLINE short."""
    return subprocess.Popen(
        [*COWFS, *map(str, args)],
        env=os.environ | {"COWFS_DEADLINE": str(DEADLINE)} | (env or {}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(proc: subprocess.Popen, within: float) -> tuple[int, str, str] | None:
    """(exit status, stdout, stderr) of *proc* if it ends within *within*
    seconds; None if it hangs (it is killed then, and reaped once whatever
    it waits for goes on: a process waiting on a stopped FUSE daemon may
    not even die before)."""
    try:
        out, err = proc.communicate(timeout=max(0.0, within))
    except subprocess.TimeoutExpired:
        proc.kill()
        return None
    return proc.returncode, out, err


def in_time(fn: Callable[[], object], within: float) -> tuple[object, BaseException | None]:
    """fn() on a thread: (its result, the exception it raised); fails the
    test if it has not returned within *within* seconds (the thread stays
    until what it waits for goes on)."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(within)
    assert not t.is_alive(), f"still waiting after {within:.0f} s: it hangs"
    return box.get("result"), box.get("error")


def layered(ws: Workspace) -> None:
    """A stack with something in every layer and a rollback to redo."""
    ws.checkpoint("two")
    (ws / "a.txt").write_text("changed in two\n")
    ws.checkpoint("three")
    (ws / "new.txt").write_text("new in three\n")
    ws.checkpoint("four")
    (ws / "dir" / "b.txt").write_text("changed in four\n")
    ws.rollback()  # (four: there is a rollback to redo)


COMMANDS = {
    "status": ["status"],
    "status in a directory": ["-C", "{ws}/dir", "status"],
    "json status": ["--json", "status"],
    "checkpoint": ["checkpoint", "-m", "x"],
    "rollback": ["rollback", "--yes"],
    "redo": ["redo"],
    "commit": ["commit"],
    "gc": ["gc"],
    "log": ["log"],
    "unmount": ["unmount"],
}


def test_a_stopped_daemon_is_reported_by_every_command_and_loses_nothing(mounted):
    ws = mounted
    layered(ws)
    pid = ws.daemon_pid()
    assert pid is not None
    stack, tree = ws.log(), ws.snapshot()
    procs: dict[str, subprocess.Popen] = {}
    results: dict[str, tuple[int, str, str] | None] = {}
    with held(pid):
        t0 = time.monotonic()
        for name, args in COMMANDS.items():
            args = [a.format(ws=ws.path) for a in args]
            procs[name] = start(args if args[0] == "-C" else ["-C", ws.path, *args])
        procs["mount"] = start(["mount", ws.path])
        for name, proc in procs.items():
            results[name] = finished(proc, t0 + BOUND - time.monotonic())
        took = time.monotonic() - t0
    for proc in procs.values():
        proc.communicate(timeout=60)  # (reaped, now that it may end)
    hung = sorted(name for name, r in results.items() if r is None)
    assert not hung, f"these hung on a stopped daemon: {', '.join(hung)}"
    for name, r in results.items():
        assert r is not None
        code, out, err = r
        assert code == NOT_ANSWERING, f"{name}: exit {code}: {err}"
        lines = err.strip().splitlines()
        assert len(lines) == 1, f"{name}: not one line: {err!r}"
        assert f"daemon {pid} of {ws.path} does not answer (it is stopped)" in lines[0], name
        assert f"'kill -CONT {pid}'" in lines[0] and f"'cowfs mount {ws.path}'" in lines[0]
    assert json.loads(results["json status"][1]) == {  # type: ignore[index]
        "error": results["json status"][2].strip().removeprefix("cowfs: "),  # type: ignore[index]
        "code": NOT_ANSWERING,
        "pid": pid,
        "mountpoint": str(ws.path),
    }
    assert took < BOUND
    # continued: the same daemon answers, and nothing was lost or changed
    assert ws.daemon_pid() == pid
    assert ws.log() == stack
    treesnap.assert_same(tree, ws.snapshot())
    assert ws.json("redo")["restored"]
    assert (ws / "dir" / "b.txt").read_text() == "changed in four\n"
    ws.rollback(to=2)
    assert (ws / "a.txt").read_text() == "alpha\n" and not (ws / "new.txt").exists()


def test_the_deadline_is_what_cowfs_deadline_says(mounted):
    ws = mounted
    pid = ws.daemon_pid()
    assert pid is not None
    for bad in ("soon", "0", "-1", "inf", "nan"):
        r = finished(start(["-C", ws.path, "status"], {"COWFS_DEADLINE": bad}), 60)
        assert r is not None and r[0] == USAGE and "COWFS_DEADLINE" in r[2], (bad, r)
    with held(pid):
        t0 = time.monotonic()
        r = finished(start(["-C", ws.path, "status"], {"COWFS_DEADLINE": "4"}), BOUND)
        took = time.monotonic() - t0
    assert r is not None and r[0] == NOT_ANSWERING and "waited 4 s" in r[2], r
    assert took >= 4


def test_the_api_raises_not_answering(mounted, monkeypatch):
    ws = mounted
    pid = ws.daemon_pid()
    assert pid is not None
    api = ApiWorkspace.attach(ws.path)
    api.checkpoint("two")
    (ws / "a.txt").write_text("changed\n")
    stack = ws.log()
    monkeypatch.setenv("COWFS_DEADLINE", str(DEADLINE))
    with held(pid):
        # on the control socket (the workspace was attached before)
        t0 = time.monotonic()
        _, e1 = in_time(api.status, BOUND)
        took = time.monotonic() - t0
        _, e2 = in_time(api.rollback, BOUND)
        # attaching to it (the path is not even looked at), mounting it again
        _, e3 = in_time(lambda: ApiWorkspace.attach(ws.path / "dir"), BOUND)
        _, e4 = in_time(lambda: ApiWorkspace.mount(ws.path), BOUND + 10)
    for err in (e1, e2, e3, e4):
        assert isinstance(err, NotAnswering), repr(err)
        assert err.code == NOT_ANSWERING and err.pid == pid and err.mountpoint == str(ws.path)
        assert f"daemon {pid} of {ws.path} does not answer" in str(err)
    assert DEADLINE <= took < BOUND
    # the rollback it gave up on is not carried out once the daemon goes on
    assert api.status().layer == 2 and ws.log() == stack
    assert (ws / "a.txt").read_text() == "changed\n"


def test_a_full_listen_queue_of_a_stopped_daemon_is_not_waited_on(mounted, monkeypatch):
    """connect(2) waits while the socket's listen queue is full: a stopped
    daemon accepts nothing, so the client bounds that wait too."""
    ws = mounted
    pid = ws.daemon_pid()
    rec = MountRecord.load(str(ws.path))
    assert pid is not None and rec is not None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = socket.SOMAXCONN + 200
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"needs {need} descriptors (the hard limit is {hard})")
    monkeypatch.setenv("COWFS_DEADLINE", str(DEADLINE))
    queued: list[socket.socket] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    try:
        with held(pid):
            while True:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(rec.socket)
                except BlockingIOError:  # (the queue is full)
                    s.close()
                    break
                queued.append(s)
            assert len(queued) > 64
            _, e = in_time(lambda: control.call(rec, "ping"), BOUND)
        assert isinstance(e, NotAnswering) and e.pid == pid, repr(e)
    finally:
        for s in queued:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert control.call(rec, "ping")["pid"] == pid


def test_a_long_rollback_is_waited_for_and_heard_from(mounted, monkeypatch):
    """A rollback that takes far longer than the deadline while the daemon's
    loop is held (it waits, synchronously, for its helper process: held
    here with SIGSTOP, as a slow disk would hold it): a client is sent a
    space every BEAT seconds until the answer, so neither it nor a request
    queued behind it (its connection not even taken by the loop) gives up."""
    ws = mounted
    pid = ws.daemon_pid()
    rec = MountRecord.load(str(ws.path))
    assert pid is not None and rec is not None
    ws.checkpoint("many")
    for i in range(200):
        (ws / f"f{i}").write_text(f"{i}\n")
    ws.checkpoint("more")
    for i in range(200):
        (ws / f"g{i}").write_text(f"{i}\n")
    monkeypatch.setenv("COWFS_DEADLINE", "1")
    queued: dict = {}
    with held(helper_of(ws)):
        # by hand: the answer comes after spaces
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(rec.socket)
        raw.sendall(json.dumps({"op": "rollback"}).encode() + b"\n")
        raw.settimeout(3 * control.BEAT)
        got = b""
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3:
            got += raw.recv(1)  # (a timeout here: no sign of life)
        assert got and got.strip() == b"", got
        # queued behind it: a client (no deadline but $COWFS_DEADLINE) and
        # the command line
        behind = threading.Thread(
            target=lambda: queued.update(log=control.call(rec, "log")), daemon=True
        )
        behind.start()
        later = start(["-C", ws.path, "--json", "rollback"], {"COWFS_DEADLINE": "1"})
        time.sleep(4)
        assert later.poll() is None, f"gave up on a busy daemon: {later.communicate()}"
        assert behind.is_alive(), f"gave up on a busy daemon: {queued}"
    raw.settimeout(60)
    with raw:
        while not got.endswith(b"\n"):
            chunk = raw.recv(65536)
            assert chunk, got
            got += chunk
    answer = json.loads(got)  # (as any JSON reader takes it: spaces first)
    assert answer["ok"] and answer["result"]["dropped"] == [3], answer
    behind.join(60)
    assert [layer["id"] for layer in queued["log"]["layers"]] in ([1, 2], [1])
    r = finished(later, 120)
    assert r is not None and r[0] == 0, r
    assert json.loads(r[1])["dropped"] == [2]
    assert not (ws / "f0").exists() and not (ws / "g0").exists()
    assert (ws / "a.txt").read_text() == "alpha\n"


def test_a_slow_provider_checkpoint_is_not_cut_off(mounted, tmp_path):
    """A checkpoint whose provider takes several deadlines to capture."""
    ws = mounted
    gate, waiting = tmp_path / "gate", tmp_path / "capturing"
    ws.cowfs(
        "provider",
        "add",
        "slow",
        "--capture",
        f'touch "{waiting}"; while [ ! -e "{gate}" ]; do sleep 0.05; done',
        "--restore",
        "true",
    )
    proc = start(
        ["-C", ws.path, "--json", "checkpoint", "--provider", "slow"], {"COWFS_DEADLINE": "1"}
    )
    try:
        t0 = time.monotonic()
        while not waiting.exists():
            assert time.monotonic() - t0 < 60 and proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        time.sleep(4)
        assert proc.poll() is None, f"gave up on a busy daemon: {proc.communicate()}"
    finally:
        gate.touch()
    r = finished(proc, 60)
    assert r is not None and r[0] == 0, r
    layer = json.loads(r[1])["id"]
    assert ws.log()[-1]["id"] == layer and ws.log()[-1]["snapshots"]
