"""`cowfs run` and the Python API: steps that are kept or rolled back,
through real mounts and real programs."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest

from cowfs import CowfsError, StepFailed, Workspace
from cowfs.escalation.policy import Policy
from cowfs.layers import treesnap

from .helpers import COWFS, run

BROKEN_C = "int main(void) { return missing_function(); }\n"
GOOD_C = '#include <stdio.h>\nint main(void) { puts("ok"); return 0; }\n'


def test_a_failing_build_is_rolled_back_exactly(mounted):
    ws = mounted
    (ws / "main.c").write_text(BROKEN_C)
    before = ws.snapshot()
    r = ws.cowfs(
        "run",
        "--",
        "sh",
        "-c",
        "mkdir -p build && gcc -c main.c -o build/main.o && gcc build/main.o -o app",
        check=False,
    )
    assert r.returncode == 1, r.stderr  # gcc's status is passed on
    assert "rolled back (the command exited 1)" in r.stderr
    assert "A build/main.o" in r.stderr  # the summary of what it had changed
    treesnap.assert_same(before, ws.snapshot())
    runs = ws.log()[-1]["runs"]
    assert runs[-1]["outcome"] == "rolled back" and runs[-1]["exit_status"] == 1


def test_a_successful_step_is_its_own_layer(mounted):
    """By default a successful run keeps its layer, with its message and the
    run recorded on it: an undo point of its own, to diff or roll back later."""
    ws = mounted
    start = ws.snapshot()
    r = ws.cowfs("--json", "run", "-m", "first edit", "--", "sh", "-c", "echo one > one")
    first = json.loads(r.stdout)
    assert first["outcome"] == "kept" and first["layer"] == ws.log()[-1]["id"]
    assert f"kept as layer {first['layer']}" in r.stderr
    after_first = ws.snapshot()
    second = json.loads(
        ws.cowfs("--json", "run", "--", "sed", "-i", "s/alpha/beta/", "a.txt").stdout
    )
    layers = ws.log()
    assert [x["id"] for x in layers[1:]] == [first["layer"], second["layer"]]
    assert [x["message"] for x in layers[1:]] == ["first edit", "run: sed -i s/alpha/beta/ a.txt"]
    assert [x["runs"][-1]["outcome"] for x in layers[1:]] == ["kept", "kept"]
    assert [(c["path"], c["kind"]) for c in first["changes"]] == [("one", "A")]
    # each step can be looked at and undone on its own
    assert [c["path"] for c in ws.json("diff", str(second["layer"]))["changes"]] == ["a.txt"]
    ws.rollback(to=second["layer"])
    treesnap.assert_same(after_first, ws.snapshot())
    ws.rollback(to=first["layer"])
    treesnap.assert_same(start, ws.snapshot())


def test_a_successful_step_is_committed_and_recorded(mounted):
    ws = mounted
    (ws / "main.c").write_text(GOOD_C)
    r = ws.cowfs(
        "--json", "run", "--on-success", "commit", "-m", "build", "--", "gcc", "main.c", "-o", "app"
    )
    assert (ws / "app").exists()
    assert len(ws.log()) == 1  # merged into the base layer
    result = __import__("json").loads(r.stdout.splitlines()[-1])
    assert result["outcome"] == "committed" and result["exit_status"] == 0
    [app] = [c for c in result["changes"] if c["path"] == "app"]
    assert (app["kind"], app["source"]) == ("A", None)
    assert os.path.basename(app["who"]["cmd"][0]) == "ld"  # gcc's linker made it
    text = ws.cowfs("log").stdout
    assert "run committed (exit 0" in text and "gcc main.c -o app" in text


def test_a_verify_gate_rejects(mounted):
    ws = mounted
    before = ws.snapshot()
    r = ws.cowfs(
        "run",
        "--verify",
        "grep -q alpha a.txt",
        "--",
        "sed",
        "-i",
        "s/alpha/omega/",
        "a.txt",
        check=False,
    )
    assert r.returncode == 1 and "the verifier exited 1" in r.stderr
    treesnap.assert_same(before, ws.snapshot())
    r = ws.cowfs(
        "run", "--verify", "grep -q omega a.txt", "--", "sed", "-i", "s/alpha/omega/", "a.txt"
    )
    assert (ws / "a.txt").read_text() == "omega\n"


def test_on_fail_keep_and_on_success_keep(mounted):
    ws = mounted
    r = ws.cowfs("run", "--on-fail", "keep", "--", "sh", "-c", "echo x > x; exit 4", check=False)
    assert r.returncode == 4 and (ws / "x").exists()
    kept = ws.log()[-1]
    assert kept["id"] > 1 and kept["runs"][-1]["outcome"] == "kept"
    ws.cowfs("run", "--on-success", "keep", "--", "touch", "y")
    assert len(ws.log()) == 3 and (ws / "y").exists()
    ws.cowfs("run", "--on-success", "commit", "--", "touch", "z")
    assert len(ws.log()) == 3 and ws.log()[-1]["runs"][-1]["outcome"] == "committed"


def test_ctrl_c_reaches_the_command_and_the_step_is_rolled_back(mounted):
    ws = mounted
    before = ws.snapshot()
    proc = subprocess.Popen(
        [*COWFS, "-C", str(ws.path), "run", "--", "sh", "-c", "echo started > marker; sleep 60"],
        start_new_session=True,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    # (until the command runs: a shell that gets SIGINT before it starts
    # `sleep` may go on to start it)
    while not (ws / "marker").exists() or not _session_runs(proc.pid, "sleep"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "rolled back" in err
    treesnap.assert_same(before, ws.snapshot())


def _session_runs(sid: int, name: str) -> bool:
    """Whether a process named *name* runs in session *sid*."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                comm, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        if comm.split("(", 1)[1] == name and int(rest.split()[3]) == sid:
            return True
    return False


def _run_on_a_terminal(
    args: list[str],
    answer: bytes | None = None,
    timeout: float = 60,
    prompt: bytes = b"keep these changes?",
) -> tuple[int, str]:
    """Run cowfs with a pseudo-terminal as its controlling terminal (and
    stdin); type *answer* when it asks (*prompt*)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(sys.executable, [*COWFS, *args])
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
            if answer is not None and prompt in out:
                os.write(fd, answer)
                answer = None
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def test_an_approval_that_times_out_discards(mounted):
    ws = mounted
    before = ws.snapshot()
    code, out = _run_on_a_terminal(
        [
            "-C",
            str(ws.path),
            "run",
            "--approve",
            "--timeout",
            "1",
            "--",
            "sh",
            "-c",
            "echo new > new",
        ]
    )
    assert "keep these changes?" in out and "discarding" in out, out
    assert code == 0
    treesnap.assert_same(before, ws.snapshot())


def test_an_approval_answered_keep(mounted):
    ws = mounted
    code, out = _run_on_a_terminal(
        ["-C", str(ws.path), "run", "--approve", "--", "sh", "-c", "echo new > new"], answer=b"k\n"
    )
    assert code == 0 and "kept as layer" in out, out
    assert (ws / "new").read_text() == "new\n" and len(ws.log()) == 2


def test_approve_without_a_terminal_never_hangs(mounted):
    ws = mounted
    before = ws.snapshot()
    r = subprocess.run(
        [*COWFS, "-C", str(ws.path), "run", "--approve", "--", "touch", "t"],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0 and "no terminal" in r.stderr
    treesnap.assert_same(before, ws.snapshot())


def test_ephemeral_run_kept(workspace):
    (workspace / "f").write_text("one\n")
    r = run(
        "run",
        "--workspace",
        workspace.path,
        "--yes",
        "--",
        "sh",
        "-c",
        "echo two >> f && mkdir d && echo x > d/x",
    )
    assert "committed" in r.stderr
    assert (workspace / "f").read_text() == "one\ntwo\n"
    assert (workspace / "d" / "x").read_text() == "x\n"
    assert not (workspace / ".cowfs").exists()  # the store it made is gone again
    assert "fuse.cowfs" not in open("/proc/self/mounts").read().split(str(workspace.path))[-1][:20]


def test_ephemeral_run_discarded_byte_for_byte(workspace):
    (workspace / "f").write_text("one\n")
    os.symlink("f", workspace / "link")
    before = workspace.snapshot()
    r = run(
        "run",
        "--workspace",
        workspace.path,
        "--no",
        "--",
        "sh",
        "-c",
        "echo two >> f && rm link && touch new",
    )
    assert "rolled back" in r.stderr
    treesnap.assert_same(before, workspace.snapshot())
    # without a terminal and without --yes it is discarded too
    r = subprocess.run(
        [*COWFS, "run", "--workspace", str(workspace.path), "--", "touch", "n2"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        timeout=120,
    )
    assert r.returncode == 0 and "discarding" in r.stderr
    treesnap.assert_same(before, workspace.snapshot())


def test_run_needs_a_command(mounted):
    r = mounted.cowfs("run", "--", check=False)
    assert r.returncode == 2 and "needs a command" in r.stderr


# -- the Python API ----------------------------------------------------------------


def test_a_command_that_cannot_be_started_says_why(mounted):
    ws = mounted
    before = ws.snapshot()
    r = ws.cowfs("run", "--", "no-such-command-here", "arg", check=False)
    assert r.returncode == 127
    assert "cowfs: rolled back (no-such-command-here: command not found)" in r.stderr
    (ws / "script").write_text("#!/bin/sh\necho hi\n")  # not executable
    ws.commit()
    before = ws.snapshot()
    r = ws.cowfs("run", "--", "./script", check=False)
    assert r.returncode == 126
    assert "./script: cannot run it (permission denied)" in r.stderr
    r = ws.cowfs("--json", "run", "--", "no-such-command-here", check=False)
    assert json.loads(r.stdout)["error"] == "no-such-command-here: command not found"
    treesnap.assert_same(before, ws.snapshot())


def test_api_step_is_kept_as_its_own_layer_or_committed(mounted):
    ws = Workspace.attach(mounted.path)
    with ws.step("edit") as step:
        (mounted / "a.txt").write_text("edited\n")
        assert ws.top() == step.layer
    assert (mounted / "a.txt").read_text() == "edited\n"
    assert [str(c) for c in step.changes] == ["M a.txt"] and step.outcome == "kept"
    assert [x.id for x in ws.log()] == [1, step.layer]
    assert ws.log()[-1].message == "edit" and ws.log()[-1].runs[-1]["outcome"] == "kept"
    with ws.step("more", on_success="commit") as more:
        (mounted / "b.txt").write_text("b\n")
    assert more.outcome == "committed" and more.layer == step.layer
    assert [x.id for x in ws.log()] == [1, step.layer]


def test_api_step_rolls_back_on_exception(mounted):
    ws = Workspace.attach(mounted.path)
    before = mounted.snapshot()
    with pytest.raises(RuntimeError):
        with ws.step("doomed"):
            (mounted / "a.txt").write_text("broken\n")
            os.mkdir(mounted / "junk")
            raise RuntimeError("the agent gave up")
    treesnap.assert_same(before, mounted.snapshot())


def test_api_step_rolls_back_on_failed_verification(mounted):
    ws = Workspace.attach(mounted.path)
    before = mounted.snapshot()
    with pytest.raises(StepFailed) as e:
        with ws.step(
            "bad edit",
            verify="grep alpha a.txt || { echo no alpha >&2; exit 3; }",
            capture_output=True,
        ) as step:
            (mounted / "a.txt").write_text("beta\n")
    assert e.value.verify_status == 3
    assert [str(c) for c in e.value.changes] == ["M a.txt"]
    assert (e.value.stdout, e.value.stderr) == ("", "no alpha\n")
    assert step.layer is None and step.outcome == "rolled back"
    treesnap.assert_same(before, mounted.snapshot())
    assert ws.log()[-1].runs[-1]["outcome"] == "rolled back"


def test_api_run_status_log_rollback_and_dry_run(mounted):
    ws = Workspace.attach(mounted.path)
    res = ws.run("echo hi > hi && exit 2")
    assert not res.ok and res.status == 2 and res.outcome == "rolled back"
    assert [str(c) for c in res.changes] == ["A hi"]
    assert res.layer is None
    res = ws.run(["touch", "kept"])
    assert res.ok and res.outcome == "kept" and res.layer == ws.top()
    ws.commit()
    first = ws.checkpoint("try")
    (mounted / "a.txt").unlink()
    assert [str(c) for c in ws.status().changes] == ["D a.txt"]
    assert [str(c) for c in ws.rollback(dry_run=True)] == ["D a.txt"]
    assert (mounted / "dir").exists() and not (mounted / "a.txt").exists()
    result = ws.rollback(to=first)
    assert result.dropped == [first] and result.failures == []
    assert (mounted / "a.txt").exists()
    assert [r["outcome"] for r in ws.log()[0].runs] == ["rolled back", "kept"]


def test_api_run_captures_output_from_a_thread_and_times_out(mounted):
    """With capture, a run reads nothing and keeps what the command and the
    verifier wrote (its beginning and end past the limit), so a server can
    run steps from a worker thread; a timeout kills the command's session."""
    import threading

    ws = Workspace.attach(mounted.path)
    before = mounted.snapshot()
    results = []
    worker = threading.Thread(
        target=lambda: results.append(
            ws.run(
                "cat; seq 1 5000; echo oops >&2; touch made",
                verify="echo checked; false",
                capture_output=True,
                output_limit=400,
            )
        )
    )
    worker.start()
    worker.join()
    [res] = results
    assert (res.outcome, res.exit_status, res.verify_status) == ("rolled back", 0, 1)
    assert res.stdout.startswith("1\n2\n") and res.stdout.endswith("5000\n")
    assert "bytes of output left out" in res.stdout and len(res.stdout) < 500
    assert (res.stderr, res.verify_stdout, res.verify_stderr) == ("oops\n", "checked\n", "")
    assert not set(ws.log()[0].runs[-1]) & {"stdout", "stderr", "verify_stdout"}  # not kept
    treesnap.assert_same(before, mounted.snapshot())
    res = ws.run("touch slow; exec sleep 600", capture_output=True, timeout=0.5)
    assert (res.exit_status, res.outcome) == (124, "rolled back") and "timed out" in res.error
    treesnap.assert_same(before, mounted.snapshot())


def test_agent_loop_retries_a_failed_step_from_a_clean_state(mounted):
    """The README's example: retry until the build passes."""
    ws = Workspace.attach(mounted.path)
    attempts = [BROKEN_C, BROKEN_C, GOOD_C]
    for source in attempts:
        (mounted / "prog.c").write_text(source)
        result = ws.run(["gcc", "prog.c", "-o", "prog"], verify="./prog")
        if result.ok:
            break
        assert not (mounted / "prog").exists()  # each failure left nothing behind
    assert result.ok and (mounted / "prog").exists()


def test_readme_agent_loop_with_steps(mounted):
    ws = Workspace.attach(mounted.path)
    sources = iter([BROKEN_C, GOOD_C])
    failures = []
    for attempt in range(5):
        try:
            with ws.step(f"attempt {attempt}", verify="./prog"):
                (mounted / "prog.c").write_text(next(sources))
                subprocess.run(
                    ["gcc", "prog.c", "-o", "prog"], cwd=ws.root, check=True, capture_output=True
                )
            break
        except (StepFailed, subprocess.CalledProcessError) as e:
            failures.append(e)
            assert not (mounted / "prog.c").exists()  # undone: a clean state again
    assert len(failures) == 1 and attempt == 1
    assert (mounted / "prog.c").read_text() == GOOD_C
    assert [x.message for x in ws.log()] == ["base", "attempt 1"]  # the step kept


def test_api_run_captures_output_and_reports_changes_and_layer(mounted):
    ws = Workspace.attach(mounted.path)
    res = ws.run(
        "echo out; echo err >&2; echo x > made",
        verify="echo vout; echo verr >&2",
        capture_output=True,
    )
    assert res.ok and res.outcome == "kept" and res.layer == ws.top()
    assert (res.stdout, res.stderr) == ("out\n", "err\n")
    assert (res.verify_stdout, res.verify_stderr) == ("vout\n", "verr\n")
    assert [str(c) for c in res.changes] == ["A made"] and res.changes[0].who["pid"] > 0
    assert "stdout" not in ws.log()[-1].runs[-1]  # output is not kept on the layer
    res = ws.run(["sh", "-c", "echo failing; exit 3"], capture_output=True)
    assert res.status == 3 and res.stdout == "failing\n" and res.layer is None
    res = ws.run(["no-such-command-here"], capture_output=True)
    assert res.status == 127 and res.error and (res.stdout, res.stderr) == ("", "")
    res = ws.run(["true"])  # passed through: nothing kept
    assert res.stdout is None and res.verify_stdout is None


def test_api_run_without_a_checkpoint_reports_what_it_changed(mounted, tmp_path):
    """scope "auto": a command the policy calls read-only takes no
    checkpoint; its result still lists what it changed after all (in the
    open layer, beside what was changed there before) and names that layer."""
    ws = Workspace.attach(mounted.path)
    (mounted / "before.txt").write_text("already changed\n")
    res = ws.run(["ls"], scope="auto", capture_output=True)
    assert res.outcome == "no checkpoint" and res.layer == ws.top() and res.changes == []
    assert "a.txt" in res.stdout
    rules = tmp_path / "policy.toml"
    rules.write_text('[[rule]]\nname = "touch reads"\nscope = "none"\nprograms = ["touch"]\n')
    res = ws.run(["touch", "found.txt"], scope="auto", policy=Policy.load([str(rules)]))
    assert res.outcome == "no checkpoint" and res.layer == ws.top()
    assert [str(c) for c in res.changes] == ["A found.txt"]


def test_api_step_reports_changes_when_the_block_raises(mounted):
    ws = Workspace.attach(mounted.path)
    with pytest.raises(KeyError):
        with ws.step("doomed") as step:
            (mounted / "junk").write_text("x\n")
            raise KeyError("gave up")
    assert [str(c) for c in step.changes] == ["A junk"] and step.layer is None
    assert step.outcome == "rolled back" and not (mounted / "junk").exists()
    [run_] = ws.log()[-1].runs
    assert run_["outcome"] == "rolled back" and "KeyError" in run_["error"]


def test_api_rollback_of_the_base_layer_needs_yes(mounted):
    ws = Workspace.attach(mounted.path)
    (mounted / "a.txt").write_text("changed\n")
    before = mounted.snapshot()
    with pytest.raises(CowfsError) as e:
        ws.rollback()
    assert e.value.code == 14 and "base layer" in str(e.value)
    treesnap.assert_same(before, mounted.snapshot())
    base = ws.top()
    assert ws.rollback(to=base).dropped == [base]  # naming it is explicit
    (mounted / "a.txt").write_text("changed again\n")
    base = ws.top()
    assert ws.rollback(yes=True).dropped == [base]
    assert (mounted / "a.txt").read_text() == "alpha\n"
