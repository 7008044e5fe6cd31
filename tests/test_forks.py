"""Forks: private copies of a workspace, made at once from its state at the
fork point (a view of it as an overlay's lower layer, a private upper
layer, a cowfs mount over that), each a workspace with layers of its own.

Every tree is compared whole (names, types, bytes, modes, owners, mtimes,
xattrs, hard links) with what it must be.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cowfs.errors import ALREADY_MOUNTED, REFUSED
from cowfs.layers import treesnap
from cowfs.service import forks as stacks
from cowfs.system.mounts import MountRecord, mounts, path_key, pid_alive, runtime_dir

from .helpers import COWFS, managed_workspace, view_processes

# (the workspace's engine matters to what a fork is made from and to an
# adopt's changes: those tests run on each; the fork's own mount is always
# the default engine's)
each_engine = pytest.mark.usefixtures("each_engine")


def fork_mounts(ws: Path) -> list[str]:
    """Everything mounted for the forks of workspace *ws*."""
    base = os.path.join(runtime_dir(), "forks", path_key(str(ws))) + "/"
    return [m.mountpoint for m in mounts() if m.mountpoint.startswith(base)]


def clear_forks(ws: Path) -> None:
    """Whatever a test left of its forks goes: their daemons are killed,
    their mounts detached (the deepest first)."""
    for mp in sorted(set(fork_mounts(ws)), key=len, reverse=True):
        rec = MountRecord.load(mp)
        if rec is not None:
            if pid_alive(rec.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rec.pid, signal.SIGKILL)
            rec.remove()
        for _ in range(4):
            subprocess.run(["umount", "-l", mp], capture_output=True)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"cowfs.fuse.view" in argv and any(str(ws).encode() in a for a in argv):
                os.kill(int(pid), signal.SIGKILL)
    # (and the directories they were mounted at, emptied by the detaching)
    subprocess.run(
        ["rm", "-rf", "--one-file-system", os.path.dirname(stacks.run_dir(str(ws), 0))],
        check=False,
    )


@pytest.fixture
def parent(tmp_path, fuse) -> Iterator:
    """A mounted workspace with what forks must carry: hard links, a
    symlink, xattrs, a large file, an ignored directory, modes and times."""
    with managed_workspace(tmp_path / "ws") as ws:
        try:
            root = ws.path
            (root / "src").mkdir()
            (root / "src" / "a.txt").write_text("alpha\n")
            os.link(root / "src" / "a.txt", root / "src" / "a.hard")
            os.symlink("a.txt", root / "src" / "link")
            os.setxattr(root / "src" / "a.txt", "user.color", b"blue")
            (root / "big.bin").write_bytes(os.urandom(1 << 20))
            (root / "node_modules" / "pkg").mkdir(parents=True)
            (root / "node_modules" / "pkg" / "index.js").write_text("module.exports = 1\n")
            (root / ".cowfsignore").write_text("node_modules\n")
            (root / "empty").mkdir()
            os.chmod(root / "src" / "a.txt", 0o640)
            os.utime(root / "src", ns=(10**18, 10**18))
            ws.mount()
            yield ws
        finally:
            ws.teardown()
            clear_forks(ws.path)
    assert not fork_mounts(ws.path), "the forks' mounts outlived the test"


def forks_of(ws) -> dict[str, dict]:
    return {f["name"]: f for f in ws.json("forks")}


def drop_when_unused(ws, name: str) -> None:
    """Drop fork *name* once the processes that used it are seen gone."""
    deadline = time.monotonic() + 60
    while forks_of(ws)[name]["users"]:
        assert time.monotonic() < deadline, forks_of(ws)[name]["users"]
        time.sleep(0.1)
    ws.cowfs("drop", name)


def fork(ws, name: str, *extra: str) -> Path:
    ws.cowfs("fork", *extra, name)
    return Path(forks_of(ws)[name]["path"])


def same(a: treesnap.Snapshot, b: treesnap.Snapshot) -> None:
    treesnap.assert_same(a, b)


@each_engine
def test_a_fork_is_the_workspace_at_the_fork_point_and_neither_sees_the_other(parent):
    ws = parent
    then = ws.snapshot()
    f = fork(ws, "a", "-m", "try a")
    row = forks_of(ws)["a"]
    assert row["message"] == "try a" and row["mounted"] and row["users"] == []
    same(then, treesnap.snapshot(f))  # ignored paths, links, xattrs, times too
    # the fork writes: captured paths, ignored ones, a hard link, a rename
    with open(f / "src" / "a.hard", "a") as fh:
        fh.write("fork\n")
    (f / "node_modules" / "pkg" / "index.js").write_text("module.exports = 2\n")
    os.rename(f / "src", f / "lib")
    (f / "new.txt").write_text("made in the fork\n")
    mine = treesnap.snapshot(f)
    same(then, ws.snapshot())
    # the workspace writes: the fork keeps its own state
    (ws / "src" / "a.txt").write_text("parent\n")
    (ws / "node_modules" / "pkg" / "index.js").write_text("module.exports = 3\n")
    os.unlink(ws / "big.bin")
    time.sleep(1.1)  # (what the kernel holds of the fork point lasts a second)
    same(mine, treesnap.snapshot(f))
    assert [c["path"] for c in ws.json("--fork", "a", "status")["changes"]] == [
        c["path"] for c in ws.json("-C", str(f), "status")["changes"]
    ]
    # each has its own layers
    assert ws.json("--fork", "a", "log")[0]["id"] == 1
    assert ws.log()[-1]["message"] == "try a"


@each_engine
def test_the_fork_point_stays_whatever_the_workspace_rolls_back_or_commits(parent):
    ws = parent
    then = ws.snapshot()
    before = ws.checkpoint("before")
    (ws / "src" / "a.txt").write_text("kept below the fork\n")
    f = fork(ws, "a")
    at_fork = ws.snapshot()
    same(at_fork, treesnap.snapshot(f))
    fork_layer = forks_of(ws)["a"]["layer"]
    # a rollback to a layer before the fork point would take its state away
    r = ws.cowfs("rollback", "--to", str(before), check=False)
    assert r.returncode == REFUSED and "fork a" in r.stderr, r.stderr
    same(at_fork, ws.snapshot())
    # rolling back what came after it, its own layer included, is allowed
    (ws / "src" / "a.txt").write_text("after the fork\n")
    ws.checkpoint("above")
    os.unlink(ws / "big.bin")
    ws.rollback(fork_layer)
    same(at_fork, ws.snapshot())
    # and so is a commit, which keeps every record
    (ws / "empty" / "x").write_text("x\n")
    ws.commit()
    time.sleep(1.1)
    same(at_fork, treesnap.snapshot(f))
    assert ws.cowfs("drop", "a").returncode == 0
    ws.rollback(ws.log()[0]["id"])  # (no fork left to keep it from the base)
    same(then, ws.snapshot())


@each_engine
def test_forks_outlive_their_workspaces_mount_and_daemons(parent):
    """A fork stays mounted while its workspace is unmounted and when its
    daemon is killed; a fork whose own daemon is killed is mounted again
    by the next mount of its workspace, its tree and its layers as they
    were (the overlay under it stays: the objects it copied up keep their
    numbers)."""
    ws = parent
    f = fork(ws, "a")
    (f / "mine.txt").write_text("fork's\n")
    with open(f / "src" / "a.txt", "a") as fh:
        fh.write("copied up\n")
    ws.json("--fork", "a", "checkpoint", "-m", "in the fork")
    (f / "src" / "a.txt").write_text("in the fork's layer\n")
    mine = treesnap.snapshot(f)
    ws.unmount()
    assert Path(forks_of_mounts(ws.path)["merged"]).exists()
    same(mine, treesnap.snapshot(f))
    ws.mount()
    assert forks_of(ws)["a"]["mounted"]
    # the workspace's daemon dies: the fork goes on, and the next mount keeps it
    ws.kill()
    (f / "after.txt").write_text("written while the workspace was down\n")
    ws.cowfs("mount", ws.path)
    assert forks_of(ws)["a"]["mounted"]
    assert (f / "after.txt").read_text() == "written while the workspace was down\n"
    # the fork's own daemon dies: the next mount of the workspace mounts it again
    mine = treesnap.snapshot(f)
    rec = MountRecord.load(str(f))
    os.kill(rec.pid, signal.SIGKILL)
    while pid_alive(rec.pid):
        time.sleep(0.01)
    ws.unmount()
    ws.mount()
    assert forks_of(ws)["a"]["mounted"]
    same(mine, treesnap.snapshot(f))
    assert ws.json("--fork", "a", "log")[-1]["message"] == "in the fork"
    ws.json("--fork", "a", "rollback", "--yes")  # (its layer: exact)
    assert (f / "src" / "a.txt").read_text() == "alpha\ncopied up\n"


def forks_of_mounts(ws: Path) -> dict[str, str]:
    found = fork_mounts(ws)
    return {os.path.basename(mp): mp for mp in found}


def test_run_in_a_fork_sees_it_at_the_workspaces_own_path(parent):
    ws = parent
    f = fork(ws, "a")
    script = (
        f"pwd; cat a.txt; echo made > run.txt; {' '.join(COWFS)} checkpoint -m inside; "
        f"{' '.join(COWFS)} --json status"
    )
    r = subprocess.run(
        [*COWFS, "run", "--fork", "a", "--", "sh", "-c", script],
        cwd=ws / "src",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == str(ws / "src") and lines[1] == "alpha"
    assert json.loads(lines[-1])["changes"] == []  # (just after its own checkpoint)
    assert (f / "src" / "run.txt").read_text() == "made\n"
    assert not (ws / "src" / "run.txt").exists()
    messages = [row["message"] for row in ws.json("--fork", "a", "log")]
    assert "inside" in messages
    assert "inside" not in [row["message"] for row in ws.log()]


def test_drop_frees_the_fork_and_waits_for_its_users(parent):
    ws = parent
    f = fork(ws, "a")
    (f / "data").write_bytes(os.urandom(200_000))
    user = subprocess.Popen(["sleep", "60"], cwd=f)
    try:
        time.sleep(0.2)
        assert forks_of(ws)["a"]["users"] == [user.pid]
        r = ws.cowfs("drop", "a", check=False)
        assert r.returncode == ALREADY_MOUNTED and str(user.pid) in r.stderr, r.stderr
        assert forks_of(ws)["a"]["mounted"]
    finally:
        user.kill()
        user.wait()
    ws.cowfs("drop", "a")
    assert forks_of(ws) == {} and not fork_mounts(ws.path)
    r = ws.cowfs("drop", "a", check=False)
    assert r.returncode == 4 and "no fork a" in r.stderr
    ws.unmount()
    assert os.listdir(ws.path / ".cowfs" / "forks") == []


@pytest.mark.parametrize(
    "args, code, says",
    [
        (["fork", ".hidden"], 2, "bad fork name"),
        (["fork", "a/b"], 2, "bad fork name"),
        (["drop", "nothing"], 4, "no fork nothing"),
        (["--fork", "nothing", "status"], 4, "no fork nothing"),
    ],
)
def test_bad_fork_names_are_one_line_errors(parent, args, code, says):
    r = parent.cowfs(*args, check=False)
    assert r.returncode == code and says in r.stderr, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_forks_changes_since_its_fork_point_are_what_it_holds_differently(parent):
    """`diff --fork NAME` lists the paths whose state differs between the
    fork point and the fork, ignored ones included; a file written back as
    it was, a directory moved away and back, are no change."""
    ws = parent
    f = fork(ws, "a")
    with open(f / "src" / "a.txt", "a") as fh:  # through one of two hard links
        fh.write("more\n")
    (f / "node_modules" / "pkg" / "index.js").write_text("changed, ignored\n")
    (f / "node_modules" / "new").mkdir()
    os.rename(f / "empty", f / "full")
    (f / "full" / "x").write_text("x\n")
    os.unlink(f / "src" / "link")
    os.symlink("a.hard", f / "src" / "link")
    os.chmod(f / "big.bin", 0o600)
    data = (f / ".cowfsignore").read_bytes()
    (f / ".cowfsignore").write_bytes(data)  # (copied up, the same bytes)
    st = os.stat(ws / ".cowfsignore")
    os.utime(f / ".cowfsignore", ns=(st.st_atime_ns, st.st_mtime_ns))
    got = {(c["kind"], c["path"]) for c in ws.json("diff", "--fork", "a")["changes"]}
    assert got == {
        ("M", "src/a.txt"),
        ("M", "src/a.hard"),
        ("M", "src/link"),
        ("M", "node_modules/pkg/index.js"),
        ("A", "node_modules/new"),
        ("D", "empty"),
        ("A", "full"),
        ("A", "full/x"),
        ("m", "big.bin"),
    }, got
    assert forks_of(ws)["a"]["changes"] == len(got)
    text = ws.cowfs("diff", "--fork", "a").stdout.splitlines()
    assert "M\tsrc/a.txt" in text and "A\tfull/x" in text


def _entries(snap: treesnap.Snapshot, under: set[bytes]) -> dict:
    """The entries of *snap* at or below the paths *under*, without their
    directories' mtimes (a directory's entries change when an adopt makes
    its names)."""
    import dataclasses

    return {
        rel: dataclasses.replace(e, mtime_ns=0) if e.kind == "dir" else e
        for rel, e in snap.items()
        if any(rel == u or rel.startswith(u + b"/") for u in under)
    }


@each_engine
def test_adopt_makes_the_forks_changes_one_layer_and_keeps_the_workspaces_own(parent):
    ws = parent
    f = fork(ws, "a")
    # the fork: contents, a hard link, ignored paths, a directory moved,
    # attributes, a symlink, a removal
    with open(f / "src" / "a.hard", "a") as fh:
        fh.write("from the fork\n")
    (f / "node_modules" / "pkg" / "index.js").write_text("module.exports = 2\n")
    (f / "node_modules" / "dep").mkdir()
    (f / "node_modules" / "dep" / "x.js").write_text("x\n")
    os.rename(f / "empty", f / "full")
    (f / "full" / "made").write_text("made\n")
    os.chmod(f / "src", 0o750)  # (a directory's attributes alone)
    os.setxattr(f / "src" / "a.txt", "user.color", b"red")
    os.unlink(f / "src" / "link")
    os.symlink("a.hard", f / "src" / "link")
    # the workspace, meanwhile, elsewhere
    (ws / "mine.txt").write_text("the workspace's own\n")
    with open(ws / "big.bin", "r+b") as fh:
        fh.write(b"W")
    before = ws.snapshot()
    forked = treesnap.snapshot(f)
    res = ws.json("adopt", "a")
    assert forks_of(ws) == {} and not fork_mounts(ws.path)
    after = ws.snapshot()
    changed = {b"src", b"node_modules", b"full", b"empty"}
    assert _entries(after, changed) == _entries(forked, changed)
    assert after[b"big.bin"] == before[b"big.bin"]  # (the workspace's change, kept)
    assert after[b"mine.txt"] == before[b"mine.txt"]
    assert after[b"src/a.txt"].link == after[b"src/a.hard"].link  # (one object, two names)
    assert res["layer"] == ws.log()[-1]["id"]
    # one layer: a rollback undoes it exactly
    ws.rollback(res["layer"])
    same(before, ws.snapshot())


def test_adopt_refuses_conflicts_and_changes_nothing_unless_told_whose_to_keep(parent):
    ws = parent
    f = fork(ws, "a")
    (f / "src" / "a.txt").write_text("fork\n")
    (f / "new.txt").write_text("fork's new\n")
    shutil_rmtree(f / "empty")
    (ws / "src" / "a.txt").write_text("workspace\n")
    (ws / "new.txt").write_text("workspace's new\n")
    (ws / "empty" / "inside").write_text("below what the fork removed\n")
    before, forked = ws.snapshot(), treesnap.snapshot(f)
    r = ws.cowfs("adopt", "a", check=False)
    assert r.returncode == 15, r.stderr
    lines = r.stdout.splitlines()
    assert lines == [
        "C empty\tfork: D\tworkspace: A empty/inside",
        "C new.txt\tfork: A\tworkspace: A",
        "C src/a.txt\tfork: M\tworkspace: M",
    ], lines
    data = json.loads(ws.cowfs("--json", "adopt", "a", check=False).stdout)
    assert {c["path"] for c in data["conflicts"]} == {"empty", "new.txt", "src/a.txt"}
    same(before, ws.snapshot())
    same(forked, treesnap.snapshot(f))
    assert forks_of(ws)["a"]["mounted"]
    # the workspace's side for all but one path
    ws.json("adopt", "--prefer", "parent", "--prefer", "new.txt=fork", "a")
    assert (ws / "src" / "a.txt").read_text() == "workspace\n"
    assert (ws / "new.txt").read_text() == "fork's new\n"
    assert (ws / "empty" / "inside").exists()


def shutil_rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


@each_engine
def test_an_adopt_cut_short_by_a_killed_daemon_is_undone_by_the_next_mount(parent):
    """kill -9 of the workspace's daemon while an adopt makes its changes:
    the next mount rolls back what it made (the workspace is as before it)
    and mounts the fork again as it was; adopting again then works."""
    ws = parent
    f = fork(ws, "a")
    for i in range(40):
        d = f / f"many{i}"
        d.mkdir()
        for j in range(75):
            (d / f"f{j}").write_text(f"{i} {j}\n")
    before, forked = ws.snapshot(), treesnap.snapshot(f)
    adopting = subprocess.Popen(
        [*COWFS, "-C", str(ws.path), "adopt", "a"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(1.5)  # (the fork is unmounted first; then 3,000 files are made)
        ws.kill()
    finally:
        adopting.wait(timeout=60)
    ws.cowfs("mount", ws.path)
    deadline = time.monotonic() + 60
    while not forks_of(ws).get("a", {}).get("mounted"):
        assert forks_of(ws), "the adopt finished before the kill: make it longer"
        assert time.monotonic() < deadline, "the fork was not mounted again"
        time.sleep(0.1)
    same(before, ws.snapshot())
    same(forked, treesnap.snapshot(f))
    ws.json("adopt", "a")
    assert (ws / "many39" / "f74").read_text() == "39 74\n"


def test_best_of_adopts_the_first_command_that_passes_and_drops_the_others(parent):
    ws = parent
    before = ws.snapshot()
    r = subprocess.run(
        [
            *COWFS,
            "--json",
            "best-of",
            "--verify",
            "grep -q good src/a.txt",
            "--",
            "echo bad > src/a.txt",
            ":::",
            "echo good > src/a.txt && echo new > made.txt",
            ":::",
            "rm -rf src; exit 3",
        ],
        cwd=ws.path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["winner"] == 1
    assert [c["ok"] for c in res["candidates"]] == [False, True, False]
    assert [c["verify_status"] for c in res["candidates"]] == [1, 0, None]
    assert res["candidates"][2]["exit_status"] == 3
    assert {c["path"] for c in res["candidates"][1]["changes"]} >= {"made.txt"}
    assert (ws / "src" / "a.txt").read_text() == "good\n"
    assert (ws / "made.txt").read_text() == "new\n"
    # (written through one name of a hard-linked file: both show it, one object)
    assert os.stat(ws / "src" / "a.hard").st_ino == os.stat(ws / "src" / "a.txt").st_ino
    assert forks_of(ws) == {} and not fork_mounts(ws.path)
    # (the three forks started at one layer)
    assert [row["message"] for row in ws.log() if row["message"].startswith("best of")] == [
        "best of 3: 1"
    ]
    ws.rollback(res["layer"])
    same(before, ws.snapshot())


def test_forks_made_with_nothing_changed_between_share_one_fork_point(parent):
    """A fork made while the open layer is another live fork's fork point
    and nothing was recorded since starts there too (no empty layer); one
    made after a change, or once no fork holds the layer (a change at an
    ignored path, uncaptured meanwhile, may have come between), opens its
    own."""
    ws = parent
    layers = len(ws.log())
    fork(ws, "a")
    shared = forks_of(ws)["a"]["layer"]
    assert len(ws.log()) == layers + 1
    b = fork(ws, "b")
    assert forks_of(ws)["b"]["layer"] == shared and len(ws.log()) == layers + 1
    (ws / "src" / "after.txt").write_text("after a and b\n")
    c = fork(ws, "c")
    assert forks_of(ws)["c"]["layer"] == shared + 1 and (c / "src" / "after.txt").exists()
    assert not (b / "src" / "after.txt").exists()
    for name in ("a", "b", "c"):
        ws.cowfs("drop", name)
    (ws / "node_modules" / "pkg" / "index.js").write_text("module.exports = 2\n")  # (ignored)
    d = fork(ws, "d")
    assert forks_of(ws)["d"]["layer"] == shared + 2
    assert (d / "node_modules" / "pkg" / "index.js").read_text() == "module.exports = 2\n"
    ws.cowfs("drop", "d")


def test_best_of_through_the_api_with_a_chooser_and_nothing_to_adopt(parent):
    from cowfs.interface.api import Workspace as Api

    ws = Api.attach(str(parent.path))
    before = parent.snapshot()
    res = ws.best_of(["exit 1", "exit 2"], parallel=1)
    assert res.winner is None and res.layer is None
    assert [c.result.exit_status for c in res.candidates] == [1, 2]
    assert ws.forks() == []
    same(before, parent.snapshot())
    res = ws.best_of(
        ["echo one > pick.txt", "echo two > pick.txt"],
        pick=lambda cands: max(range(len(cands)), key=lambda i: cands[i].command),
    )
    assert res.winner == 1 and (parent / "pick.txt").read_text() == "two\n"
    assert [c.result.stdout for c in res.candidates] == ["", ""]


@pytest.mark.parametrize("step", ["fork", "drop"])
def test_a_fork_or_drop_cut_short_by_a_killed_daemon_is_finished_by_the_next_mount(parent, step):
    """kill -9 of the workspace's daemon while it makes or drops a fork: the
    next mount removes a fork whose making was cut short (its layer stays:
    an empty one) and finishes a drop; nothing of either is left mounted."""
    ws = parent
    before = ws.snapshot()
    if step == "drop":
        f = fork(ws, "a")
        (f / "x").write_bytes(os.urandom(1 << 20))
    cmd = ["fork", "a"] if step == "fork" else ["drop", "--force", "a"]
    proc = subprocess.Popen(
        [*COWFS, "-C", str(ws.path), *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(0.4)  # (the registry is written first, then the mounts)
        ws.kill()
    finally:
        proc.wait(timeout=60)
    ws.cowfs("mount", ws.path)
    deadline = time.monotonic() + 60
    while True:
        rows = forks_of(ws)
        if not rows or rows["a"]["mounted"]:
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.1)
    if rows:  # (the kill came after the fork was made: it is whole)
        assert step == "fork"
        same(before, treesnap.snapshot(Path(rows["a"]["path"])))
        ws.cowfs("drop", "a")
    assert not fork_mounts(ws.path)
    same(before, ws.snapshot())
    ws.unmount()
    assert os.listdir(ws.path / ".cowfs" / "forks") == []


def test_a_process_running_in_a_fork_from_run_fork_keeps_it_from_adopt_and_drop(parent):
    """The fork bound over the workspace's path in a namespace of its own
    is in use as much as one used where it is mounted: listed, and adopt
    and drop are refused without --force, naming the process."""
    ws = parent
    fork(ws, "a")
    runner = subprocess.Popen(
        [*COWFS, "run", "--fork", "a", "--", "sh", "-c", "echo started > started; sleep 60"],
        cwd=ws.path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not forks_of(ws)["a"]["users"]:
            assert time.monotonic() < deadline, "the command in the fork was never seen"
            time.sleep(0.1)
        for cmd in (["adopt", "a"], ["drop", "a"]):
            r = ws.cowfs(*cmd, check=False)
            assert r.returncode == ALREADY_MOUNTED and "in use by process" in r.stderr, r.stderr
        assert forks_of(ws)["a"]["mounted"]
    finally:
        os.killpg(runner.pid, signal.SIGKILL)  # (the command and its shell too)
        runner.wait()
    drop_when_unused(ws, "a")


def _argv(pid: int) -> list[bytes]:
    """Process *pid*'s command line (without the NUL bytes that pad it)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _sockets(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:"):
                out.add(target)
    return out


def test_a_forks_processes_are_forked_from_its_workspaces_zygote_and_say_what_they_are(parent):
    """A fork's view and daemon are forks of a process that has imported
    them (started by the workspace's daemon at its first fork), not new
    interpreters: each reads as `python -m MODULE ARGS` in ps, holds none
    of the zygote's descriptors, and lives on when the workspace's daemon
    and its zygote end."""
    ws = parent
    f = fork(ws, "a")
    daemon = MountRecord.load(str(f)).pid
    zygote = _ppid(daemon)
    assert _argv(zygote)[1:4] == [b"-P", b"-m", b"cowfs.service.zygote"]
    assert _ppid(zygote) == ws.daemon_pid()
    argv = _argv(daemon)
    assert argv[1:4] == [b"-P", b"-m", b"cowfs.service.daemon"] and argv[-1] == os.fsencode(f)
    views = view_processes(f.parent / "lower")
    assert len(views) == 1 and _ppid(views[0]) == zygote
    assert _argv(views[0])[-1] == os.fsencode(f.parent / "lower")
    theirs = _sockets(zygote)
    for pid in (daemon, views[0]):
        assert not _sockets(pid) & theirs, "a descriptor of the zygote leaked"
    g = fork(ws, "b")
    assert _ppid(MountRecord.load(str(g)).pid) == zygote
    then = treesnap.snapshot(f)
    ws.kill()
    deadline = time.monotonic() + 10
    while pid_alive(zygote) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pid_alive(zygote), "the zygote outlived its workspace's daemon"
    same(then, treesnap.snapshot(f))
    (f / "after.txt").write_text("served without the zygote\n")
    assert ws.cowfs("mount", ws.path).returncode == 0
    assert ws.json("--fork", "a", "status")["changes"][0]["path"] == "after.txt"


def test_a_killed_zygote_leaves_forks_to_start_as_new_processes_then_a_new_zygote(parent):
    ws = parent
    then = ws.snapshot()
    f = fork(ws, "a")
    zygote = _ppid(MountRecord.load(str(f)).pid)
    os.kill(zygote, signal.SIGKILL)
    while pid_alive(zygote):
        time.sleep(0.01)
    g = fork(ws, "b")  # (its processes started afresh)
    assert _ppid(MountRecord.load(str(g)).pid) != zygote
    same(then, treesnap.snapshot(g))
    h = fork(ws, "c")  # (a new zygote)
    again = _ppid(MountRecord.load(str(h)).pid)
    assert again != zygote and _argv(again)[1:4] == [b"-P", b"-m", b"cowfs.service.zygote"]
    same(then, treesnap.snapshot(h))
    for name in ("a", "b", "c"):
        ws.cowfs("drop", name)
    assert not fork_mounts(ws.path)


def test_diff_of_two_forks_is_every_path_that_differs_between_them(parent):
    """`diff --fork A --fork B`: each path whose state differs between the
    two forks as they are now, as from A to B -- what either changed since
    its fork point and what the workspace changed between their fork
    points -- checked against the two trees compared whole."""
    ws = parent
    a = fork(ws, "a")
    (ws / "between.txt").write_text("made between the two fork points\n")
    os.chmod(ws / "src" / "a.txt", 0o600)
    b = fork(ws, "b")
    (a / "src" / "a.txt").write_text("a's\n")
    (b / "src" / "a.txt").write_text("b's\n")
    (a / "only-a").mkdir()
    (a / "only-a" / "f").write_text("in a alone\n")
    os.unlink(b / "big.bin")
    os.chmod(b / "empty", 0o700)
    (b / "node_modules" / "pkg" / "index.js").write_text("module.exports = 2\n")  # (ignored)
    (a / "both.txt").write_text("the same bytes\n")
    os.utime(a / "both.txt", ns=(10**18, 10**18))
    (b / "both.txt").write_text("the same bytes\n")
    (ws / "after.txt").write_text("the workspace's own, later\n")  # (in neither fork)
    got = {c["path"]: c["kind"] for c in ws.json("diff", "--fork", "a", "--fork", "b")["changes"]}
    assert got == {
        "between.txt": "A",
        "src/a.txt": "M",
        "src/a.hard": "M",  # (a hard link of it)
        "only-a": "D",
        "only-a/f": "D",
        "big.bin": "D",
        "empty": "m",
        "node_modules/pkg/index.js": "M",
        "both.txt": "t",
    }
    # the same, from the trees: every entry that differs but a directory's time
    sa, sb = treesnap.snapshot(a), treesnap.snapshot(b)
    differ = set()
    for p in set(sa) | set(sb):
        x, y = sa.get(p), sb.get(p)
        if x is not None and y is not None and x.kind == "dir":
            x, y = dataclasses.replace(x, mtime_ns=0), dataclasses.replace(y, mtime_ns=0)
        if x != y:
            differ.add(os.fsdecode(p))
    assert differ == set(got)
    r = ws.cowfs("diff", "--fork", "b", "--fork", "a")
    assert r.stdout.splitlines() == [
        "D\tbetween.txt",
        "A\tbig.bin",
        "m\tempty",
        "M\tnode_modules/pkg/index.js",
        "A\tonly-a",
        "A\tonly-a/f",
        "M\tsrc/a.hard",
        "M\tsrc/a.txt",
        "# 1 path differs only in its modification time (--times lists it)",
    ]
    r = ws.cowfs("diff", "--fork", "a", "--fork", "b", "--fork", "c", check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1


@pytest.mark.parametrize("at", [1024, 1025, 1030, 4000])
def test_the_zygote_gives_a_process_its_descriptors_at_their_numbers_however_high(tmp_path, at):
    """The daemon's descriptors can be numbered past 1024 (an agent holding
    files open): each arrives in the process the zygote makes at the number
    the daemon gave it, the others too (there, a daemon's report of a
    workspace that does not exist comes back on its ready descriptor)."""
    import resource

    from cowfs.service.zygote import Zygote

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    z = Zygote()
    z.start()
    r, w = os.pipe()
    try:
        os.dup2(w, at)
        os.dup2(os.open(os.devnull, os.O_RDONLY), at + 1)  # (one more, next to it)
        child = z.spawn(
            "cowfs.service.daemon",
            ["--ready-fd", str(at), str(tmp_path / "missing")],
            (at, at + 1),
        )
        assert child is not None and child.pid > 0
        os.close(at)
        os.close(at + 1)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            report = json.loads(f.read())
        assert report["ok"] is False and "missing" in report["error"], report
        child.wait(timeout=30)
    finally:
        z.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
