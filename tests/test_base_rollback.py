"""A plain `cowfs rollback` never silently undoes the base layer (everything
since the mount or the last commit): on a terminal it asks, without one it
refuses (exit 14) unless --yes; `rollback --to ID` naming the base layer is
explicit and needs no --yes."""

from __future__ import annotations

import json
import subprocess

from cowfs.errors import CONFIRM, NOTHING_TO_DO
from cowfs.layers import treesnap

from .helpers import COWFS
from .test_run import _run_on_a_terminal

REFUSAL = "is the base layer: rolling it back undoes everything since the workspace was mounted"


def rollback(ws, *args):
    """`cowfs rollback` without a terminal (stdin not a tty, no controlling one)."""
    return subprocess.run(
        [*COWFS, "-C", str(ws.path), *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        timeout=120,
    )


def test_without_a_terminal_it_refuses_unless_yes(mounted):
    ws = mounted
    (ws / "a.txt").write_text("changed\n")
    (ws / "new").write_text("new\n")
    before = ws.snapshot()
    r = rollback(ws, "rollback")
    assert r.returncode == CONFIRM and REFUSAL in r.stderr and "--yes" in r.stderr, r.stderr
    treesnap.assert_same(before, ws.snapshot())
    r = rollback(ws, "--json", "rollback")
    assert r.returncode == CONFIRM and json.loads(r.stdout)["code"] == CONFIRM
    treesnap.assert_same(before, ws.snapshot())
    assert len(ws.log()) == 1
    r = rollback(ws, "rollback", "--yes")
    assert r.returncode == 0, r.stderr
    assert (ws / "a.txt").read_text() == "alpha\n" and not (ws / "new").exists()
    r = rollback(ws, "rollback")  # nothing to roll back comes first
    assert r.returncode == NOTHING_TO_DO and "nothing to roll back" in r.stderr
    ws.checkpoint()  # above the base: no question
    (ws / "new").write_text("new\n")
    assert rollback(ws, "rollback").returncode == 0 and not (ws / "new").exists()


def test_naming_the_base_layer_is_explicit(mounted):
    ws = mounted
    (ws / "new").write_text("new\n")
    base = ws.log()[0]["id"]
    r = rollback(ws, "--json", "rollback", "--to", str(base))
    assert r.returncode == 0 and json.loads(r.stdout)["dropped"] == [base]
    assert not (ws / "new").exists()


def test_on_a_terminal_it_asks(mounted):
    ws = mounted
    (ws / "new").write_text("new\n")
    prompt = b"Roll it back? [y/N]"
    code, out = _run_on_a_terminal(["-C", str(ws.path), "rollback"], answer=b"n\n", prompt=prompt)
    assert code == CONFIRM and "not rolled back" in out and (ws / "new").exists(), out
    code, out = _run_on_a_terminal(["-C", str(ws.path), "rollback"], answer=b"y\n", prompt=prompt)
    assert code == 0 and "rolled back layer" in out, out
    assert not (ws / "new").exists()


def test_offline_too(mounted):
    ws = mounted
    (ws / "new").write_text("new\n")
    ws.unmount()
    r = rollback(ws, "rollback")
    assert r.returncode == CONFIRM and REFUSAL in r.stderr and (ws / "new").exists()
    r = rollback(ws, "rollback", "--yes")
    assert r.returncode == 0 and not (ws / "new").exists(), r.stderr
