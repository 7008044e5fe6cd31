"""Command providers: state outside the workspace (here a real sqlite3
database, or a file, in another directory) snapshotted and restored with the
layers; and a daemon killed (kill -9) in the middle of a rollback or commit,
whose provider work the next mount finishes, each step once."""

from __future__ import annotations

import os
import shlex
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from cowfs import Workspace
from cowfs.errors import DAEMON_ERROR, PARTIAL, USAGE
from cowfs.layers import treesnap
from cowfs.system.mounts import pid_alive

from .helpers import COWFS, run


def sql(db, statement: str) -> str:
    return subprocess.run(
        ["sqlite3", str(db), statement], check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "outside" / "app.db"
    path.parent.mkdir()
    sql(path, "create table t(x); insert into t values ('original');")
    return path


def add_db_provider(ws, db, name="db", capture=None):
    ws.cowfs(
        "provider",
        "add",
        name,
        "--capture",
        capture or f'cp "{db}" "$COWFS_STATE_DIR/copy.db"',
        "--restore",
        f'cp "$COWFS_STATE_DIR/copy.db" "{db}"',
        "--discard",
        f'echo "$COWFS_LAYER" >> "{db.parent}/discarded"',
    )


def test_checkpoint_with_a_provider_restores_files_and_state_together(mounted, db):
    ws = mounted
    add_db_provider(ws, db)
    before = ws.snapshot()
    layer = ws.json("checkpoint", "-m", "migrate", "--provider", "db")
    assert [s["provider"] for s in layer["snapshots"]] == ["db"]
    sql(db, "update t set x = 'migrated'")
    (ws / "a.txt").write_text("migrated\n")
    res = ws.rollback()
    assert [r["provider"] for r in res["restored"]] == ["db"]
    assert sql(db, "select x from t") == "original"
    treesnap.assert_same(before, ws.snapshot())
    # the dropped layer's snapshot was discarded
    assert (db.parent / "discarded").read_text().split() == [str(layer["id"])]


def test_provider_commands_run_under_the_users_umask(workspace, db):
    """The daemon creates objects under umask 0 (the caller's mode is already
    masked); the commands it runs for the user get the umask it was started
    with."""
    old = os.umask(0o027)
    try:
        workspace.mount()
    finally:
        os.umask(old)
    made = db.parent / "made-by-capture"
    add_db_provider(workspace, db, capture=f'touch "{made}"')
    workspace.json("checkpoint", "--provider", "db")
    assert stat.S_IMODE(made.stat().st_mode) == 0o640


def test_rollback_to_restores_every_dropped_snapshot_last_first(mounted, db):
    ws = mounted
    add_db_provider(ws, db)
    first = ws.json("checkpoint", "--provider", "db")["id"]
    sql(db, "update t set x = 'one'")
    ws.json("checkpoint", "--provider", "db")
    sql(db, "update t set x = 'two'")
    ws.rollback(to=first)
    assert sql(db, "select x from t") == "original"


def test_commit_discards_snapshots_no_longer_needed(mounted, db):
    ws = mounted
    add_db_provider(ws, db)
    first = ws.json("checkpoint", "--provider", "db")["id"]
    sql(db, "update t set x = 'one'")
    second = ws.json("checkpoint", "--provider", "db")["id"]
    sql(db, "update t set x = 'two'")
    ws.commit()  # merge second into first
    assert (db.parent / "discarded").read_text().split() == [str(second)]
    ws.rollback()  # back to before first
    assert sql(db, "select x from t") == "original"
    assert (db.parent / "discarded").read_text().split() == [str(second), str(first)]


def test_a_failing_capture_fails_the_whole_checkpoint(mounted, db):
    ws = mounted
    add_db_provider(ws, db, "good")
    ws.cowfs("provider", "add", "bad", "--capture", "echo broken >&2; exit 3", "--restore", "true")
    layers = ws.log()
    r = ws.cowfs("checkpoint", "--provider", "good", "--provider", "bad", check=False)
    assert r.returncode == DAEMON_ERROR and "provider 'bad'" in r.stderr and "broken" in r.stderr
    assert [x["id"] for x in ws.log()] == [x["id"] for x in layers]  # nothing half-taken
    assert (db.parent / "discarded").exists()  # good's was discarded


def test_a_failing_restore_is_reported_and_the_rest_still_runs(mounted, db):
    ws = mounted
    ws.cowfs("provider", "add", "flaky", "--capture", "true", "--restore", "exit 7")
    before = ws.snapshot()
    ws.json("checkpoint", "--provider", "flaky")
    (ws / "new").write_text("x")
    r = ws.cowfs("rollback", check=False)
    assert r.returncode == PARTIAL and "restore flaky of layer" in r.stderr
    treesnap.assert_same(before, ws.snapshot())  # the files were still rolled back


def test_provider_registry_and_bad_input(mounted, db):
    ws = mounted
    add_db_provider(ws, db)
    assert [p["name"] for p in ws.json("provider", "list")] == ["db"]
    r = ws.cowfs("checkpoint", "--provider", "nope", check=False)
    assert r.returncode == USAGE and "no provider 'nope'" in r.stderr
    ws.json("checkpoint", "--provider", "db")
    r = ws.cowfs("provider", "remove", "db", check=False)
    assert r.returncode == USAGE and "has snapshots" in r.stderr
    ws.commit()  # its snapshot is discarded
    ws.cowfs("provider", "remove", "db")
    assert ws.json("provider", "list") == []
    ws.unmount()  # the registry lives in the store
    import tomllib

    assert tomllib.loads((ws / ".cowfs" / "cowfs.toml").read_text()).get("provider") == {}


def test_api_run_with_a_provider(mounted, db):
    ws = Workspace.attach(mounted.path)
    add_db_provider(mounted, db)
    result = ws.run(
        ["sqlite3", str(db), "update t set x = 'broken'; select nope;"], providers=["db"]
    )
    assert not result.ok and result.outcome == "rolled back"
    assert sql(db, "select x from t") == "original"


# -- a crash in the middle of a group operation --------------------------------------------
# Each restore and discard is a step of the store's pending record, marked
# before and after it runs: the next mount runs exactly the steps left.


class KillSwitch:
    """Makes one provider command kill -9 the mount daemon before it does
    anything, once: armed with a step name and the daemon's pid, the command
    whose guard expands to that name fires it."""

    def __init__(self, path: Path):
        self.path = path

    def guard(self, step: str) -> str:
        """Shell to put first in a command; *step* may use $COWFS_* variables."""
        t = shlex.quote(str(self.path))
        return (
            f'if [ "$(head -n1 {t} 2>/dev/null)" = "{step}" ]; then '
            f'pid=$(tail -n1 {t}); rm -f {t}; kill -9 "$pid"; exit 1; fi; '
        )

    def arm(self, step: str, pid: int) -> None:
        self.path.write_text(f"{step}\n{pid}\n")

    @property
    def armed(self) -> bool:
        return self.path.exists()


def crash_during(ws, switch: KillSwitch, step: str, *command) -> str:
    """Run the cowfs *command* with the switch armed for *step*; once the
    daemon is dead, mount again (which recovers the dead mount and finishes
    the interrupted work).  Returns what the mount said on stderr."""
    pid = ws.daemon_pid()
    switch.arm(step, pid)
    r = ws.cowfs(*command, check=False)
    assert r.returncode != 0 and not switch.armed, r.stderr
    deadline = time.monotonic() + 60
    while pid_alive(pid):
        assert time.monotonic() < deadline, "the daemon outlived kill -9"
        time.sleep(0.01)
    r = run("mount", ws.path)
    assert "cleared the dead mount" in r.stderr
    return r.stderr


class Outside:
    """A state file outside the workspace and a command provider over it
    that logs every restore and discard it carries out (after doing it)."""

    def __init__(self, directory: Path):
        directory.mkdir()
        self.state = directory / "state"
        self.log = directory / "log"
        self.switch = KillSwitch(directory / "kill")
        self.state.write_text("original")

    def add(self, ws, name: str = "st", restore_fails: bool = False) -> None:
        def cmd(what: str, work: str) -> str:
            step = f"{what} $COWFS_PROVIDER $COWFS_LAYER"
            return (
                self.switch.guard(step) + f'echo "{step}" >> {shlex.quote(str(self.log))} && {work}'
            )

        state = shlex.quote(str(self.state))
        ws.cowfs(
            "provider",
            "add",
            name,
            "--capture",
            f'cp {state} "$COWFS_STATE_DIR/copy"',
            "--restore",
            cmd("restore", "exit 7" if restore_fails else f'cp "$COWFS_STATE_DIR/copy" {state}'),
            "--discard",
            cmd("discard", "true"),
        )

    def ran(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def two_layers(self, ws) -> tuple[int, int]:
        """Two checkpoints with the provider; the state and the files change
        after each."""
        first = ws.json("checkpoint", "--provider", "st")["id"]
        self.state.write_text("one")
        (ws / "a.txt").write_text("one\n")
        (ws / "new").mkdir()
        second = ws.json("checkpoint", "--provider", "st")["id"]
        self.state.write_text("two")
        (ws / "dir" / "b.txt").unlink()
        (ws / "new" / "f").write_text("two")
        return first, second


@pytest.fixture
def outside(mounted, tmp_path) -> Outside:
    """A state file outside the mounted workspace, with provider "st" over it."""
    out = Outside(tmp_path / "outside")
    out.add(mounted)
    return out


def state_dirs(ws) -> list[str]:
    """The providers' state directories left in the (unmounted) store."""
    base = ws / ".cowfs" / "providers"
    return sorted(str(p.relative_to(base)) for p in base.glob("*/*"))


@pytest.mark.parametrize("kill_at", ["restore 0", "restore 1", "discard 0", "discard 1"])
def test_a_rollback_killed_at_any_provider_step_is_finished_once_by_the_next_mount(
    mounted, outside, kill_at
):
    ws, out = mounted, outside
    layers = [x["id"] for x in ws.log()]
    before = ws.snapshot()
    first, second = out.two_layers(ws)
    expected = [
        f"restore st {second}",
        f"restore st {first}",
        f"discard st {second}",
        f"discard st {first}",
    ]
    what, index = kill_at.split()
    killed = [step for step in expected if step.startswith(what)][int(index)]

    err = crash_during(ws, out.switch, killed, "rollback", "--to", first)

    # Every step ran exactly once, in order (the killed attempt did nothing).
    assert out.ran() == expected
    # The mount says what it finished: the killed step (again) and the rest.
    finished = [s.replace(" st ", " st of layer ") for s in expected[expected.index(killed) :]]
    finished[0] += " (again: it was interrupted)"
    assert ("finished the provider work of an interrupted rollback: " + ", ".join(finished)) in err
    assert ("finished an interrupted rollback (" in err) == (what == "restore")  # the files
    assert out.state.read_text() == "original"
    treesnap.assert_same(before, ws.snapshot())
    assert [x["id"] for x in ws.log()] == layers
    assert ws.status() == []
    ws.unmount()
    assert state_dirs(ws) == []


def test_a_commit_killed_before_its_discards_is_finished_once_by_the_next_mount(mounted, outside):
    ws, out = mounted, outside
    first, second = out.two_layers(ws)
    after = ws.snapshot()

    err = crash_during(ws, out.switch, f"discard st {second}", "commit")

    assert (
        f"finished the provider work of an interrupted commit: discard st of layer "
        f"{second} (again: it was interrupted)"
    ) in err
    assert out.ran() == [f"discard st {second}"]
    treesnap.assert_same(after, ws.snapshot())  # a commit never changes the tree
    assert [x["id"] for x in ws.log()][-1] == first  # merged into first
    ws.rollback()  # first's snapshot is still there
    assert out.state.read_text() == "original"
    assert out.ran() == [f"discard st {second}", f"restore st {first}", f"discard st {first}"]
    ws.unmount()
    assert state_dirs(ws) == []


def test_a_restore_that_failed_before_the_crash_is_reported_and_not_run_again(mounted, outside):
    ws, out = mounted, outside
    out.add(ws, "flaky", restore_fails=True)
    before = ws.snapshot()
    layer = ws.json("checkpoint", "--provider", "st", "--provider", "flaky")["id"]
    out.state.write_text("changed")
    (ws / "a.txt").write_text("changed\n")

    err = crash_during(ws, out.switch, f"discard flaky {layer}", "rollback")

    assert f"restore flaky of layer {layer}: restore command exited 7" in err
    assert out.ran() == [
        f"restore flaky {layer}",
        f"restore st {layer}",
        f"discard flaky {layer}",
        f"discard st {layer}",
    ]
    assert out.state.read_text() == "original"
    treesnap.assert_same(before, ws.snapshot())


def test_a_checkpoint_killed_while_capturing_leaves_nothing_behind(mounted, tmp_path):
    """A crash in the middle of a checkpoint's captures: the next mount
    discards what the providers took (each provider's discard runs) and
    merges the half-made layer into the one below, keeping the files."""
    ws = mounted
    out = Outside(tmp_path / "outside")
    log, state = shlex.quote(str(out.log)), shlex.quote(str(out.state))
    for name in ("first", "second"):
        ws.cowfs(
            "provider",
            "add",
            name,
            "--capture",
            out.switch.guard("capture $COWFS_PROVIDER") + f'cp {state} "$COWFS_STATE_DIR/copy"',
            "--restore",
            f'cp "$COWFS_STATE_DIR/copy" {state}',
            "--discard",
            f'echo "discard $COWFS_PROVIDER $COWFS_LAYER" >> {log}',
        )
    (ws / "a.txt").write_text("before the checkpoint\n")
    layers = [layer["id"] for layer in ws.log()]
    err = crash_during(
        ws,
        out.switch,
        "capture second",
        "checkpoint",
        "--provider",
        "first",
        "--provider",
        "second",
    )
    assert "was interrupted while taking snapshots" in err
    half = max(layers) + 1
    assert out.ran() == [f"discard first {half}", f"discard second {half}"]
    assert [layer["id"] for layer in ws.log()] == layers  # no half-made layer
    assert (ws / "a.txt").read_text() == "before the checkpoint\n"
    ws.unmount()
    assert state_dirs(ws) == []
    ws.mount()
    ws.rollback()  # still undoable
    assert (ws / "a.txt").read_text() == "alpha\n"


def _stderr_until(proc: subprocess.Popen, text: str, timeout: float = 60) -> str:
    """Read *proc*'s stderr until *text* appears (or it ends)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    seen = ""
    deadline = time.monotonic() + timeout
    while text not in seen and time.monotonic() < deadline:
        if sel.select(0.1):
            chunk = os.read(proc.stderr.fileno(), 4096).decode()
            if not chunk:
                break
            seen += chunk
    sel.close()
    return seen


def interruptible() -> None:
    """In the child: Ctrl-C does what it does on a terminal, even when the
    tests run where SIGINT is ignored (a shell's background job), which the
    child would inherit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _blocking_rollback(ws, tmp_path, offline: bool = False):
    """A layer with a provider whose restore waits for a file to appear, and
    a `cowfs rollback` started on it (*offline*: unmounted first), held in
    that restore."""
    gate, started = tmp_path / "gate", tmp_path / "restoring"
    ws.cowfs(
        "provider",
        "add",
        "slow",
        "--capture",
        "true",
        "--restore",
        f'touch "{started}"; while [ ! -e "{gate}" ]; do sleep 0.05; done',
    )
    ws.json("checkpoint", "--provider", "slow")
    (ws / "a.txt").write_text("changed\n")
    if offline:
        ws.unmount()
    proc = subprocess.Popen(
        [*COWFS, "-C", str(ws.path), "rollback"],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=interruptible,
    )
    deadline = time.monotonic() + 60
    while not started.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    return proc, gate


def test_ctrl_c_during_a_rollback_waits_for_it_and_says_so(mounted, tmp_path):
    ws = mounted
    before = ws.snapshot()
    proc, gate = _blocking_rollback(ws, tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C
    said = _stderr_until(proc, "Ctrl-C again")
    assert "the rollback goes on in the daemon" in said and proc.poll() is None
    gate.touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, said + err.decode()
    assert b"rolled back layer" in out
    treesnap.assert_same(before, ws.snapshot())


def test_a_second_ctrl_c_stops_waiting_and_the_daemon_finishes(mounted, tmp_path):
    ws = mounted
    before = ws.snapshot()
    proc, gate = _blocking_rollback(ws, tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C
    _stderr_until(proc, "Ctrl-C again")
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "stopped waiting; the rollback goes on in the daemon" in err.decode()
    gate.touch()
    deadline = time.monotonic() + 60
    while len(ws.log()) > 1:  # (the daemon answers once it is done)
        assert time.monotonic() < deadline
    treesnap.assert_same(before, ws.snapshot())


def test_ctrl_c_during_an_offline_rollback_finishes_it_first(mounted, tmp_path):
    ws = mounted
    before = ws.snapshot()
    proc, gate = _blocking_rollback(ws, tmp_path, offline=True)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C
    said = _stderr_until(proc, "Ctrl-C again")
    assert "finishing the rollback first" in said
    gate.touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, said + err.decode()
    treesnap.assert_same(before, ws.snapshot())
