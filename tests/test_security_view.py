"""`cowfs view ID DIR` run by root where an agent (an unprivileged user,
here "nobody") can plant symlinks: the view is mounted on the directory
DIR names, opened once without following a link the agent may have put
on the way, or not at all -- never over a directory elsewhere that the
agent pointed at (a victim: root's 0700 directory outside the workspace),
not inside a workspace, and not on a name looked up again after the check
(an agent swapping a directory and a symlink all the while)."""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cowfs.errors import BAD_WORKSPACE, USAGE
from cowfs.layers import treesnap
from cowfs.system import backing as B
from cowfs.system.mounts import VIEW_FSTYPE, mounts, within

from . import users
from .helpers import COWFS, managed_workspace, reachable_workspace, run, view_processes

AGENT = pwd.getpwnam("nobody")


def as_agent(fn, *args):
    return users.run_as(AGENT.pw_uid, AGENT.pw_gid, fn, *args)


def plant(where: Path, name: str, target: str) -> None:
    """The agent makes the symlink *where*/*name* -> *target* (through a
    descriptor: the test's directories above *where* are root's alone)."""
    fd = os.open(where, os.O_PATH | os.O_DIRECTORY)
    try:
        as_agent(lambda: os.symlink(target, name, dir_fd=fd))
    finally:
        os.close(fd)
    assert os.lstat(where / name).st_uid == AGENT.pw_uid


def agents_dir(path: Path) -> Path:
    path.mkdir()
    os.chown(path, AGENT.pw_uid, AGENT.pw_gid)
    return path


def mounted_under(path: Path) -> list[str]:
    return [f"{m.fstype} at {m.mountpoint}" for m in mounts() if within(m.mountpoint, str(path))]


def clear_views(path: Path) -> None:
    """Unmount whatever is mounted at or under *path* (a refusal that
    failed), top first, and kill the view processes started for it."""
    for _ in range(16):
        found = [m.mountpoint for m in mounts() if within(m.mountpoint, str(path))]
        if not found:
            break
        subprocess.run(["umount", "-l", found[-1]], capture_output=True)
    for pid in view_processes(path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def refused(r: subprocess.CompletedProcess, code: int, *words: str) -> str:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    return r.stderr


@pytest.fixture
def victim(tmp_path) -> Iterator[Path]:
    """Root's 0700 directory outside every workspace, with a file and a
    subdirectory: afterwards nothing is mounted on or in it, and it is as
    it was (names, bytes, modes, owners, mtimes)."""
    v = tmp_path / "victim"
    (v / "inner").mkdir(parents=True)
    (v / "secret").write_text("root only\n")
    os.chmod(v, 0o700)
    os.chmod(v / "inner", 0o700)
    before = treesnap.snapshot(v)
    try:
        yield v
    finally:
        where = mounted_under(v)
        clear_views(v)
        assert where == [], f"mounted over the victim: {where}"
        treesnap.assert_same(before, treesnap.snapshot(v))
        st = os.stat(v)
        assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o700)


@pytest.fixture
def home(tmp_path) -> Iterator[Path]:
    """A directory of the agent's outside the workspace (its /tmp/x)."""
    h = agents_dir(tmp_path / "agent")
    try:
        yield h
    finally:
        clear_views(h)


def test_a_symlink_planted_in_the_workspace_is_not_followed(mounted, victim):
    ws = mounted
    layer = ws.checkpoint()
    mine = agents_dir(ws / "mine")
    plant(mine, "view", str(victim))
    r = ws.cowfs("view", layer, mine / "view", check=False)
    refused(r, BAD_WORKSPACE, "inside the mounted cowfs workspace")
    assert mounted_under(victim) == [] and mounted_under(mine) == []


def test_a_symlink_planted_outside_any_workspace_is_not_followed(mounted, victim, home):
    ws = mounted
    layer = ws.checkpoint()
    plant(home, "view", str(victim))
    r = ws.cowfs("view", layer, home / "view", check=False)
    refused(r, USAGE, f"{home}/view is a symlink owned by another user (uid {AGENT.pw_uid})")
    assert mounted_under(victim) == [] and mounted_under(home) == []
    assert os.readlink(home / "view") == str(victim)  # (left as it is)


def test_a_symlink_planted_in_a_parent_component_is_not_followed(mounted, victim, home):
    ws = mounted
    layer = ws.checkpoint()
    plant(home, "up", str(victim))
    r = ws.cowfs("view", layer, home / "up" / "inner", check=False)
    refused(r, USAGE, f"{home}/up is a symlink owned by another user")
    # a relative link one level further down is no different
    plant(home, "rel", "up/inner")
    r = ws.cowfs("view", layer, home / "rel", check=False)
    refused(r, USAGE, f"{home}/rel is a symlink owned by another user")
    assert mounted_under(victim) == []


def test_a_directory_inside_a_workspace_is_refused(mounted, tmp_path):
    ws = mounted
    layer = ws.checkpoint()
    (ws / "dir" / "empty").mkdir()
    r = ws.cowfs("view", layer, ws / "dir" / "empty", check=False)
    refused(r, BAD_WORKSPACE, "inside the mounted cowfs workspace", str(ws.path))
    r = ws.cowfs("view", layer, ws / ".cowfs", check=False)  # (hidden in the mount)
    refused(r, BAD_WORKSPACE, "inside the mounted cowfs workspace")
    assert mounted_under(ws.path) == [f"fuse.cowfs at {ws.path}"]


def test_the_backing_directory_of_a_workspace_mounted_elsewhere_is_refused(mounted, tmp_path):
    """A workspace mounted at another mount point leaves its backing
    directory (and store) visible: a view there is refused too, from
    another workspace's command as from its own."""
    backing = tmp_path / "backing"
    (backing / "sub").mkdir(parents=True)
    with managed_workspace(tmp_path / "mnt") as split:
        run("mount", backing, split.path)
        split.mounted = True
        for who in (split, mounted):
            layer = who.checkpoint()
            for where, what in (
                (backing / "sub", "the backing directory of the cowfs workspace"),
                (backing / ".cowfs", "the store of the cowfs workspace"),
                (backing / ".cowfs" / "db", "the store of the cowfs workspace"),
            ):
                r = who.cowfs("view", layer, where, check=False)
                refused(r, BAD_WORKSPACE, what, str(backing))
        assert mounted_under(backing) == []
        split.teardown()


def test_a_normal_view_and_a_link_of_roots_own_still_work(mounted, view_dir, tmp_path):
    """The view is mounted at DIR as before; a symlink that only root (the
    invoking user) could have made, in a directory only root may write, is
    followed (as /tmp -> private/tmp is)."""
    ws = mounted
    layer = ws.checkpoint()
    (ws / "a.txt").write_text("changed\n")
    ws.cowfs("view", layer, view_dir)
    assert (view_dir / "a.txt").read_text() == "alpha\n"
    assert [m.fstype for m in mounts() if m.mountpoint == str(view_dir)] == [VIEW_FSTYPE]
    ws.cowfs("unmount", view_dir)
    assert mounted_under(view_dir) == []

    os.symlink(view_dir, tmp_path / "roots-link")
    r = ws.cowfs("view", layer, tmp_path / "roots-link")
    assert f"is at {view_dir} " in r.stdout, r.stdout
    assert (view_dir / "a.txt").read_text() == "alpha\n"
    assert mounted_under(view_dir) == [f"{VIEW_FSTYPE} at {view_dir}"]
    ws.cowfs("unmount", view_dir)
    assert mounted_under(view_dir) == []


@contextlib.contextmanager
def swapping(where: Path, a: str, b: str) -> Iterator[None]:
    """The agent exchanges the names *a* and *b* in *where* as fast as it
    can (renameat2 RENAME_EXCHANGE) until the block ends."""
    fd = os.open(where, os.O_PATH | os.O_DIRECTORY)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the agent
        try:
            users.become(AGENT.pw_uid, AGENT.pw_gid)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError):  # (EBUSY once a view is on it)
                    B.renameat2(fd, a.encode(), fd, b.encode(), B.RENAME_EXCHANGE)
        finally:
            os._exit(0)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)


def test_a_directory_swapped_for_a_symlink_meanwhile_is_never_left_for_the_link(
    mounted, victim, home
):
    """The agent swaps a directory of its own and a symlink to the victim
    while root asks for views at the directory's name: each view is refused
    (the name was the link when it was looked at) or mounted on the agent's
    directory (wherever it is named by then), never on the victim."""
    ws = mounted
    layer = ws.checkpoint()
    (home / "d").mkdir()
    os.chown(home / "d", AGENT.pw_uid, AGENT.pw_gid)
    plant(home, "s", str(victim))
    outcomes = []
    with swapping(home, "d", "s"):
        for _ in range(12):
            r = ws.cowfs("view", layer, home / "d", check=False)
            outcomes.append(r.returncode)
            assert mounted_under(victim) == [], r.stdout
            if r.returncode == 0:
                [(mp, fstype)] = [
                    (m.mountpoint, m.fstype) for m in mounts() if within(m.mountpoint, str(home))
                ]
                assert fstype == VIEW_FSTYPE and mp in (f"{home}/d", f"{home}/s"), mp
                subprocess.run(["umount", "-l", mp], check=True)
            else:
                refused(r, USAGE, "is a symlink owned by another user")
    assert set(outcomes) <= {0, USAGE}, outcomes


@contextlib.contextmanager
def cache_workspace(prefix: str) -> Iterator[tuple]:
    """A workspace whose directory cache/ (ignored, the agent's to write)
    is seen through views at VIEW: (workspace, cache, VIEW); views and the
    workspace go away afterwards, whatever happened."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(base, 0o755)
    view_dir = base / "view"
    view_dir.mkdir()
    try:
        with managed_workspace(base / "ws") as ws:
            os.chmod(ws.path, 0o755)
            (ws / ".cowfsignore").write_text("cache/\n")
            yield ws, agents_dir(ws / "cache"), view_dir
    finally:
        clear_views(base)
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


def test_a_file_open_in_a_view_never_reads_another_object_put_at_its_ignored_name():
    """The agent opens its own file in a view (its name at an ignored path:
    nothing it does there is captured), then renames root's 0600 file --
    made in the same ignored directory, which the agent may write -- over
    that name.  Reading the descriptor it opened must not give it root's
    bytes: the view read the object the name leads to now, as root, past
    the permission check it made at open."""
    with cache_workspace("cowfs-viewswap-") as (ws, cache, view_dir):
        (cache / "mine").write_text("the agent's own\n")
        os.chown(cache / "mine", AGENT.pw_uid, AGENT.pw_gid)
        (cache / "other").write_text("the agent's other\n")
        os.chown(cache / "other", AGENT.pw_uid, AGENT.pw_gid)
        ws.mount()
        layer = ws.checkpoint()
        fd = os.open(cache / "root", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"ROOT SECRET\n")
        os.close(fd)
        ws.cowfs("view", layer, view_dir)
        try:

            def swap_and_read() -> bytes:
                fd = os.open(view_dir / "cache" / "mine", os.O_RDONLY)
                try:
                    os.rename(cache / "root", cache / "mine")
                    time.sleep(1.5)  # (the view's entry and attribute timeout)
                    return os.pread(fd, 100, 0)
                except OSError as e:
                    return f"error {e.errno}".encode()
                finally:
                    os.close(fd)

            def wait_and_read() -> bytes:
                fd = os.open(view_dir / "cache" / "other", os.O_RDONLY)
                try:
                    time.sleep(1.5)
                    return os.pread(fd, 100, 0)
                finally:
                    os.close(fd)

            # with nothing swapped, a file open in the view reads its bytes
            assert as_agent(wait_and_read) == b"the agent's other\n"
            seen = as_agent(swap_and_read)
            assert b"ROOT SECRET" not in seen, seen
        finally:
            ws.cowfs("unmount", view_dir, check=False)


def test_a_view_never_serves_a_freed_numbers_cached_bytes_to_the_next_object():
    """Root reads its 0600 file through a view (at an ignored path: the
    view shows it as it is now) and removes it (uncaptured); the agent
    makes a file in the same directory, which the filesystem gives the
    freed inode number, with the size and mtime root's had.  Reading it
    through the view must give the agent its own bytes: the view numbers
    an object by its inode number, and the kernel's cached pages of that
    number were root's (the view kept them between opens)."""
    secret = b"ROOT SECRET 0123456789abcdef\n"
    with cache_workspace("cowfs-viewcache-") as (ws, cache, view_dir):
        ws.mount()
        layer = ws.checkpoint()
        ws.cowfs("view", layer, view_dir)
        try:
            reused = False
            for i in range(20):
                fd = os.open(cache / "root", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                os.write(fd, secret)
                os.close(fd)
                st = os.stat(cache / "root")
                assert (view_dir / "cache" / "root").read_bytes() == secret
                os.unlink(cache / "root")
                mine = f"y{i}"

                def make_and_read(name: str = mine, st: os.stat_result = st) -> tuple:
                    path = cache / name
                    path.write_bytes(b"x" * len(secret))
                    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
                    return os.stat(path).st_ino, (view_dir / "cache" / name).read_bytes()

                ino, seen = as_agent(make_and_read)
                assert seen == b"x" * len(secret), (ino == st.st_ino, seen)
                if ino == st.st_ino:
                    reused = True
                    break
            if not reused:
                pytest.skip("the filesystem gave the freed inode number to no new file")
        finally:
            ws.cowfs("unmount", view_dir, check=False)


def test_a_module_the_agent_plants_where_the_workspace_was_mounted_from_never_runs(tmp_path):
    """`cd project/work && cowfs mount ..`: the daemon started in a
    directory of the workspace the agent writes, and it starts its views,
    its forks and their zygote as root.  A `cowfs` package the agent puts
    there (under the mount) is never imported by them: they start with no
    caller's directory on the module path (-P), from /."""
    marks = tmp_path / "marks"
    marks.mkdir()
    os.chmod(marks, 0o777)
    with reachable_workspace("cowfs-plant-") as ws:
        work = agents_dir(ws.path / "work")
        r = subprocess.run(
            [*COWFS, "mount", "--allow", f"{AGENT.pw_name}:read", ".."],
            cwd=work,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        ws.mounted = True
        payload = f"import os\nopen('{marks}/ran-as-%d' % os.getuid(), 'w').close()\n"

        def plant_package() -> None:
            for pkg in ("cowfs", "cowfs/fuse", "cowfs/service"):
                os.mkdir(work / pkg)
                (work / pkg / "__init__.py").write_text(payload)
            (work / "cowfs" / "__main__.py").write_text(payload)

        as_agent(plant_package)
        view_dir = agents_dir(tmp_path / "view")
        code, out, err = users.cowfs_as(
            AGENT.pw_uid, AGENT.pw_gid, ws.path, ["view", "1", str(view_dir)]
        )
        try:
            assert os.listdir(marks) == [], "the planted module ran"
            assert code == 0, err
            assert not (view_dir / "work" / "cowfs").exists()  # (the past)
            f = Path(ws.json("fork", "f")["path"])  # (the zygote, the fork's view and daemon)
            assert (f / "work" / "cowfs" / "__init__.py").read_text() == payload
            assert os.listdir(marks) == [], "the planted module ran"
        finally:
            run("unmount", view_dir, check=False)
            ws.cowfs("drop", "--force", "f", check=False)
