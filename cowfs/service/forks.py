"""The mounts that make a fork (run by the workspace's daemon, as root).

A fork of a workspace is three mounts, made from the tree at its fork point
without copying it (cowfs/layers/forkpoints.py keeps the registry):

1. a view of the fork point (cowfs/fuse/view.py: read-only, the tree when
   the fork's first record position was reached), at ``RUN/lower``;
2. an overlay at ``RUN/merged``: that view as its lower layer, a private
   upper layer and work directory in the workspace's store
   (``STORE/forks/ID/upper``, ``work``: on the workspace's filesystem,
   reached only through the store's descriptor, never by a path through the
   workspace), with the index, redirects and metadata-only copy-up that make
   hard links, directory renames and attribute changes of lower objects work;
3. a cowfs mount over the overlay, a daemon of its own with its own store in
   the fork (``merged/.cowfs``, so in the upper layer): the fork's layers.

``RUN`` is ``/run/cowfs/forks/KEY/ID`` (KEY names the workspace), private to
root: the fork is reached through ``cowfs run --fork`` (a mount namespace in
which the workspace's own path shows it), ``cowfs fork --at DIR`` or the
commands' ``--fork NAME``.  The upper layer holds only what the fork changed:
dropping a fork costs what it changed, not the tree.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import stat
from collections.abc import Callable

from ..errors import AlreadyMounted, CowfsError
from ..system import backing
from ..system.backing import checked, libc
from ..system.mounts import (
    FSTYPE,
    VIEW_FSTYPE,
    MountRecord,
    finish_unmount,
    is_cowfs_mount,
    mount_table,
    mounts,
    path_key,
    pid_alive,
    runtime_dir,
)
from ..text import quote
from . import control
from .launch import PATH_FLAGS, clear_view, mnt_id, open_view_dir, spawn, start_view

log = logging.getLogger("cowfs.forks")

FORKS_DIR = b"forks"  # in the store
OVERLAY_OPTIONS = "index=on,redirect_dir=on,metacopy=on,xino=on"
MS_NOATIME = 1024
MS_BIND = 4096
MNT_DETACH, UMOUNT_NOFOLLOW = 2, 8
OVERLAY_XATTR = b"trusted.overlay."
MOUNT_TIMEOUT = 120

libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]


def run_dir(workspace: str, fid: int) -> str:
    return os.path.join(runtime_dir(), "forks", path_key(workspace), str(fid))


def _private_dirs(path: str) -> None:
    """*path* and the directories to it below the runtime directory, each
    made 0700 where missing (whatever the umask)."""
    base = runtime_dir()
    here = base
    for part in os.path.relpath(path, base).split(os.sep):
        here = os.path.join(here, part)
        with contextlib.suppress(FileExistsError):
            os.mkdir(here, 0o700)
        st = os.lstat(here)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise CowfsError(f"{quote(here)} is not a directory of this user's")
        if st.st_mode & 0o077:
            os.chmod(here, 0o700)


def paths(workspace: str, fid: int) -> tuple[str, str]:
    """The fork's view and its overlay (where the fork is mounted)."""
    base = run_dir(workspace, fid)
    return os.path.join(base, "lower"), os.path.join(base, "merged")


def running(workspace: str, row: dict) -> bool:
    return is_cowfs_mount(paths(workspace, row["id"])[1])


def start(
    rootfd: int,
    store_dirfd: int,
    hidden: bytes | None,
    workspace: str,
    row: dict,
    mount_args: dict,
) -> str:
    """Mount fork *row* (its view, its overlay, its cowfs mount) unless it
    is mounted already; return where.  Whatever a start left behind before
    is cleared first; a start that fails leaves nothing mounted."""
    lower, merged = paths(workspace, row["id"])
    if is_cowfs_mount(merged) and _alive(merged):
        _bind_at(rootfd, store_dirfd, row, merged)  # (those an unmount took away)
        return merged
    table = mount_table()
    if table.get(lower) == VIEW_FSTYPE and table.get(merged) in ("overlay", "fuse.cowfs"):
        # its own daemon died, the view and the overlay live: only the
        # mount over the overlay is made again (the overlay numbers the
        # objects it copied up as before; a new overlay over a new view
        # would not -- their origin is not found again through a view)
        _unbind(merged, True)
        _unmount_all(merged, lambda fs: fs == "fuse.cowfs", True)
        _mount_cowfs(merged, mount_args)
        _bind_at(rootfd, store_dirfd, row, merged)
        return merged
    stop(workspace, row, lazy=True)
    for d in (lower, merged):
        _private_dirs(d)
    upper_fd, work_fd, fresh = _layers(store_dirfd, row["id"])
    try:
        start_view(rootfd, store_dirfd, row["layer"], lower, hidden, 0, start=row["start"])
        try:
            if fresh:
                _copy_root(lower, upper_fd)
            _mount_overlay(lower, upper_fd, work_fd, merged)
            _mount_cowfs(merged, mount_args)
            _bind_at(rootfd, store_dirfd, row, merged)
        except BaseException:
            stop(workspace, row, lazy=True)
            raise
    finally:
        os.close(upper_fd)
        os.close(work_fd)
    return merged


def _bind_at(rootfd: int, store_dirfd: int, row: dict, merged: str) -> None:
    """Bind the fork mounted at *merged* at each of its ``--at`` directories
    where it is not bound already."""
    source = f"cowfs:{merged}"
    bound = {m.mountpoint for m in mounts() if m.fstype == FSTYPE and m.source == source}
    for where in row.get("at", []):
        if where in bound:
            continue
        # (checked as a view's directory is: no planted link
        # followed, not inside a workspace, not a mount point)
        fd = open_view_dir(where, rootfd, store_dirfd, 0)
        try:
            bind(merged, f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)


def _alive(mountpoint: str) -> bool:
    rec = MountRecord.load(mountpoint)
    return rec is not None and pid_alive(rec.pid)


def stop_cowfs(workspace: str, row: dict, lazy: bool) -> None:
    """Unmount fork *row*'s own cowfs mount (and its bind mounts), leaving
    its overlay: nothing changes it any more.  Without *lazy*, a fork
    processes use is AlreadyMounted (exit 5) naming them."""
    _, merged = paths(workspace, row["id"])
    _unbind(merged, lazy)
    rec = MountRecord.load(merged)
    if rec is not None and is_cowfs_mount(merged):
        try:
            finish_unmount(rec, control.call(rec, "unmount", lazy=lazy), MOUNT_TIMEOUT)
        except CowfsError as e:
            if not lazy and is_cowfs_mount(merged):
                raise AlreadyMounted(f"fork {row.get('name', row['id'])}: {e}") from None
    if is_cowfs_mount(merged):  # (its daemon gone, or not answering)
        _unmount_all(merged, lambda fs: fs == "fuse.cowfs", True)


def stop(workspace: str, row: dict, lazy: bool) -> None:
    """Unmount fork *row*: its bind mounts (``--at``), its cowfs mount,
    its overlay, its view.  Without *lazy*, a fork processes use is
    AlreadyMounted (exit 5) naming them, and stays as it was."""
    lower, merged = paths(workspace, row["id"])
    stop_cowfs(workspace, row, lazy)
    _unmount_all(merged, lambda fs: fs == "overlay", lazy)
    clear_view(lower)


def _unbind(merged: str, lazy: bool) -> None:
    """Unmount the fork's bind mounts (``--at``): the mounts of the fork's
    cowfs mount elsewhere than at *merged*, found by the name the mount
    table gives that mount's filesystem, wherever they are now (the
    directory a fork is bound at may have been renamed since), and nothing
    else that is mounted where they were.  Each is reached as the name of
    a mount point in the directory the mount found is on (through a
    descriptor: a name that is a mount point cannot be renamed, and no link
    on the way is followed again)."""
    source = f"cowfs:{merged}"
    for m in reversed(mounts()):  # (the last mounted first)
        if m.fstype != FSTYPE or m.source != source or m.mountpoint == merged:
            continue
        try:
            fd = os.open(m.mountpoint, PATH_FLAGS)
        except OSError:
            continue  # (gone, or moved: not reached by that name any more)
        try:
            if mnt_id(fd) != m.id:
                continue
            up = os.open("..", PATH_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)  # (it holds the mount: busy while open)
        try:
            target = f"/proc/self/fd/{up}/{os.path.basename(m.mountpoint)}"
            flags = (MNT_DETACH if lazy else 0) | UMOUNT_NOFOLLOW
            checked(libc.umount2(os.fsencode(target), flags), m.mountpoint)
        except OSError as e:
            if e.errno == errno.EBUSY and not lazy:
                raise AlreadyMounted(f"{quote(m.mountpoint)} is busy") from None
            raise
        finally:
            os.close(up)


def _unmount_all(where: str, what: Callable[[str], bool], lazy: bool) -> None:
    for _ in range(8):
        fs = mount_table().get(where)
        if fs is None or not what(fs):
            return
        try:
            checked(libc.umount2(os.fsencode(where), 2 if lazy else 0), where)
        except OSError as e:
            if e.errno == errno.EBUSY and not lazy:
                raise AlreadyMounted(f"{quote(where)} is busy") from None
            raise


def remove(workspace: str, store_dirfd: int, fid: int) -> None:
    """Free what fork *fid* holds (its upper layer and work directory, with
    the fork's own store), once it is unmounted."""
    try:
        forks = os.open(FORKS_DIR, backing.DIR_FLAGS, dir_fd=store_dirfd)
    except FileNotFoundError:
        forks = -1
    if forks >= 0:
        try:
            backing.remove_tree_at(forks, str(fid).encode())
        finally:
            os.close(forks)
    base = run_dir(workspace, fid)
    # (the workspace's directory too, once it holds no other fork's)
    lower, merged = paths(workspace, fid)
    for d in (lower, merged, base, os.path.dirname(base)):
        with contextlib.suppress(OSError):
            os.rmdir(d)


def upper_bytes(store_dirfd: int, fid: int) -> int:
    """The disk space fork *fid*'s own layer takes (what it changed, and its store)."""
    total = 0
    try:
        fd = os.open(
            os.path.join(FORKS_DIR, str(fid).encode()), backing.DIR_FLAGS, dir_fd=store_dirfd
        )
    except FileNotFoundError:
        return 0
    try:
        for _, dirs, files, dfd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
            for name in dirs + files:
                with contextlib.suppress(OSError):
                    total += os.stat(name, dir_fd=dfd, follow_symlinks=False).st_blocks * 512
    finally:
        os.close(fd)
    return total


def open_upper(store_dirfd: int, fid: int) -> int:
    """Fork *fid*'s upper layer (an O_PATH descriptor)."""
    return os.open(
        FORKS_DIR + b"/" + str(fid).encode() + b"/upper", backing.DIR_FLAGS, dir_fd=store_dirfd
    )


def _layers(store_dirfd: int, fid: int) -> tuple[int, int, bool]:
    """The fork's upper layer and work directory (made where missing), as
    descriptors; and whether the upper layer is new."""
    made = False

    def sub(dirfd: int, name: bytes) -> int:
        nonlocal made
        try:
            os.mkdir(name, 0o700, dir_fd=dirfd)
            made = True
        except FileExistsError:
            pass
        return os.open(name, backing.DIR_FLAGS, dir_fd=dirfd)

    forks = sub(store_dirfd, FORKS_DIR)
    try:
        mine = sub(forks, str(fid).encode())
    finally:
        os.close(forks)
    try:
        made = False
        upper = sub(mine, b"upper")
        fresh = made
        work = sub(mine, b"work")
    finally:
        os.close(mine)
    return upper, work, fresh


def _copy_root(lower: str, upper_fd: int) -> None:
    """A new upper layer's root takes the fork point's root's attributes
    (the overlay's root directory is the upper one)."""
    st = os.lstat(lower)
    path = backing.proc(upper_fd)
    for name in os.listxattr(lower):
        if not name.encode().startswith(OVERLAY_XATTR):
            os.setxattr(path, name, os.getxattr(lower, name))
    os.chown(path, st.st_uid, st.st_gid)
    os.chmod(path, stat.S_IMODE(st.st_mode))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _mount_overlay(lower: str, upper_fd: int, work_fd: int, merged: str) -> None:
    options = (
        f"lowerdir={lower},upperdir=/proc/self/fd/{upper_fd},"
        f"workdir=/proc/self/fd/{work_fd},{OVERLAY_OPTIONS}"
    )
    checked(
        libc.mount(b"cowfs-fork", os.fsencode(merged), b"overlay", MS_NOATIME, options.encode()),
        merged,
        call="mount overlay",
    )


def _mount_cowfs(merged: str, options: dict) -> None:
    try:
        spawn(merged, timeout=MOUNT_TIMEOUT, **options)
    except CowfsError as e:
        raise CowfsError(f"mounting the fork failed: {e}", e.code) from None


def bind(source: str, target: str) -> None:
    checked(libc.mount(os.fsencode(source), os.fsencode(target), None, MS_BIND, None), target)
