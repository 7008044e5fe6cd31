"""Hostile programs: no operation of cowfs reads or writes outside the
workspace and its store, whatever is planted in the tree.

The worst case is a program that changes the backing directory behind the
daemon's back (possible when the workspace is mounted at another
mountpoint, or while it is not mounted): directories swapped for symlinks
to a victim directory outside, symlinks in every component of a path,
directories renamed while a rollback runs.  The victim must stay untouched
(names, bytes, modes, mtimes); cowfs reports what it could not undo."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from cowfs.errors import PARTIAL
from cowfs.layers import treesnap

from .helpers import managed_workspace, reachable_workspace, run


@pytest.fixture
def victim(tmp_path):
    """A directory outside the workspace that mirrors its layout."""
    v = tmp_path / "victim"
    for d in ("d/sub", "a/b/c", "x", "y"):
        (v / d).mkdir(parents=True)
    for f in ("d/f", "d/sub/g", "d/new", "a/b/c/f", "x/f0", "y/f0", "f"):
        (v / f).write_text("victim\n")
    before = treesnap.snapshot(v)
    yield v
    treesnap.assert_same(before, treesnap.snapshot(v))  # untouched, mtimes included


class Split:
    """A workspace mounted at another mountpoint: `mnt` is the cowfs view,
    `backing` the directory underneath, which a hostile program can reach."""

    def __init__(self, ws, backing: Path):
        self.ws, self.backing, self.mnt = ws, backing, ws.path

    def cowfs(self, *args, check=True):
        return self.ws.cowfs(*args, check=check)


@pytest.fixture
def split(tmp_path, fuse):
    backing = tmp_path / "backing"
    backing.mkdir()
    with managed_workspace(tmp_path / "mnt") as ws:
        run("mount", backing, ws.path)
        ws.mounted = True
        yield Split(ws, backing)
        ws.teardown()
    log = backing / ".cowfs" / "daemon.log"
    errors = [line for line in log.read_text().splitlines() if "Traceback" in line]
    assert not errors, log.read_text()


def as_user(user, *argv: str) -> None:
    """Run a command as *user* (a pwd entry), with no supplementary groups."""
    subprocess.run(
        ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *argv],
        check=True,
    )


def populate(root: Path) -> None:
    (root / "d" / "sub").mkdir(parents=True)
    (root / "d" / "f").write_text("original\n")
    (root / "d" / "sub" / "g").write_text("g\n")
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "a" / "b" / "c" / "f").write_text("deep\n")


def change(root: Path) -> None:
    """Changes of every kind under d/ and a/ (through the mount)."""
    (root / "d" / "f").write_text("changed\n")
    os.chmod(root / "d" / "f", 0o600)
    (root / "d" / "new").write_text("new\n")
    os.unlink(root / "d" / "sub" / "g")
    os.setxattr(root / "d" / "sub", "user.k", b"v")
    (root / "a" / "b" / "c" / "f").write_text("deep change\n")
    os.rename(root / "a" / "b" / "c" / "f", root / "a" / "b" / "c" / "f2")


def test_directory_swapped_for_a_symlink_behind_the_daemon(split, victim):
    populate(split.mnt)
    split.cowfs("commit")
    split.cowfs("checkpoint")
    change(split.mnt)
    # behind the daemon's back: d and a become symlinks to the victim
    os.rename(split.backing / "d", split.backing / "d.moved")
    os.symlink(victim / "d", split.backing / "d")
    os.rename(split.backing / "a", split.backing / "a.moved")
    os.symlink(victim / "a", split.backing / "a")
    r = split.cowfs("rollback", check=False)
    assert r.returncode == PARTIAL, r.stderr
    assert "d/f" in r.stderr or "d/" in r.stderr  # what could not be undone is named
    assert os.readlink(split.backing / "d") == str(victim / "d")
    assert split.cowfs("status").returncode == 0  # the daemon is alive


@pytest.mark.parametrize("component", ["a", "a/b", "a/b/c"])
def test_symlink_planted_in_any_component_of_a_path(split, victim, component):
    populate(split.mnt)
    split.cowfs("commit")
    split.cowfs("checkpoint")
    change(split.mnt)
    planted = split.backing / component
    os.rename(planted, planted.with_name(planted.name + ".moved"))
    os.symlink(victim / component, planted)
    r = split.cowfs("rollback", check=False)
    assert r.returncode == PARTIAL, r.stderr
    assert "a/b/c/f" in r.stderr
    # the rest was undone
    assert (split.mnt / "d" / "f").read_text() == "original\n"
    assert (split.mnt / "d" / "sub" / "g").read_text() == "g\n"


def test_symlink_to_root_planted_through_the_mount_is_undone(split, victim):
    """The ordinary case: the swap is made through the mount, so it is
    captured like any change and undone first."""
    populate(split.mnt)
    split.cowfs("commit")
    before = treesnap.snapshot(split.mnt)
    split.cowfs("checkpoint")
    change(split.mnt)
    os.rename(split.mnt / "d", split.mnt / "d2")
    os.symlink("/", split.mnt / "d")
    os.symlink(victim, split.mnt / "a" / "b" / "c" / "f")
    (split.mnt / "d2" / "f").write_text("through the moved dir\n")
    split.cowfs("rollback")
    treesnap.assert_same(before, treesnap.snapshot(split.mnt))


def test_directories_renamed_and_swapped_while_a_rollback_runs(split, victim):
    for d in ("x", "y"):
        (split.mnt / d).mkdir()
        for i in range(400):
            (split.mnt / d / f"f{i}").write_text(f"{d}{i}\n")
    split.cowfs("commit")
    split.cowfs("checkpoint")
    for d in ("x", "y"):
        for i in range(400):
            (split.mnt / d / f"f{i}").write_text("changed\n")
            os.chmod(split.mnt / d / f"f{i}", 0o600)
    stop = threading.Event()
    swaps = 0

    def hostile():
        nonlocal swaps
        b = split.backing
        while not stop.is_set():
            for d in ("x", "y"):
                try:
                    os.rename(b / d, b / f"{d}.away")
                    os.symlink(victim / d, b / d)
                    time.sleep(0.001)
                    os.unlink(b / d)
                    os.rename(b / f"{d}.away", b / d)
                    swaps += 1
                except OSError:
                    pass

    t = threading.Thread(target=hostile)
    t.start()
    try:
        r = split.cowfs("rollback", check=False)
    finally:
        stop.set()
        t.join()
    assert swaps > 0
    assert r.returncode in (0, PARTIAL), r.stderr
    for d in ("x", "y"):  # the hostile thread put everything back in the end
        assert (split.backing / d).is_dir() and not (split.backing / d).is_symlink()


def test_store_is_unreachable_through_the_mount(split):
    populate(split.mnt)
    m = split.mnt
    for path in (m / ".cowfs", m / "d" / ".." / ".cowfs", m / "d" / "sub" / ".." / ".." / ".cowfs"):
        with pytest.raises(FileNotFoundError):
            os.lstat(path)
    root = os.open(m, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(FileNotFoundError):
            os.open(".cowfs", os.O_RDONLY, dir_fd=root)
        with pytest.raises(FileNotFoundError):
            os.open("d/../.cowfs/db/data.mdb", os.O_RDONLY, dir_fd=root)
        assert ".cowfs" not in os.listdir(root)
    finally:
        os.close(root)
    for action in (
        lambda: os.rename(m / "d", m / ".cowfs"),
        lambda: os.link(m / "d" / "f", m / ".cowfs"),
        lambda: os.symlink(".", m / ".cowfs"),
        lambda: os.rename(m / "d" / "f", m / "d" / ".." / ".cowfs"),
    ):
        with pytest.raises(OSError) as e:
            action()
        assert e.value.errno == errno.EPERM
    # a directory elsewhere may have that name: it is user data, not the store
    (m / "d" / ".cowfs").mkdir()
    assert os.listdir(m / "d" / ".cowfs") == []
    assert (split.backing / ".cowfs" / "db" / "data.mdb").exists()


def test_tar_with_hostile_member_paths_stays_inside(split, victim, tmp_path):
    """A real program writing through symlinks it planted: tar extracting
    an archive whose members try to escape; whatever tar does, rollback
    puts the workspace back and the victim is untouched."""
    populate(split.mnt)
    split.cowfs("commit")
    before = treesnap.snapshot(split.mnt)
    src = tmp_path / "evil"
    src.mkdir()
    os.symlink(victim, src / "escape")
    (src / "plain").write_text("plain\n")
    archive = tmp_path / "evil.tar"
    subprocess.run(["tar", "-C", src, "-cf", archive, "escape", "plain"], check=True)
    split.cowfs("checkpoint")
    subprocess.run(["tar", "-C", split.mnt, "-xf", archive], check=True)
    assert (split.mnt / "escape").is_symlink()
    split.cowfs("rollback")
    treesnap.assert_same(before, treesnap.snapshot(split.mnt))
    shutil.rmtree(src)


def test_an_agent_swapping_its_files_with_roots_during_an_offline_rollback_gains_nothing(fuse):
    """Unmounted, the agent (nobody) reaches the backing directory itself.
    Its directory holds its own files, which the layer chmodded, beside
    root's 0600 files; while root rolls the layer back, it keeps exchanging
    the names of each pair (renameat2 RENAME_EXCHANGE), and the rollback's
    checks are slowed (strace delays each stat 20 ms) to widen the window
    between a check and what follows.  Every step acts on the object it
    checked, through one descriptor: root's files keep their owner and
    mode whatever name they have, and a step that meets the wrong object
    says so."""
    import ctypes
    import pwd
    import tempfile

    from . import users
    from .helpers import COWFS

    agent = pwd.getpwnam("nobody")
    pairs = 10
    base = Path(tempfile.mkdtemp(prefix="cowfs-swap-"))
    os.chmod(base, 0o755)
    try:
        with managed_workspace(base / "ws") as ws:
            os.chmod(ws.path, 0o755)
            mine = ws / "agent"
            mine.mkdir()
            os.chown(mine, agent.pw_uid, agent.pw_gid)
            for k in range(pairs):
                (mine / f"a{k}").write_text("agent file\n")
                os.chown(mine / f"a{k}", agent.pw_uid, agent.pw_gid)
                os.chmod(mine / f"a{k}", 0o666)
                (mine / f"v{k}").write_text("ROOT SECRET\n")
                os.chmod(mine / f"v{k}", 0o600)
            ws.mount()
            ws.checkpoint()
            for k in range(pairs):
                os.chmod(mine / f"a{k}", 0o600)  # (recorded: put back at 0666)
            (mine / "many").mkdir()
            for i in range(100):  # (undone first: the agent's cue)
                (mine / "many" / f"m{i}").write_text("")
            ws.unmount()
            racer = os.fork()
            if racer == 0:  # pragma: no cover - the agent
                try:
                    users.become(agent.pw_uid, agent.pw_gid)
                    libc = ctypes.CDLL(None, use_errno=True)
                    os.chdir(mine)
                    while os.path.exists("many/m99"):
                        pass
                    end = time.monotonic() + 120
                    while time.monotonic() < end:
                        for k in range(pairs):
                            libc.renameat2(-100, b"a%d" % k, -100, b"v%d" % k, 2)
                            time.sleep(0.003)
                finally:
                    os._exit(0)
            try:
                r = subprocess.run(
                    ["strace", "-f", "-qq", "-o", "/dev/null"]
                    + ["-e", "inject=newfstatat:delay_exit=20000"]
                    + [*COWFS, "-C", str(ws.path), "rollback", "--yes", "--no-redo"],
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
            finally:
                os.kill(racer, 9)
                os.waitpid(racer, 0)
            assert "Traceback" not in r.stderr
            assert r.returncode in (0, PARTIAL), r.stderr
            for p in mine.iterdir():
                if p.is_file() and p.read_text() == "ROOT SECRET\n":
                    st = p.lstat()
                    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600), p.name
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


def test_a_symlink_name_a_rollback_took_never_leads_the_daemon_to_what_is_there_next(fuse):
    """The agent links its symlink to a second name in a shared directory
    (its entry cached by the kernel), a rollback without a redo takes that
    name away, and root makes a 0600 file with an xattr at it.  The agent's
    calls on its own symlink -- which the daemon makes by name, as Linux
    takes a symlink itself by name only -- must reach the symlink: its
    xattrs, and a new link of it, not root's file."""
    import pwd
    import tempfile

    from . import users

    agent = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="cowfs-symlink-"))
    os.chmod(base, 0o755)
    try:
        with managed_workspace(base / "ws") as ws:
            os.chmod(ws.path, 0o755)
            (ws / "agent").mkdir()
            os.chown(ws / "agent", agent.pw_uid, agent.pw_gid)
            os.symlink("target", ws / "agent" / "s")
            os.lchown(ws / "agent" / "s", agent.pw_uid, agent.pw_gid)
            (ws / "shared").mkdir()
            os.chmod(ws / "shared", 0o1777)
            ws.mount()
            ws.checkpoint()
            s, q, x = ws / "agent" / "s", ws / "shared" / "q", ws / "agent" / "x"

            def second_name() -> int:
                os.lstat(s)
                os.link(s, q, follow_symlinks=False)
                return os.lstat(s).st_nlink

            assert users.run_as(agent.pw_uid, agent.pw_gid, second_name) == 2
            ws.cowfs("rollback", "--no-redo")
            fd = os.open(q, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, b"root only\n")
            os.close(fd)
            os.setxattr(q, "user.secret", b"1")

            def act() -> tuple[list[str], str]:
                names = os.listxattr(s, follow_symlinks=False)
                os.link(s, x, follow_symlinks=False)
                return names, os.readlink(x)

            names, target = users.run_as(agent.pw_uid, agent.pw_gid, act)
            assert names == [] and target == "target"
            assert os.stat(q).st_nlink == 1
            assert os.lstat(x).st_ino == os.lstat(s).st_ino
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


def test_an_object_freed_at_an_ignored_path_never_takes_an_older_layers_undo_data():
    """Root's 0600 file, changed in layer L1 (its old bytes captured), is
    moved by the agent into its ignored directory; in the next layer the
    agent removes it there (ignored: freed for real, the daemon keeps
    nothing) and makes files until one gets the freed inode number, which
    it keeps open and puts at the name.  A rollback to L1 must not take the
    agent's file for root's: neither write root's old bytes into it (which
    the agent reads through its descriptor) nor make it root's file at
    root's name (which the agent could then write through it)."""
    import pwd
    import tempfile

    from . import users

    agent = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="cowfs-reuse-"))
    os.chmod(base, 0o755)
    try:
        with managed_workspace(base / "ws") as ws:
            os.chmod(ws.path, 0o755)
            (ws / ".cowfsignore").write_text("I/\n")
            for d in ("a", "I"):
                (ws / d).mkdir()
                os.chown(ws / d, agent.pw_uid, agent.pw_gid)
            secret = ws / "a" / "secret"
            secret.write_text("ROOT SECRET v1\n")
            os.chmod(secret, 0o600)
            ws.mount()
            l1 = ws.checkpoint()
            secret.write_text("ROOT SECRET v2\n")  # (v1 captured in L1)
            want = os.lstat(secret).st_ino
            users.run_as(
                agent.pw_uid, agent.pw_gid, os.rename, str(secret), str(ws / "I" / "secret")
            )
            ws.checkpoint()
            r, w = os.pipe()
            go_r, go_w = os.pipe()
            child = os.fork()
            if child == 0:  # pragma: no cover - the agent
                try:
                    os.close(r)
                    os.close(go_w)
                    users.become(agent.pw_uid, agent.pw_gid)
                    os.unlink(ws / "I" / "secret")  # (ignored: freed)
                    fd = -1
                    for i in range(100):  # (once the daemon lets go of it; others may take it)
                        p = ws / "I" / f"z{i}"
                        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                        if os.fstat(fd).st_ino == want:
                            os.write(fd, b"agent's own bytes\n")
                            os.rename(p, ws / "I" / "secret")
                            break
                        time.sleep(0.1)
                    else:
                        os.write(w, b"no reuse %d %d" % (want, os.fstat(fd).st_ino))
                        os._exit(0)
                    os.write(w, b"ready")
                    os.read(go_r, 1)
                    st = os.fstat(fd)
                    os.write(w, b"%d %o " % (st.st_uid, st.st_mode) + os.pread(fd, 100, 0))
                finally:
                    os._exit(0)
            os.close(w)
            os.close(go_r)
            try:
                said = os.read(r, 100)
                if said.startswith(b"no reuse"):
                    pytest.skip(f"the filesystem gave the freed inode number to no new file {said}")
                assert said == b"ready"
                ws.cowfs("rollback", "--yes", "--to", str(l1), check=False)
                os.write(go_w, b"g")
                seen = os.read(r, 200)
            finally:
                os.close(go_w)
                os.waitpid(child, 0)
                os.close(r)
            assert b"ROOT SECRET" not in seen, seen
            assert not seen.startswith(b"0 "), seen  # (the agent's file made root's)
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


def test_a_rollback_never_removes_roots_directory_put_at_a_made_name_behind_an_ignored_path():
    """Mounted, no race: the agent makes sub/x in its directory d (beside
    root's directory rootdir holding root's 0600 file), moves d into its
    ignored directory (captured: d was seen at a captured path), and in
    the next layer -- where d, at an ignored path, is no longer seen --
    renames sub away and rootdir to sub (uncaptured).  The rollback's
    undo of "made sub/x" and "made sub" must not remove root's file and
    directory, which now have those names: they stay, and the steps that
    meet them fail by name."""
    import pwd
    import tempfile

    agent = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="cowfs-made-"))
    os.chmod(base, 0o755)

    def as_agent(*argv: str) -> None:
        as_user(agent, *argv)

    try:
        with managed_workspace(base / "ws") as ws:
            os.chmod(ws.path, 0o755)
            (ws / ".cowfsignore").write_text("agent/I/\n")
            for d in ("agent", "agent/I", "agent/d"):
                (ws / d).mkdir()
                os.chown(ws / d, agent.pw_uid, agent.pw_gid)
            (ws / "agent" / "d" / "rootdir").mkdir()
            (ws / "agent" / "d" / "rootdir" / "x").write_text("precious\n")
            os.chmod(ws / "agent" / "d" / "rootdir" / "x", 0o600)
            ws.mount()
            first = ws.checkpoint()
            d = ws / "agent" / "d"
            as_agent("mkdir", str(d / "sub"))
            as_agent("touch", str(d / "sub" / "x"))
            as_agent("mv", str(d), str(ws / "agent" / "I" / "d"))
            ws.checkpoint()
            moved = ws / "agent" / "I" / "d"
            as_agent("mv", str(moved / "sub"), str(moved / "tmp"))
            as_agent("mv", str(moved / "rootdir"), str(moved / "sub"))
            ws.cowfs("rollback", "--yes", "--to", str(first), check=False)
            found = [p for p in (ws / "agent").rglob("x") if p.read_bytes() == b"precious\n"]
            assert found, "root's file was removed by the rollback"
            st = found[0].stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


def test_a_rollback_never_puts_an_agents_removed_file_into_roots_directory():
    """As above, with a removal: the agent removes its file sub/hook
    (kept in the grave), moves d into its ignored directory, and in the
    next layer puts root's directory at the name sub (uncaptured).  The
    rollback must not put the agent's file back inside root's directory
    (an agent-owned, agent-writable file in a directory the agent may not
    write)."""
    import pwd
    import tempfile

    agent = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="cowfs-grave-"))
    os.chmod(base, 0o755)

    def as_agent(*argv: str) -> None:
        as_user(agent, *argv)

    try:
        with managed_workspace(base / "ws") as ws:
            os.chmod(ws.path, 0o755)
            (ws / ".cowfsignore").write_text("agent/I/\n")
            for d in ("agent", "agent/I", "agent/d", "agent/d/sub"):
                (ws / d).mkdir()
                os.chown(ws / d, agent.pw_uid, agent.pw_gid)
            hook = ws / "agent" / "d" / "sub" / "hook"
            hook.write_text("echo agent\n")
            os.chown(hook, agent.pw_uid, agent.pw_gid)
            roots = ws / "agent" / "d" / "roots"
            roots.mkdir()  # (root's: only root may make names in it)
            (roots / "README").write_text("root's\n")
            ws.mount()
            first = ws.checkpoint()
            as_agent("rm", str(hook))
            as_agent("mv", str(ws / "agent" / "d"), str(ws / "agent" / "I" / "d"))
            ws.checkpoint()
            moved = ws / "agent" / "I" / "d"
            as_agent("mv", str(moved / "sub"), str(moved / "tmp"))
            as_agent("mv", str(moved / "roots"), str(moved / "sub"))
            ws.cowfs("rollback", "--yes", "--to", str(first), check=False)
            for p in (ws / "agent").rglob("*"):
                st = p.lstat()
                if stat.S_ISDIR(st.st_mode) and st.st_uid == 0:
                    assert sorted(x.name for x in p.iterdir()) == ["README"], p
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


def test_a_directory_a_rollback_moved_twice_records_its_changes_at_its_own_path():
    """The agent moves its directory B to A and then A/X out to Y; a
    process of its stays in X (its working directory).  The rollback puts
    X back into A, then A back to B: the daemon's node of X must follow it
    to B/X, not keep the name Y (the rollback looked A up only after it
    had moved A away).  Then root's directory R (in the agent's directory)
    is renamed Y and the agent makes z in X: it is recorded at B/X/z, and
    rolling that layer back removes the agent's z -- never root's R/z,
    which the layer did not make."""
    import pwd
    import tempfile

    from . import users

    agent = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="cowfs-twice-"))
    os.chmod(base, 0o755)
    try:
        with managed_workspace(base / "ws") as ws:
            os.chmod(ws.path, 0o755)
            ag = ws / "ag"
            for d in ("ag", "ag/B", "ag/B/X"):
                (ws / d).mkdir()
                os.chown(ws / d, agent.pw_uid, agent.pw_gid)
            (ag / "R").mkdir()
            (ag / "R" / "z").write_text("root's\n")
            os.chmod(ag / "R" / "z", 0o600)
            ws.mount()
            ws.checkpoint()
            users.run_as(agent.pw_uid, agent.pw_gid, os.rename, str(ag / "B"), str(ag / "A"))
            users.run_as(agent.pw_uid, agent.pw_gid, os.rename, str(ag / "A" / "X"), str(ag / "Y"))
            r, w = os.pipe()
            go_r, go_w = os.pipe()
            child = os.fork()
            if child == 0:  # pragma: no cover - the agent, working in X
                try:
                    os.close(r)
                    os.close(go_w)
                    users.become(agent.pw_uid, agent.pw_gid)
                    os.chdir(ag / "Y")
                    os.write(w, b"in")
                    os.read(go_r, 1)
                    os.close(os.open("z", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                    os.write(w, b"made")
                finally:
                    os._exit(0)
            os.close(w)
            os.close(go_r)
            try:
                assert os.read(r, 10) == b"in"
                ws.cowfs("rollback", "--yes")
                ws.checkpoint()
                users.run_as(agent.pw_uid, agent.pw_gid, os.rename, str(ag / "R"), str(ag / "Y"))
                os.write(go_w, b"g")
                assert os.read(r, 10) == b"made"
            finally:
                os.close(go_w)
                os.waitpid(child, 0)
                os.close(r)
            assert (ag / "B" / "X" / "z").exists()
            ws.cowfs("rollback", "--yes", check=False)
            assert (ag / "R" / "z").read_text() == "root's\n"
            assert not (ag / "B" / "X" / "z").exists()
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


@contextlib.contextmanager
def agent_work(prefix: str):
    """A mounted workspace ignoring ``*.tmp``, with a directory work/ the
    agent (nobody) owns that holds root's file work/data.txt (the agent may
    rename it, not change it), and a runner of commands as the agent."""
    import pwd

    agent = pwd.getpwnam("nobody")
    with reachable_workspace(prefix) as ws:
        (ws / ".cowfsignore").write_text("*.tmp\n")
        (ws / "work").mkdir()
        os.chown(ws / "work", agent.pw_uid, agent.pw_gid)
        (ws / "work" / "data.txt").write_text("root's data\n")
        ws.mount()
        yield ws, lambda *argv: as_user(agent, *argv)


def _copies_of(root: Path, data: bytes) -> list[Path]:
    return [
        p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p.read_bytes() == data
    ]


@pytest.mark.parametrize("blocker", [False, True], ids=["plain", "blocker"])
def test_a_rollback_never_removes_a_known_file_moved_into_a_directory_the_layer_made(blocker):
    """The agent makes a directory p (recorded), moves root's file into an
    ignored directory inside it (recorded: the file is pinned) and renames
    that ignored directory (uncaptured: the agent made it at an ignored
    path), perhaps putting an empty one at the old name.  The rename step
    finds nothing to move back; the step removing p must not take root's
    file with what it takes for the layer's own ignored creations -- it
    fails by name and keeps its record (exit 10), and the file is still
    there (it was removed, and with the blocker the rollback said it
    succeeded)."""
    with agent_work("cowfs-known-") as (ws, agent):
        work = ws / "work"
        ws.checkpoint()
        agent("mkdir", str(work / "p"))
        agent("mkdir", str(work / "p" / "z.tmp"))
        agent("mv", str(work / "data.txt"), str(work / "p" / "z.tmp" / "data.txt"))
        agent("mv", str(work / "p" / "z.tmp"), str(work / "p" / "w.tmp"))
        if blocker:
            agent("mkdir", str(work / "p" / "z.tmp"))
        r = ws.cowfs("rollback", "--yes", check=False)
        copies = _copies_of(ws.path, b"root's data\n")
        assert copies, (r.returncode, r.stdout, r.stderr)
        if r.returncode == 0:
            assert copies == [work / "data.txt"], r.stdout
        else:
            assert r.returncode == 10, r.stderr
            assert "p" in r.stderr, r.stderr


@pytest.mark.parametrize("blocker", [False, True], ids=["plain", "blocker"])
def test_a_file_made_at_a_captured_path_on_a_number_an_ignored_one_freed_stays_pinned(blocker):
    """An object made at an ignored path and removed there (uncaptured)
    frees its inode number; the filesystem gives it to the next directory
    the agent makes, at a captured path.  That directory is pinned like any
    made there: moving it to an ignored path is recorded, so the rollback
    puts root's file, moved into it, back exactly -- or, when the agent
    made a new directory at its old name (at an ignored path: uncaptured),
    fails by name and keeps root's file (before, the earlier
    object's state left the directory unpinned, and the rollback removed
    root's file and said it succeeded)."""
    with agent_work("cowfs-reuse-") as (ws, agent):
        work = ws / "work"
        before = ws.snapshot()
        ws.checkpoint()
        agent("mkdir", str(work / "p"))
        for _ in range(20):
            agent("mkdir", str(work / "p" / "a.tmp"))
            freed = os.lstat(work / "p" / "a.tmp").st_ino
            agent("rmdir", str(work / "p" / "a.tmp"))
            agent("mkdir", str(work / "p" / "x"))
            if os.lstat(work / "p" / "x").st_ino == freed:
                break
            agent("rmdir", str(work / "p" / "x"))
        else:
            pytest.skip("the filesystem gave the freed inode number to no new directory")
        agent("mv", str(work / "data.txt"), str(work / "p" / "x" / "data.txt"))
        agent("mv", str(work / "p"), str(work / "p.tmp"))
        agent("mv", str(work / "p.tmp" / "x"), str(work / "p.tmp" / "z.tmp"))
        if blocker:
            agent("mkdir", str(work / "p.tmp" / "x"))
        r = ws.cowfs("rollback", "--yes", check=False)
        if not blocker:
            assert r.returncode == 0, r.stderr
            treesnap.assert_same(before, ws.snapshot())
            return
        assert r.returncode == 10, r.stderr
        assert "work/p.tmp/x" in r.stderr, r.stderr
        copies = _copies_of(ws.path, b"root's data\n")
        assert len(copies) == 1 and copies[0].name == "data.txt", copies


def test_what_the_layer_made_goes_with_the_directory_it_made_whatever_was_recorded_of_it():
    """A file written under an ignored name, renamed to a captured one and
    back to an ignored one (each rename recorded: the file is pinned), in a
    directory the layer made, is the layer's own: the rollback removes it
    with the directory -- as it does a file at an ignored path given the
    inode number of a file the layer made and removed (the agent cannot
    make the rollback of its layer fail by that reuse)."""
    with agent_work("cowfs-ownmade-") as (ws, agent):
        work = ws / "work"
        before = ws.snapshot()
        ws.checkpoint()
        agent("mkdir", str(work / "d"))
        agent("sh", "-c", f"echo hi > {work / 'd' / 'f.tmp'}")
        agent("mv", str(work / "d" / "f.tmp"), str(work / "d" / "f"))
        agent("mv", str(work / "d" / "f"), str(work / "d" / "g.tmp"))
        for i in range(30):
            agent("sh", "-c", f"echo x > {work / f'c{i}'}")
            freed = os.lstat(work / f"c{i}").st_ino
            agent("rm", str(work / f"c{i}"))
            agent("sh", "-c", f"echo y > {work / 'd' / 't.tmp'}")
            if os.lstat(work / "d" / "t.tmp").st_ino == freed:
                break
            agent("rm", str(work / "d" / "t.tmp"))
        r = ws.cowfs("rollback", "--yes", check=False)
        assert r.returncode == 0, r.stderr
        treesnap.assert_same(before, ws.snapshot())
