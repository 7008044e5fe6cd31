"""Where and when mounts and views may be made and unmounted, on real
mounts: `view` beside a daemon that holds thousands of files, a second view
on the same directory, a view that fails to start; nested workspaces, a
workspace mounted twice; lazy unmount while processes use the mount."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cowfs.errors import ALREADY_MOUNTED, BAD_WORKSPACE, DAEMON_ERROR, CowfsError, NotMounted
from cowfs.storage import schema as S
from cowfs.storage.store import Store
from cowfs.system.mounts import (
    DEAD,
    LIVE,
    UNMOUNTED,
    MountRecord,
    default_store,
    find_mount,
    finish_unmount,
    is_cowfs_mount,
    locate,
    mounted_elsewhere,
    mounts,
    pid_alive,
)

from .helpers import COWFS, Workspace, managed_workspace, run, view_processes

REPO = Path(__file__).resolve().parents[1]


def mounts_at(path: Path) -> list[str]:
    """The filesystem types mounted at *path*, bottom first."""
    return [m.fstype for m in mounts() if m.mountpoint == str(path)]


def one_line(r: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr


@contextlib.contextmanager
def undone(*paths: Path):
    """Whatever gets mounted at *paths* (a refusal that failed) is
    unmounted and its daemon killed afterwards, the first path first."""
    try:
        yield
    finally:
        for path in paths:
            Workspace(path).teardown()


def gone(pid: int, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not pid_alive(pid)


# -- views ------------------------------------------------------------------------------------


def test_view_beside_a_daemon_holding_thousands_of_fds_and_a_second_view_refused(mounted, view_dir):
    ws = mounted
    layer = ws.checkpoint("before the many")
    (ws / "many").mkdir()
    for i in range(3000):
        (ws / "many" / f"f{i}").write_text(f"{i}\n")
    subprocess.run("cat many/* > /dev/null", shell=True, cwd=ws.path, check=True)
    fds = len(os.listdir(f"/proc/{ws.daemon_pid()}/fd"))
    assert fds > 1100, f"the daemon holds only {fds} fds: select() would still work"

    ws.cowfs("view", layer, view_dir)
    assert sorted(os.listdir(view_dir)) == ["a.txt", "dir"]
    assert (view_dir / "dir" / "b.txt").read_text() == "beta\n"

    r = ws.cowfs("view", layer, view_dir, check=False)
    assert r.returncode == ALREADY_MOUNTED
    assert f"a cowfs view is already mounted at {view_dir}" in one_line(r)
    assert mounts_at(view_dir) == ["fuse.cowfs-view"]
    r = ws.cowfs("view", layer, ws.path, check=False)  # any kind of mount point
    assert r.returncode == ALREADY_MOUNTED
    assert f"{ws.path} is already a mount point (fuse.cowfs)" in one_line(r)
    assert mounts_at(ws.path) == ["fuse.cowfs"]

    [pid] = view_processes(view_dir)
    ws.cowfs("unmount", view_dir)
    assert mounts_at(view_dir) == [] and gone(pid)


@pytest.mark.parametrize("mode", ["garbage", "silent"])
def test_a_view_that_fails_after_it_started_leaves_no_mount_and_no_process(mounted, view_dir, mode):
    """The view process mounts, then sends an unreadable report, or none
    within the (here shortened) wait: the command fails with one line and
    takes the view down.  On an unmounted workspace the command itself
    starts the view, so the view module and the wait can be swapped in."""
    ws = mounted
    layer = ws.checkpoint()
    ws.unmount()
    code = (
        "import sys, cowfs.service.launch as d\n"
        "d.VIEW_MODULE, d.VIEW_TIMEOUT = 'tests.broken_view', 5\n"
        "from cowfs.interface.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = os.environ | {
        "BROKEN_VIEW": mode,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    r = subprocess.run(
        [sys.executable, "-c", code, "-C", str(ws.path), "view", str(layer), str(view_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == DAEMON_ERROR, r.stderr
    assert ("unreadable report" if mode == "garbage" else "did not report") in one_line(r)
    assert mounts_at(view_dir) == []
    assert view_processes(view_dir) == []
    ws.cowfs("view", layer, view_dir)  # the directory is usable
    assert sorted(os.listdir(view_dir)) == ["a.txt", "dir"]


def test_a_view_handler_that_fails_answers_an_errno_and_the_view_goes_on(
    mounted, view_dir, tmp_path
):
    """A handler's OSError answers its errno, anything unexpected answers EIO
    and is logged; neither takes the view down (pyfuse3 would end its loop)."""
    ws = mounted
    os.symlink("a.txt", ws / "link")
    layer = ws.checkpoint()
    ws.unmount()
    log = tmp_path / "view.log"
    code = (
        "import sys, cowfs.service.launch as d\n"
        "d.VIEW_MODULE = 'tests.broken_view'\n"
        "from cowfs.interface.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = os.environ | {
        "BROKEN_VIEW": "failing",
        "BROKEN_VIEW_LOG": str(log),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    r = subprocess.run(
        [sys.executable, "-c", code, "-C", str(ws.path), "view", str(layer), str(view_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    [pid] = view_processes(view_dir)
    for _ in range(2):
        with pytest.raises(PermissionError):
            os.readlink(view_dir / "link")
        with pytest.raises(OSError) as e:
            os.getxattr(view_dir / "a.txt", "user.k")
        assert e.value.errno == errno.EIO
        assert (view_dir / "a.txt").read_text() == "alpha\n"  # still serving
        assert sorted(os.listdir(view_dir)) == ["a.txt", "dir", "link"]
    assert mounts_at(view_dir) == ["fuse.cowfs-view"] and pid_alive(pid)
    logged = log.read_text()
    assert "getxattr failed" in logged and "RuntimeError: planted" in logged
    assert "readlink failed" not in logged  # an errno is no failure
    ws.cowfs("unmount", view_dir)
    assert mounts_at(view_dir) == [] and gone(pid)


# -- mount guards -----------------------------------------------------------------------------


def test_nested_workspaces_are_refused_either_way(workspace, tmp_path):
    outer = workspace
    (outer / "inner").mkdir()
    (tmp_path / "other").mkdir()
    outer.mount()
    nested = [  # (arguments of cowfs mount, what the message names)
        (
            [outer / "inner"],
            f"its workspace {outer / 'inner'} lies inside the mounted cowfs workspace {outer.path}",
        ),
        (
            ["--store", outer / "store", tmp_path / "other"],
            f"its store {outer / 'store'} lies inside the mounted cowfs workspace {outer.path}",
        ),
        (
            [tmp_path / "other", outer / "inner"],
            f"its mount point {outer / 'inner'} lies inside the mounted cowfs workspace",
        ),
        (
            [tmp_path],
            f"the mounted cowfs workspace {outer.path} lies inside its workspace {tmp_path}",
        ),
    ]
    with (
        managed_workspace(tmp_path / "mp") as mp,
        undone(outer / "inner", tmp_path / "other", tmp_path),
    ):
        for args, text in nested:
            r = run("mount", *args, check=False)
            assert r.returncode == BAD_WORKSPACE and text in one_line(r), (args, r.stderr)
        assert not any(is_cowfs_mount(str(p)) for p in (outer / "inner", tmp_path / "other"))
        assert outer.status() == []  # nothing of a store inside it

        outer.unmount()  # the backing path, mounted elsewhere
        run("mount", outer.path, mp.path)
        r = run("mount", outer / "inner", check=False)
        assert r.returncode == BAD_WORKSPACE
        assert (
            f"lies inside the mounted cowfs workspace {outer.path} (mounted at {mp.path})"
        ) in one_line(r)
        run("unmount", mp.path)

    with managed_workspace(outer / "inner" / "ws") as inner, undone(tmp_path / "other"):
        inner.mount()  # inner mounted, outer not
        for args in ([outer.path], [outer.path, tmp_path / "other"]):
            r = run("mount", *args, check=False)
            assert r.returncode == BAD_WORKSPACE
            assert (
                f"the mounted cowfs workspace {inner.path} lies inside its workspace {outer.path}"
            ) in one_line(r)
        assert not is_cowfs_mount(str(outer.path))


def test_a_mounted_workspace_mounted_again_says_where(workspace, tmp_path):
    ws = workspace
    ws.mount()
    pid = ws.daemon_pid()
    with managed_workspace(tmp_path / "mp1") as mp1, managed_workspace(tmp_path / "mp2") as mp2:
        for args in ([ws.path], [ws.path, mp2.path]):
            r = run("mount", *args, check=False)
            assert r.returncode == ALREADY_MOUNTED
            assert f"{ws.path} is already mounted over itself (cowfs daemon pid {pid})" in one_line(
                r
            )
        ws.unmount()
        run("mount", ws.path, mp1.path)
        pid = MountRecord.load(str(mp1.path)).pid
        for args in ([ws.path], [ws.path, mp2.path], [mp1.path, mp2.path]):
            r = run("mount", *args, check=False)
            assert r.returncode == ALREADY_MOUNTED
            assert (
                f"{ws.path} is already mounted at {mp1.path} (cowfs daemon pid {pid})"
                in one_line(r)
            )
        assert not is_cowfs_mount(str(mp2.path)) and not is_cowfs_mount(str(ws.path))
        run("unmount", mp1.path)


# -- unmounting -------------------------------------------------------------------------------

READER = (
    "import sys\nfor name in sys.stdin:\n    print(open(name.strip()).read(), end='', flush=True)\n"
)


def test_lazy_unmount_returns_at_once_and_the_daemon_serves_until_the_last_user_leaves(mounted):
    ws = mounted
    layer = ws.checkpoint("kept")
    (ws / "a.txt").write_text("changed\n")
    pid = ws.daemon_pid()
    in_cwd = subprocess.Popen(
        [sys.executable, "-c", READER],
        cwd=ws.path,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    open_file = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nf = open(sys.argv[1])\nprint('open', flush=True)\nsys.stdin.read()\n",
            ws / "dir" / "b.txt",
        ],
        cwd="/",
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    holders = (in_cwd, open_file)

    def read(name: str) -> str:
        in_cwd.stdin.write(name + "\n")
        in_cwd.stdin.flush()
        return in_cwd.stdout.readline()

    try:
        assert read("a.txt") == "changed\n" and open_file.stdout.readline() == "open\n"
        r = run("unmount", "--lazy", ws.path)
        assert f"detached {ws.path}: its daemon (pid {pid}) goes on serving" in r.stdout
        assert f"{in_cwd.pid} (python" in r.stdout and f"{open_file.pid} (python" in r.stdout
        assert not is_cowfs_mount(str(ws.path))
        assert pid_alive(pid)
        assert read("dir/b.txt") == "beta\n"  # still served, through the daemon
        r = run("mount", ws.path, check=False)  # its store is still in use
        assert r.returncode == ALREADY_MOUNTED
        assert (
            f"unmounted lazily from {ws.path} and its daemon (pid {pid}) still serves"
            in one_line(r)
        )
        for p in holders:
            p.stdin.close()
            p.wait(timeout=60)
        assert gone(pid), "the daemon did not exit after the last user left"
    finally:
        for p in holders:
            p.kill()
            p.wait()

    assert MountRecord.load(str(ws.path)) is None  # its clean exit, fully done
    store = Store.open(str(ws / ".cowfs"), str(ws.path), readonly=True)
    try:
        assert store.get_meta_json(S.K_STATE)["mounted"] is False
        assert store.get_meta_json(S.K_DRIFT) is not None
    finally:
        store.close()
    ws.mount()
    assert [layer_["message"] for layer_ in ws.log()][-1] == "kept"
    assert [(c["kind"], c["path"]) for c in ws.status()] == [("M", "a.txt")]
    ws.rollback(to=layer)
    assert (ws / "a.txt").read_text() == "alpha\n"
    pid = ws.daemon_pid()
    r = run("unmount", ws.path)  # plain: only once the daemon is gone
    assert r.stdout.strip() == f"unmounted {ws.path}" and not pid_alive(pid)
    ws.mounted = False


def test_unmount_says_so_when_the_daemon_is_still_finishing():
    busy = subprocess.Popen(["sleep", "600"])
    try:
        rec = MountRecord("/nowhere", "/nowhere", "/nowhere/.cowfs", busy.pid, "")
        with pytest.raises(CowfsError) as e:
            finish_unmount(rec, {"unmounted": "/nowhere"}, timeout=0.1)
        assert e.value.code == ALREADY_MOUNTED
        assert f"its daemon (pid {busy.pid}) is still finishing" in str(e.value)
        assert finish_unmount(rec, {"users": [1, 2]}) == [1, 2]  # detached: no wait
    finally:
        busy.kill()
        busy.wait()
    assert finish_unmount(rec, {"unmounted": "/nowhere"}) == []


def test_a_mount_while_the_last_daemon_finishes_waits_for_it(workspace, tmp_path):
    """After its mount is gone, a daemon records the workspace's state
    before it exits (longer, the more the layers changed), holding the
    store; a mount meanwhile waits for it instead of calling the store "in
    use by another process".  (The finishing daemon is played by a process
    holding the store's lock under a record that says it is finishing.)"""
    ws = workspace
    ws.mount()
    layer = ws.checkpoint("kept")
    (ws / "a.txt").write_text("changed\n")
    ws.unmount()
    gate = tmp_path / "gate"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "while not os.path.exists(sys.argv[2]): time.sleep(0.02)\n",
            str(ws / ".cowfs" / "lock"),
            str(gate),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    rec = MountRecord(
        str(ws.path), str(ws.path), str(ws / ".cowfs"), holder.pid, "/nowhere.sock", finishing=True
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        rec.save()
        mount = subprocess.Popen([*COWFS, "mount", str(ws.path)], stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not sleeping_daemon(mount.pid):  # (in its wait for the finishing one)
            assert time.monotonic() < deadline and mount.poll() is None
            time.sleep(0.02)
        gate.touch()
        holder.wait(timeout=30)
        rec.remove()
        _, err = mount.communicate(timeout=120)
        assert mount.returncode == 0, err
        ws.mounted = True
        assert f"s for the daemon of the last mount (pid {holder.pid}) to finish" in err
        assert [x["id"] for x in ws.log()][-1] == layer
    finally:
        gate.touch()
        holder.wait(timeout=30)
        rec.remove()


def sleeping_daemon(parent: int) -> bool:
    """Whether a cowfs daemon started by process *parent* waits (a timed
    sleep, or a poll: it is past its start-up)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"cowfs.service.daemon" not in f.read():
                    continue
            with open(f"/proc/{pid}/wchan") as f:
                # (a sleep, or a wait on the process's pidfd)
                if f.read() in ("hrtimer_nanosleep", "poll_schedule_timeout.constprop.0"):
                    return True
        except OSError:
            continue
    return False


def test_locate_says_where_a_workspace_is_and_in_what_state(mounted, tmp_path):
    ws, root = mounted, os.path.realpath(mounted.path)
    (ws / "d").mkdir()
    live = locate(str(ws / "d"))
    assert (live.state, live.root) == (LIVE, root) and live.record is not None
    assert live.record.pid == ws.daemon_pid() and find_mount(str(ws / "d")) == live.record
    ws.kill()
    dead = locate(str(ws / "d"))
    assert (dead.state, dead.root, dead.record.pid) == (DEAD, root, live.record.pid)
    with pytest.raises(NotMounted, match="daemon of this mount is gone"):
        dead.mounted(str(ws / "d"))
    assert dead.unmounted(str(ws / "d")) == (live.record.workspace, live.record.store)
    ws.mount()  # (recovers the dead mount)
    ws.unmount()
    here = locate(str(ws / "d" / "not yet"))
    assert (here.state, here.root, here.store) == (UNMOUNTED, root, default_store(root))
    assert here.unmounted(str(ws / "d")) == (root, None)
    with pytest.raises(NotMounted, match="not inside a mounted cowfs workspace"):
        here.mounted(str(ws / "d"))
    outside = tmp_path / "outside"
    outside.mkdir()
    nowhere = locate(str(outside))
    assert (nowhere.state, nowhere.root, nowhere.store) == (
        UNMOUNTED,
        os.path.realpath(outside),
        None,
    )
    with pytest.raises(NotMounted, match="not inside a cowfs workspace"):
        nowhere.unmounted(str(outside))
    assert mounted_elsewhere(root) is None


def test_a_workspace_mounted_elsewhere_is_found_by_its_record(workspace, tmp_path):
    with managed_workspace(tmp_path / "mp") as mp:
        run("mount", workspace.path, mp.path)
        found = mounted_elsewhere(os.path.realpath(workspace.path))
        assert found is not None and found.state == LIVE
        assert found.root == os.path.realpath(mp.path)
        run("unmount", mp.path)
