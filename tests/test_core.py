"""The mounted workspace: capture, rollback, commit and the control CLI,
through real FUSE mounts."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import time

import pytest

from cowfs.errors import (
    ALREADY_MOUNTED,
    BAD_WORKSPACE,
    NO_FUSE,
    NO_STORE,
    NOTHING_TO_DO,
    STORE_ERROR,
    UNKNOWN_LAYER,
)
from cowfs.layers import treesnap

from .helpers import backing_dir, run
from .users import run_as

pytestmark = pytest.mark.usefixtures("each_engine")


def write(path, data: bytes, offset: int | None = None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if offset is None:
            os.ftruncate(fd, 0)
            os.write(fd, data)
        else:
            os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


# -- the stack -----------------------------------------------------------------------


def test_rollback_restores_every_kind_of_change(mounted):
    ws = mounted
    os.setxattr(ws / "a.txt", "user.tag", b"one")
    os.link(ws / "a.txt", ws / "dir" / "a-link")
    os.symlink("a.txt", ws / "sym")
    os.mkfifo(ws / "fifo")
    before = ws.snapshot()
    ws.checkpoint("work")

    write(ws / "a.txt", b"changed in place\n", 0)
    os.setxattr(ws / "a.txt", "user.tag", b"two")
    os.setxattr(ws / "dir", "user.new", b"x")
    os.chmod(ws / "dir" / "b.txt", 0o600)
    os.utime(ws / "dir" / "b.txt", ns=(1, 2))
    os.rename(ws / "dir", ws / "moved")
    os.unlink(ws / "sym")
    os.symlink("elsewhere", ws / "sym")
    os.unlink(ws / "fifo")
    (ws / "new").mkdir()
    (ws / "new" / "f").write_bytes(os.urandom(200_000))
    os.truncate(ws / "moved" / "b.txt", 1)
    assert treesnap.compare(before, ws.snapshot())

    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def test_rollback_to_restores_the_state_when_the_layer_was_opened(mounted):
    ws = mounted
    states, ids = [], []
    for i in range(4):
        states.append(ws.snapshot())
        ids.append(ws.checkpoint(f"step {i}"))
        (ws / f"f{i}").write_text(f"{i}\n" * (i + 1))
        write(ws / "a.txt", f"version {i}\n".encode())
        if i == 2:
            os.rename(ws / "dir", ws / "dir2")
    ws.rollback(to=ids[2])
    treesnap.assert_same(states[2], ws.snapshot())
    assert [layer["id"] for layer in ws.log()][-1] == ids[1]
    ws.rollback(to=ids[0])
    treesnap.assert_same(states[0], ws.snapshot())


def test_commit_keeps_the_tree_and_the_layers_below(mounted):
    ws = mounted
    start = ws.snapshot()
    first = ws.checkpoint("one")
    write(ws / "a.txt", b"one\n")
    (ws / "x").write_text("x")
    ws.checkpoint("two")
    write(ws / "a.txt", b"two\n")
    os.unlink(ws / "x")
    (ws / "dir" / "b.txt").write_text("two\n")
    live = ws.snapshot()
    res = ws.commit()
    assert res["into"] == first
    treesnap.assert_same(live, ws.snapshot())
    assert [layer["id"] for layer in ws.log()][-1] == first
    ws.rollback()
    treesnap.assert_same(start, ws.snapshot())


def test_commit_of_the_base_layer_makes_changes_permanent(mounted):
    ws = mounted
    (ws / "kept").write_text("kept\n")
    os.unlink(ws / "a.txt")
    live = ws.snapshot()
    res = ws.commit()
    assert res["into"] is None and res["top"] != res["committed"]
    treesnap.assert_same(live, ws.snapshot())
    grave = os.listdir(ws.path / ".cowfs" / "grave") if False else None  # hidden while mounted
    assert grave is None
    r = ws.cowfs("rollback", check=False)
    assert r.returncode == NOTHING_TO_DO and "nothing to roll back" in r.stderr
    ws.unmount()
    assert os.listdir(ws.path / ".cowfs" / "grave") == []


def test_layers_survive_unmount_and_mount(mounted):
    ws = mounted
    before = ws.snapshot()
    ws.checkpoint("persisted")
    write(ws / "a.txt", b"new contents\n")
    (ws / "dir" / "c").write_text("c")
    ws.unmount()
    ws.mount()
    assert [layer["message"] for layer in ws.log()] == ["base", "persisted"]
    # Changes after the remount go into the same open layer.
    write(ws / "a.txt", b"again\n")
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def test_base_layer_records_everything_since_mount(mounted):
    ws = mounted
    before = ws.snapshot()
    (ws / "a.txt").write_text("overwritten\n")
    (ws / "dir" / "new").write_text("n")
    res = ws.rollback()
    assert res["dropped"] == [1]
    treesnap.assert_same(before, ws.snapshot())
    assert len(ws.log()) == 1  # a fresh base layer is open


def test_status_lists_net_changes_like_git(mounted):
    ws = mounted
    (ws / "c").write_text("c")
    (ws / "was-file").write_text("f")
    ws.checkpoint()
    os.unlink(ws / "was-file")
    os.mkdir(ws / "was-file")
    (ws / "added").write_text("new")
    write(ws / "a.txt", b"ALPHA\n", 0)
    os.unlink(ws / "c")
    os.chmod(ws / "dir" / "b.txt", 0o600)
    os.rename(ws / "dir", ws / "renamed")
    (ws / "tmp").write_text("gone again")
    os.unlink(ws / "tmp")
    os.unlink(ws / "renamed" / "b.txt")
    os.symlink("x", ws / "renamed" / "b.txt")
    kinds = {c["path"]: c["kind"] for c in ws.status()}
    # (b.txt moved with its directory, then a symlink took its place: a type change)
    assert kinds == {
        "added": "A",
        "a.txt": "M",
        "c": "D",
        "renamed": "R",
        "renamed/b.txt": "T",
        "was-file": "T",
    }
    assert ws.json("status")["id"] == ws.log()[-1]["id"]


def test_log_shapes(mounted):
    ws = mounted
    ws.checkpoint("hello")
    (ws / "a.txt").write_text("x" * 100_000)
    layers = ws.log()
    assert [layer["message"] for layer in layers] == ["base", "hello"]
    top = layers[-1]
    assert top["changes"] == 1 and top["bytes"] > 0
    assert isinstance(top["created"], float) and abs(top["created"] - time.time()) < 60
    text = ws.cowfs("log").stdout
    assert "hello" in text and "ID" in text.splitlines()[0]


# -- reading after a rollback sees the restored state -----------------------------------


def test_open_file_sees_restored_content(mounted):
    ws = mounted
    ws.checkpoint()
    with open(ws / "a.txt", "r+b") as f:
        f.write(b"CHANGED")
        f.flush()
        ws.rollback()
        f.seek(0)
        assert f.read() == b"alpha\n"
        assert os.fstat(f.fileno()).st_size == 6
    assert (ws / "a.txt").read_bytes() == b"alpha\n"


def test_names_are_fresh_after_rollback(mounted):
    ws = mounted
    assert (ws / "dir" / "b.txt").exists()
    ws.checkpoint()
    os.rename(ws / "dir", ws / "other")
    (ws / "fresh").write_text("f")
    assert (ws / "other" / "b.txt").read_text() == "beta\n"
    ws.rollback()
    assert not (ws / "other").exists() and not (ws / "fresh").exists()
    assert (ws / "dir" / "b.txt").read_text() == "beta\n"
    assert sorted(os.listdir(ws.path)) == ["a.txt", "dir"]


# -- capture details ---------------------------------------------------------------------


def test_large_file_edit_keeps_one_chunk(mounted):
    ws = mounted
    big = ws / "big"
    with open(big, "wb") as f:
        f.write(os.urandom(8 << 20))
    ws.commit()  # make it part of the permanent state
    before = ws.snapshot()
    ws.checkpoint()
    write(big, b"one line\n", 3 << 20)
    write(big, b"again, same chunk\n", (3 << 20) + 100)
    layer = ws.log()[-1]
    assert layer["bytes"] < 200_000  # one 64 KiB chunk (plus records), not 8 MiB
    with open(big, "ab") as f:
        f.write(b"appended")
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def test_sparse_file_stays_sparse(mounted):
    ws = mounted
    path = ws / "sparse"
    with open(path, "wb") as f:
        f.truncate(64 << 20)
        f.seek(32 << 20)
        f.write(b"data")
    ws.commit()
    before = ws.snapshot()
    blocks = os.stat(path).st_blocks
    ws.checkpoint()
    with open(path, "r+b") as f:
        for off in range(0, 64 << 20, 4 << 20):
            f.seek(off)
            f.write(b"x" * 4096)
    os.truncate(path, 1000)
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())
    assert os.stat(path).st_blocks <= blocks + 16


def test_open_then_unlink_then_write_rolls_back(mounted):
    ws = mounted
    before = ws.snapshot()
    ws.checkpoint()
    fd = os.open(ws / "a.txt", os.O_RDWR)
    try:
        os.unlink(ws / "a.txt")
        assert os.fstat(fd).st_nlink == 0
        os.pwrite(fd, b"ALPHA", 0)
        assert os.pread(fd, 6, 0) == b"ALPHA\n"
    finally:
        os.close(fd)
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def test_hard_links_keep_identity(mounted):
    ws = mounted
    os.link(ws / "a.txt", ws / "dir" / "twin")
    before = ws.snapshot()
    ws.checkpoint()
    os.unlink(ws / "a.txt")
    assert os.stat(ws / "dir" / "twin").st_nlink == 1
    write(ws / "dir" / "twin", b"through the twin\n")
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())
    a, twin = os.stat(ws / "a.txt"), os.stat(ws / "dir" / "twin")
    assert a.st_ino == twin.st_ino and a.st_nlink == 2


def test_an_object_keeps_its_inode_number_when_the_kernel_forgets_it(mounted):
    """st_ino through the mount is the backing object's own inode number, so
    it holds however often the kernel forgets the object and looks it up
    again -- here a rollback has the kernel drop the names it cached of a
    hard-linked file, which it then looks up anew.  (With a number of the
    daemon's own for each node, a walk that saw one name before such a
    forget and the other after took them for two files: a crash soak trial
    compared a tree whose hard links came out split.)"""
    ws = mounted
    os.link(ws / "a.txt", ws / "dir" / "twin")
    first = os.stat(ws / "a.txt").st_ino
    assert os.stat(ws / "dir" / "twin").st_ino == first
    for _ in range(3):
        ws.checkpoint()
        os.rename(ws / "a.txt", ws / "a2")
        os.rename(ws / "dir" / "twin", ws / "dir" / "twin2")
        ws.rollback()
        time.sleep(0.3)  # (for the kernel's forget to reach the daemon first)
        assert os.stat(ws / "a.txt").st_ino == first
        assert os.stat(ws / "dir" / "twin").st_ino == first
    snap = ws.snapshot()
    assert snap[b"a.txt"].link == snap[b"dir/twin"].link == b"a.txt"
    assert os.stat(backing_dir(ws) / "a.txt").st_ino == first  # (the native number)


def test_rename_flags(mounted):
    ws = mounted
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    (ws / "c").write_text("c")
    before = ws.snapshot()
    ws.checkpoint()
    root = os.open(ws.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert libc.renameat2(root, b"a.txt", root, b"c", 1) == -1  # NOREPLACE
        assert ctypes.get_errno() == errno.EEXIST
        assert libc.renameat2(root, b"a.txt", root, b"dir", 2) == 0  # EXCHANGE
    finally:
        os.close(root)
    assert (ws / "dir").read_text() == "alpha\n"
    assert (ws / "a.txt" / "b.txt").read_text() == "beta\n"
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def test_rename_over_existing_file_and_directory(mounted):
    ws = mounted
    (ws / "empty").mkdir()
    (ws / "d2").mkdir()
    (ws / "d2" / "inner").write_text("i")
    before = ws.snapshot()
    ws.checkpoint()
    (ws / "tmp").write_text("replacement")
    os.rename(ws / "tmp", ws / "a.txt")
    os.rename(ws / "d2", ws / "empty")
    with pytest.raises(OSError) as e:
        os.rename(ws / "dir", ws / "empty")
    assert e.value.errno == errno.ENOTEMPTY
    with pytest.raises(OSError) as e:
        os.rmdir(ws / "dir")
    assert e.value.errno == errno.ENOTEMPTY
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def test_o_trunc_and_truncate_up_and_down(mounted):
    ws = mounted
    (ws / "f").write_bytes(os.urandom(300_000))
    ws.commit()
    before = ws.snapshot()
    ws.checkpoint()
    (ws / "f").write_bytes(b"short")  # O_TRUNC
    os.truncate(ws / "f", 1_000_000)  # up
    os.truncate(ws / "f", 70_000)  # down
    (ws / "a.txt").write_text("")
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def test_new_objects_get_caller_owner_and_umask(workspace):
    workspace.mount()
    ws = workspace
    os.chmod(ws.path, 0o777)
    subprocess.run(
        [
            "setpriv",
            "--reuid=1234",
            "--regid=1234",
            "--clear-groups",
            "sh",
            "-c",
            "umask 027 && touch f && mkdir d && ln -s f l",
        ],
        cwd=ws.path,
        check=True,
    )
    f, d, link = (os.lstat(ws / n) for n in ("f", "d", "l"))
    assert (f.st_uid, f.st_gid, stat.S_IMODE(f.st_mode)) == (1234, 1234, 0o640)
    assert (d.st_uid, d.st_gid, stat.S_IMODE(d.st_mode)) == (1234, 1234, 0o750)
    assert (link.st_uid, link.st_gid) == (1234, 1234)


def test_permissions_are_checked_for_other_users(mounted):
    ws = mounted
    os.chmod(ws / "a.txt", 0o600)
    r = subprocess.run(
        ["setpriv", "--reuid=1234", "--regid=1234", "--clear-groups", "cat", "a.txt"],
        capture_output=True,
        text=True,
        cwd=ws.path,
    )
    assert r.returncode != 0 and "Permission denied" in r.stderr
    r = subprocess.run(
        ["setpriv", "--reuid=1234", "--regid=1234", "--clear-groups", "cat", "dir/b.txt"],
        capture_output=True,
        text=True,
        cwd=ws.path,
    )
    assert r.stdout == "beta\n"


def test_special_files_and_xattrs(mounted):
    ws = mounted
    before = ws.snapshot()
    ws.checkpoint()
    os.mkfifo(ws / "fifo")
    os.mknod(ws / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    os.setxattr(ws / "dir" / "b.txt", "user.k", b"v")
    assert os.getxattr(ws / "dir" / "b.txt", "user.k") == b"v"
    assert "user.k" in os.listxattr(ws / "dir" / "b.txt")
    os.removexattr(ws / "dir" / "b.txt", "user.k")
    with pytest.raises(OSError) as e:
        os.getxattr(ws / "dir" / "b.txt", "user.k")
    assert e.value.errno == errno.ENODATA
    os.setxattr(ws / "a.txt", "user.k", b"v2")
    assert stat.S_ISFIFO(os.lstat(ws / "fifo").st_mode)
    assert stat.S_ISCHR(os.lstat(ws / "null").st_mode)
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def test_xattrs_the_daemon_knows_absent_come_back(mounted):
    """The daemon remembers which objects have no xattrs (and no
    capability) once the disk said so: an xattr set through the mount, and
    xattrs and a capability a rollback or a redo puts back, are seen at
    once by getxattr and listxattr, of files and directories alike."""
    ws = mounted
    a, d = ws / "a.txt", ws / "dir"
    os.setxattr(a, "user.k", b"v")
    os.setxattr(a, "security.capability", CAP_NET_RAW)
    os.setxattr(d, "user.d", b"w")
    before = ws.snapshot()
    ws.checkpoint()
    os.removexattr(a, "user.k")
    os.removexattr(a, "security.capability")
    os.removexattr(d, "user.d")
    for path in (a, d):
        for _ in range(2):  # (the second answer from what the daemon knows)
            assert os.listxattr(path) == []
            with pytest.raises(OSError) as e:
                os.getxattr(path, "user.k")
            assert e.value.errno == errno.ENODATA
    with pytest.raises(OSError) as e:
        os.getxattr(a, "security.capability")
    assert e.value.errno == errno.ENODATA
    with pytest.raises(OSError) as e:
        os.removexattr(a, "user.k")
    assert e.value.errno == errno.ENODATA
    os.setxattr(d, "user.new", b"n")
    assert os.listxattr(d) == ["user.new"] and os.getxattr(d, "user.new") == b"n"
    fresh = ws / "fresh.txt"  # (learnt from a getxattr, never listed)
    fresh.write_bytes(b"")
    for _ in range(2):
        with pytest.raises(OSError) as e:
            os.getxattr(fresh, "system.posix_acl_access")
        assert e.value.errno == errno.ENODATA
    os.setxattr(fresh, "user.f", b"f")
    assert os.getxattr(fresh, "user.f") == b"f" and os.listxattr(fresh) == ["user.f"]
    after = ws.snapshot()
    ws.rollback()
    assert sorted(os.listxattr(a)) == ["security.capability", "user.k"]
    assert os.getxattr(a, "security.capability") == CAP_NET_RAW
    assert os.getxattr(a, "user.k") == b"v" and os.getxattr(d, "user.d") == b"w"
    treesnap.assert_same(before, ws.snapshot())
    ws.cowfs("redo")
    assert os.listxattr(a) == [] and os.listxattr(d) == ["user.new"]
    assert os.getxattr(fresh, "user.f") == b"f"
    treesnap.assert_same(after, ws.snapshot())


# version 2 capability data: cap_net_raw permitted and effective
CAP_NET_RAW = bytes.fromhex("0100000200200000000000000000000000000000")


USER, GROUP = 1234, 4321  # an unprivileged uid and gid, another group


def _make(d: str, names: tuple[str, str], user: bool = False) -> None:
    """A file and a directory in *d*, by root or by USER (from inside *d*:
    the test's temporary directories are root's alone)."""

    def make(names: tuple[str, str]) -> None:
        with open(names[0], "wb"):
            pass
        os.mkdir(names[1])

    here = os.getcwd()
    os.chdir(d)
    try:
        if user:
            run_as(USER, USER, make, names)
        else:
            make(names)
    finally:
        os.chdir(here)


def test_new_objects_take_the_group_of_a_setgid_directory_as_it_is_now(mounted):
    """A directory made setgid through the mount gives new files and
    directories its group (and new directories the bit), as ext4 does; after
    a rollback took the bit away and a redo put it back, the directory's
    group again; once a rollback took it away for good, the creator's
    group -- of root and of another user alike."""
    ws = mounted
    d = ws / "dir"

    def made_with(gid: int, setgid: bool, *pairs: tuple[str, str]) -> None:
        for f, sub in pairs:
            assert os.stat(d / f).st_gid == gid
            st = os.stat(d / sub)
            assert (st.st_gid, bool(st.st_mode & stat.S_ISGID)) == (gid, setgid)

    os.chown(d, 0, GROUP)
    os.chmod(d, 0o777)
    ws.checkpoint()
    os.chmod(d, 0o2777)
    _make(str(d), ("one", "sub"))
    _make(str(d), ("uone", "usub"), user=True)
    made_with(GROUP, True, ("one", "sub"), ("uone", "usub"))
    ws.rollback()
    assert not os.stat(d).st_mode & stat.S_ISGID
    ws.json("redo")
    assert os.stat(d).st_mode & stat.S_ISGID
    _make(str(d), ("again", "subagain"))
    _make(str(d), ("uagain", "usubagain"), user=True)
    made_with(GROUP, True, ("again", "subagain"), ("uagain", "usubagain"))
    ws.rollback()
    assert not os.stat(d).st_mode & stat.S_ISGID
    _make(str(d), ("two", "sub2"))
    _make(str(d), ("utwo", "usub2"), user=True)
    made_with(os.getegid(), False, ("two", "sub2"))
    made_with(USER, False, ("utwo", "usub2"))


def _mknod_setid(d: str) -> int:
    """As USER, in *d*: a regular file by mknod with the setuid and setgid
    bits; its mode."""

    def make(name: str) -> int:
        os.mknod(name, stat.S_IFREG | 0o6755)
        return os.stat(name).st_mode

    here = os.getcwd()
    os.chdir(d)
    try:
        return run_as(USER, USER, make, "f")
    finally:
        os.chdir(here)


def test_a_users_setid_file_keeps_its_bits_as_on_the_disk(mounted, tmp_path):
    """The daemon gives another user's new file that user's ids with a
    chown, which clears setuid; the mode is put back after it, so the file
    has the bits a native mknod gives it."""
    native = tmp_path / "native"
    native.mkdir()
    for d in (native, mounted / "dir"):
        os.chmod(d, 0o777)
    assert _mknod_setid(str(mounted / "dir")) == _mknod_setid(str(native))
    assert stat.S_IMODE(os.stat(mounted / "dir" / "f").st_mode) == 0o6755
    assert os.stat(mounted / "dir" / "f").st_uid == USER


def test_a_setxattr_its_flag_fails_records_nothing(mounted):
    """XATTR_REPLACE of a missing xattr and XATTR_CREATE of one that is
    there fail (ENODATA, EEXIST) as on the disk, before anything is
    recorded: the layer stays empty."""
    ws = mounted
    os.setxattr(ws / "a.txt", "user.k", b"v")
    ws.checkpoint()
    for path, name, flag, err in (
        (ws / "dir", "user.none", os.XATTR_REPLACE, errno.ENODATA),
        (ws / "a.txt", "user.k", os.XATTR_CREATE, errno.EEXIST),
    ):
        with pytest.raises(OSError) as e:
            os.setxattr(path, name, b"x", flag)
        assert e.value.errno == err
    assert ws.log()[-1]["records"] == 0 and ws.status() == []


def test_readdir_is_complete_in_large_directories(mounted):
    ws = mounted
    names = {f"file-{i:05d}" for i in range(3000)}
    for n in names:
        (ws / "dir" / n).write_bytes(b"")
    assert set(os.listdir(ws / "dir")) == names | {"b.txt"}
    with os.scandir(ws / "dir") as it:
        assert sum(1 for _ in it) == 3001


# -- the store ---------------------------------------------------------------------------


def test_store_is_hidden_and_unreachable(mounted):
    ws = mounted
    assert ".cowfs" not in os.listdir(ws.path)
    assert not os.path.exists(ws / ".cowfs")
    for action in (
        lambda: os.mkdir(ws / ".cowfs"),
        lambda: open(ws / ".cowfs", "w"),
        lambda: os.rename(ws / "a.txt", ws / ".cowfs"),
        lambda: os.symlink("x", ws / ".cowfs"),
    ):
        with pytest.raises(OSError) as e:
            action()
        assert e.value.errno == errno.EPERM
    st = os.stat(ws.path)  # the store lies underneath, mode 0700
    assert st is not None


def test_store_mode_is_0700(workspace):
    workspace.mount()
    workspace.unmount()
    assert stat.S_IMODE(os.stat(workspace / ".cowfs").st_mode) == 0o700


def test_fsync_and_statfs(mounted):
    ws = mounted
    fd = os.open(ws / "a.txt", os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"more\n")
        os.fsync(fd)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    assert (ws / "a.txt").read_text() == "alpha\nmore\n"
    sv = os.statvfs(ws.path)
    assert sv.f_blocks > 0 and sv.f_namemax == 255


# -- crash and recovery --------------------------------------------------------------------


def test_kill_9_then_mount_recovers_and_rolls_back_exactly(mounted):
    ws = mounted
    (ws / "data").write_bytes(os.urandom(1 << 20))
    ws.commit()
    before = ws.snapshot()
    ws.checkpoint("before the crash")
    writer = subprocess.Popen(
        [
            "python3",
            "-c",
            "import os, random\n"
            "fd = os.open('data', os.O_RDWR)\n"
            "i = 0\n"
            "while True:\n"
            "    os.pwrite(fd, os.urandom(4096), random.randrange(0, 2 << 20))\n"
            "    if i % 50 == 0: open(f'new{i}', 'w').write('x')\n"
            "    i += 1\n",
        ],
        cwd=ws.path,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60  # the crash hits a writer at work
    while not (ws / "new100").exists():
        assert time.monotonic() < deadline and writer.poll() is None, "the writer did not run"
        time.sleep(0.01)
    ws.kill()
    writer.wait(timeout=30)
    r = run("mount", ws.path)
    assert "cleared the dead mount" in r.stderr
    assert [layer["message"] for layer in ws.log()][-1] == "before the crash"
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


# -- bad input -------------------------------------------------------------------------------


def test_bad_input_gets_one_line_and_its_exit_code(mounted, tmp_path):
    ws = mounted
    cases = [
        (["-C", ws.path, "rollback", "--to", "99"], UNKNOWN_LAYER, "no layer 99"),
        (["-C", tmp_path, "status"], NO_STORE, "not inside a cowfs workspace"),
        (["mount", ws.path], ALREADY_MOUNTED, "already mounted"),
        (["mount", tmp_path / "missing"], BAD_WORKSPACE, "does not exist"),
        (["-C", ws.path, "frobnicate"], 2, "invalid choice"),
    ]
    for args, code, text in cases:
        r = run(*args, check=False)
        assert r.returncode == code, (args, r.stderr)
        assert text in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = run("-C", ws.path, "commit", check=False)
    assert r.returncode == NOTHING_TO_DO and "nothing to commit" in r.stderr


def test_store_of_another_workspace_is_refused(workspace, tmp_path):
    workspace.mount()
    workspace.unmount()
    other = tmp_path / "other"
    other.mkdir()
    r = run("mount", "--store", workspace / ".cowfs", other, check=False)
    assert r.returncode == STORE_ERROR and "belongs to another workspace" in r.stderr


@pytest.fixture
def small_fs(tmp_path):
    """A 16 MiB tmpfs for out-of-space cases."""
    mp = tmp_path / "small"
    mp.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mp)], check=True)
    try:
        yield mp
    finally:
        subprocess.run(["umount", "-l", str(mp)], check=False)


def test_full_disk_fails_the_write_with_enospc_and_leaves_the_file(small_fs, fuse):
    from .helpers import Workspace
    from .test_fulldisk import fill_file

    ws = Workspace(small_fs / "ws")
    ws.path.mkdir()
    original = os.urandom(2 << 20)
    (ws / "victim").write_bytes(original)
    try:
        ws.mount()
        fill_file(ws / "filler")
        failed = None
        fd = os.open(ws / "victim", os.O_WRONLY)
        try:
            for off in range(0, 2 << 20, 64 << 10):
                os.pwrite(fd, b"x" * 4096, off)
            os.fsync(fd)
        except OSError as e:
            failed = e.errno
        finally:
            try:
                os.close(fd)
            except OSError as e:
                failed = failed or e.errno
        assert failed == errno.ENOSPC
        ws.unmount()
        data = (ws / "victim").read_bytes()
        # Every chunk is either untouched or was captured before it changed:
        ws.mount()
        ws.rollback()
        ws.unmount()
        assert (ws / "victim").read_bytes() == original
        assert data is not None
    finally:
        ws.teardown()


def test_open_file_outliving_its_committed_removal_still_works(mounted):
    ws = mounted
    fd = os.open(ws / "a.txt", os.O_RDWR)
    try:
        os.unlink(ws / "a.txt")
        ws.commit()  # the removal is now permanent: the grave entry is freed
        assert os.fstat(fd).st_nlink == 0
        os.pwrite(fd, b"still writable", 0)
        os.fchmod(fd, 0o600)
        assert os.pread(fd, 14, 0) == b"still writable"
    finally:
        os.close(fd)
    before = ws.snapshot()
    (ws / "n").write_text("n")
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def test_missing_dev_fuse_is_reported(workspace):
    r = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            'mount -t tmpfs none /dev && exec "$0" -m cowfs mount "$1"',
            sys.executable,
            str(workspace.path),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == NO_FUSE, r.stderr
    assert "/dev/fuse" in r.stderr and "Traceback" not in r.stderr


def test_objects_moved_out_of_a_new_directory_that_is_then_removed(mounted):
    """Records name paths inside directories created in the layer; a rollback
    must still resolve them after those directories were removed."""
    ws = mounted
    before = ws.snapshot()
    ws.checkpoint()
    (ws / "d" / "e").mkdir(parents=True)
    (ws / "d" / "e" / "f").write_text("new")
    os.rename(ws / "d" / "e" / "f", ws / "dir" / "g")  # a new file, moved out
    os.rename(ws / "a.txt", ws / "d" / "a.txt")  # an old file, moved in
    os.rename(ws / "d" / "a.txt", ws / "a2.txt")  # ... and out again
    os.rmdir(ws / "d" / "e")
    os.rmdir(ws / "d")
    (ws / "t").mkdir()
    (ws / "t" / "tmp").write_text("tmp")
    os.unlink(ws / "t" / "tmp")
    os.rmdir(ws / "t")
    res = ws.rollback()
    assert res["failures"] == []
    treesnap.assert_same(before, ws.snapshot())


def test_many_more_files_than_the_daemon_may_hold_open(workspace):
    """The daemon keeps a bounded number of fds; evicted ones are reopened
    by name, and identities stay right."""
    ws = workspace
    for d in range(10):
        (ws / f"d{d}").mkdir()
        for f in range(200):
            (ws / f"d{d}" / f"f{f}").write_text(f"{d}/{f}\n")
    os.link(ws / "d0" / "f0", ws / "d9" / "hard")
    subprocess.run(
        ["prlimit", "--nofile=600:600", sys.executable, "-m", "cowfs", "mount", str(ws.path)],
        check=True,
        capture_output=True,
    )
    ws.mounted = True
    before = ws.snapshot()
    ws.checkpoint()
    with open(ws / "d0" / "f0", "a") as held:  # an open file keeps its fd
        for d in range(10):
            for f in range(0, 200, 7):
                with open(ws / f"d{d}" / f"f{f}", "a") as fh:
                    fh.write("more\n")
        os.rename(ws / "d3", ws / "d3-renamed")
        os.unlink(ws / "d0" / "f0")
        held.write("through the held file\n")
        assert os.fstat(held.fileno()).st_nlink == 1
    assert (ws / "d9" / "hard").read_text().endswith("through the held file\n")
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def test_shared_mmap_writes_belong_to_the_layer_they_were_made_in(mounted):
    import mmap

    ws = mounted
    (ws / "m").write_bytes(b"0" * 8192)
    ws.commit()
    before = ws.snapshot()
    ws.checkpoint()
    with open(ws / "m", "r+b") as f:
        with mmap.mmap(f.fileno(), 8192) as m:
            m[0:5] = b"dirty"  # a dirty page only the kernel knows about
            ws.rollback()  # flushes it into the layer first, then undoes it
            assert m[0:5] == b"00000"
    treesnap.assert_same(before, ws.snapshot())
