"""Starting a cowfs process that mounts something (the daemon, a view) and
waiting for the one line it reports once its mount is live; the child's
side of that report (``detach``); the read-only views of the past
(`cowfs view`), each in a process of its own; and opening a path a user
names (a view's DIR, an agent's settings file) without following a link
another user planted (``open_dir``, ``open_entry``)."""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import signal
import stat
import subprocess
import time
from collections.abc import Callable

from .. import errors
from ..errors import AlreadyMounted, BadWorkspace, CowfsError, PlantedLink
from ..system import backing
from ..system.mounts import (
    FSTYPE,
    VIEW_FSTYPE,
    mount_table,
    mounted_workspaces,
    mounts,
    unmount,
    within,
)
from ..text import quote
from .control import wait_readable
from .zygote import ZYGOTE, Child, start_detached

log = logging.getLogger("cowfs.launch")


VIEW_MODULE = "cowfs.fuse.view"
DAEMON_MODULE = "cowfs.service.daemon"
Started = subprocess.Popen | Child  # (a process start_and_wait started)
VIEW_TIMEOUT = 60.0


def start_view(
    rootfd: int,
    store_dirfd: int,
    layer: int,
    mountpoint: str,
    hidden: bytes | None,
    invoker: int | None = None,
    start: int | None = None,
) -> dict:
    """Start the view process (cowfs/fuse/view.py) with the workspace root, the
    store and the directory to mount on as open fds; return once its mount
    is live.  The directory is opened here, once (``open_view_dir``: no
    planted symlink followed, nothing inside a workspace, no mount point),
    and the view mounts on that descriptor, never on its path looked up
    again; if the start fails in any way, nothing of the view is left
    (process or mount)."""
    dirfd = open_view_dir(mountpoint, rootfd, store_dirfd, invoker)
    try:
        mp = fd_path(dirfd)
        root = os.open(backing.proc(rootfd), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        store = os.open(backing.proc(store_dirfd), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            args = ["--root-fd", str(root), "--store-fd", str(store), "--layer", str(layer)]
            args += ["--dir-fd", str(dirfd)]
            if hidden:
                args += ["--hidden", os.fsdecode(hidden)]
            if start is not None:
                args += ["--since", str(start)]
            return start_and_wait(
                VIEW_MODULE,
                args + [mp],
                (root, store, dirfd),
                VIEW_TIMEOUT,
                f"mounting the view at {quote(mp)}",
                abandon=functools.partial(abandon_view, mp, dirfd=dirfd),
            )
        finally:
            os.close(root)
            os.close(store)
    finally:
        os.close(dirfd)


def open_view_dir(
    mountpoint: str, rootfd: int, store_dirfd: int, invoker: int | None = None
) -> int:
    """An O_PATH descriptor of the directory *mountpoint* names, for a view
    to mount on: opened by ``open_dir`` (a symlink on the way that another
    user may have planted is PlantedLink, exit 2), not a mount point
    already (AlreadyMounted, exit 5), not inside a mounted workspace, a
    workspace's backing directory or store, this workspace's included
    (BadWorkspace, exit 7): checked on the directory found, by the mount
    it is on and by the path the kernel gives it.  The walk stops at the
    first component inside a mounted workspace (nothing is looked up in
    it).  *invoker*: the user asking (default: this process's), whose
    symlinks may be followed; one other than root must own the directory."""
    shown = quote(mountpoint)
    invoker = os.geteuid() if invoker is None else invoker
    if not os.path.isabs(mountpoint):
        raise CowfsError(f"view mount point {shown} is not an absolute path", errors.USAGE)
    # (a view is no place for another either)
    workspaces = {m.id: m for m in mounts() if m.fstype in (FSTYPE, VIEW_FSTYPE)}

    def inside(where: str, what: str) -> BadWorkspace:
        return BadWorkspace(
            f"cannot mount a view at {quote(where)}: it lies inside {what}; "
            "give a directory outside every workspace"
        )

    def enter(fd: int, more: bool) -> None:
        m = workspaces.get(mnt_id(fd)) if more else None
        if m is not None:
            raise inside(mountpoint, f"the mounted cowfs workspace {quote(m.mountpoint)}")

    try:
        fd = open_dir(mountpoint, enter=enter, invoker=invoker)
    except PlantedLink as e:
        raise PlantedLink(
            f"cannot mount a view at {shown}: {e}; give the directory it should lead to"
        ) from None
    except OSError as e:
        why = {errno.ENOENT: "does not exist", errno.ENOTDIR: "is not a directory"}.get(
            e.errno or 0, f"cannot be opened ({e.strerror})"
        )
        raise BadWorkspace(f"view mount point {shown} {why}") from None
    try:
        mp = fd_path(fd)
        owner = os.fstat(fd).st_uid
        if invoker != 0 and owner != invoker:
            raise errors.NotOwner(
                f"cannot mount a view at {quote(mp)}: the directory belongs to uid {owner}, "
                f"not to uid {invoker}, who asks for the view"
            )
        here = mnt_id(fd)
        up = os.open("..", PATH_FLAGS, dir_fd=fd)
        try:
            parent = mnt_id(up)
        finally:
            os.close(up)
        if here != parent or mp == "/":
            there = next((m.fstype for m in mounts() if m.id == here), "a mount")
            if there == VIEW_FSTYPE:
                raise AlreadyMounted(
                    f"a cowfs view is already mounted at {quote(mp)}; "
                    f"'cowfs unmount {quote(mp)}' ends it"
                )
            raise AlreadyMounted(
                f"{quote(mp)} is already a mount point ({there}); "
                "a view needs a directory of its own"
            )
        m = workspaces.get(here)
        if m is not None:
            raise inside(mp, f"the mounted cowfs workspace {quote(m.mountpoint)}")
        # (this workspace's, then every mounted one's: store first, the
        # more precise answer where it lies in its workspace)
        own = fd_path(rootfd)
        tops = [(fd_path(store_dirfd), own, "the store"), (own, own, "the backing directory")]
        for rec in mounted_workspaces():
            if rec.store:
                tops.append((rec.store, rec.workspace, "the store"))
            tops.append((rec.workspace, rec.workspace, "the backing directory"))
            tops.append((rec.mountpoint, rec.mountpoint, "the mount point"))
        for top, ws, what in tops:
            if top and within(mp, os.path.normpath(top)):
                raise inside(mp, f"{what} of the cowfs workspace {quote(ws)}")
        return fd
    except BaseException:
        os.close(fd)
        raise


def abandon_view(mountpoint: str, proc: Started, dirfd: int | None = None) -> None:
    """A view process whose start failed: kill it and clear the mount it
    may have left (on the directory open at *dirfd*, where given)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    clear_view(mountpoint, dirfd)


def clear_view(mountpoint: str, dirfd: int | None = None) -> None:
    """Detach the view mounted at *mountpoint* (its process, if it still
    runs, ends once nothing uses the mount); given *dirfd*, the directory
    the view was mounted on, wherever it is now, through that descriptor.
    start_view made sure nothing else was mounted there."""
    for _ in range(8):
        where = mountpoint if dirfd is None else fd_path(dirfd)
        if mount_table().get(where) != VIEW_FSTYPE:
            return
        # (umount2 of /proc/self/fd/N takes the mount on top of that very
        # directory; fusermount3, a process of its own, needs the path)
        target = f"/proc/self/fd/{dirfd}" if dirfd is not None and os.geteuid() == 0 else where
        try:
            unmount(target, lazy=True)
        except OSError as e:
            log.error("cannot clear the view at %s: %s", quote(where), e.strerror)
            return


# -- opening a path a user names ------------------------------------------------------
#
# A path the invoking user names (the DIR of `cowfs view`, an agent's
# settings file in a workspace) may run through directories another user
# can change, and the agent can swap any name it may write for a symlink at
# any moment.  So the path is opened once, component by component from "/"
# (or from a directory already open), each with O_PATH | O_NOFOLLOW, and
# what is found is what is used, through its descriptor.  A symlink met on
# the way is followed only where nobody but the invoking user (this
# process's: a daemon serves only its own user and root) and root can have
# put it: the link is owned by one of them, and so is the directory
# that holds it, which no one else may write -- or only with the sticky
# bit, which keeps others from renaming or removing what is not theirs.
# That follows /tmp -> private/tmp, /var/run -> /run and the user's own
# links in the user's own directories; any other symlink is refused, never
# followed (PlantedLink, exit 2).  The target of a link followed is walked
# by the same rules.

PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LINKS = 40  # (the kernel's limit before ELOOP)


def fd_path(fd: int) -> str:
    """Where the kernel says the object open at *fd* is now."""
    return os.readlink(f"/proc/self/fd/{fd}")


def mnt_id(fd: int) -> int:
    """The id of the mount the object open at *fd* is on (as in
    /proc/self/mountinfo); read without asking its filesystem anything."""
    with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
        for line in f:
            if line.startswith(b"mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.EIO, "no mnt_id in fdinfo", f"/proc/self/fdinfo/{fd}")


def _follow(fd: int, link: int, name: str, links: int, invoker: int) -> str:
    """The target of the symlink open at *link* (O_PATH), named *name* in
    the directory open at *fd*, if it may be followed (see above)."""
    trusted = (0, invoker)
    st, parent = os.fstat(link), os.fstat(fd)
    if st.st_uid not in trusted:
        why = f"is a symlink owned by another user (uid {st.st_uid})"
    elif parent.st_uid not in trusted or (
        parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX
    ):
        why = "is a symlink in a directory another user may change"
    elif links > MAX_LINKS:
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), os.path.join(fd_path(fd), name))
    else:
        return os.readlink("", dir_fd=link)
    raise PlantedLink(f"{quote(os.path.join(fd_path(fd), name))} {why}; it is not followed")


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def _open_root() -> int:
    return os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def open_dir(
    path: str,
    at: int | None = None,
    *,
    mkdir: int | None = None,
    enter: Callable[[int, bool], None] | None = None,
    invoker: int | None = None,
) -> int:
    """An O_PATH descriptor of the directory *path* (absolute, or relative
    to the directory open at *at*), opened component by component as
    described above.  *mkdir*: create a missing component with this mode;
    *enter(fd, more)*: called with each component opened, before anything
    else is asked of it (*more*: components follow), and may raise to stop
    there.  *invoker*: whose symlinks (besides root's) may be followed
    (default: this process's user).  Raises PlantedLink for a symlink that
    is not followed, OSError (ENOENT, ENOTDIR, ELOOP, ...) otherwise."""
    invoker = os.geteuid() if invoker is None else invoker
    fd = _open_root() if at is None or path.startswith("/") else os.dup(at)
    todo = _parts(path)
    links = 0
    try:
        while todo:
            name = todo.pop(0)
            try:
                nfd = os.open(name, PATH_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if mkdir is None or name == "..":
                    raise
                try:
                    os.mkdir(name, mkdir, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = os.open(name, PATH_FLAGS, dir_fd=fd)
            try:
                if enter is not None:
                    enter(nfd, bool(todo))
                mode = os.fstat(nfd).st_mode
                if stat.S_ISLNK(mode):
                    links += 1
                    target: str | None = _follow(fd, nfd, name, links, invoker)
                elif stat.S_ISDIR(mode):
                    target = None
                else:
                    raise NotADirectoryError(
                        errno.ENOTDIR, os.strerror(errno.ENOTDIR), os.path.join(fd_path(fd), name)
                    )
            except BaseException:
                os.close(nfd)
                raise
            if target is None:
                os.close(fd)
                fd = nfd
                continue
            os.close(nfd)
            if target.startswith("/"):
                os.close(fd)
                fd = _open_root()
            todo[:0] = _parts(target)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_entry(dirfd: int, name: str) -> tuple[int, str, int | None, bool]:
    """The entry *name* in the directory open at *dirfd*, a symlink there
    followed only as ``open_dir`` follows one (and its target's directory
    walked as ``open_dir`` walks it): (an O_PATH descriptor of the
    directory that holds the entry found, its name there, an O_PATH
    descriptor of it -- no symlink -- or None where there is none, whether
    a symlink was followed to it).  The caller closes the descriptors."""
    fd = os.dup(dirfd)
    links = 0
    try:
        while True:
            try:
                nfd = os.open(name, PATH_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                return fd, name, None, links > 0
            try:
                if not stat.S_ISLNK(os.fstat(nfd).st_mode):
                    return fd, name, nfd, links > 0
                links += 1
                target = _follow(fd, nfd, name, links, os.geteuid())
            except BaseException:
                os.close(nfd)
                raise
            os.close(nfd)
            head, _, name = target.rpartition("/")
            if name in ("", ".", ".."):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), target)
            nd = open_dir(head or ("/" if target.startswith("/") else "."), fd)
            os.close(fd)
            fd = nd
    except BaseException:
        os.close(fd)
        raise


def start_and_wait(
    module: str,
    args: list[str],
    pass_fds: tuple,
    timeout: float,
    what: str,
    abandon: Callable[[Started], None] | None = None,
) -> dict:
    """Start ``python -m module --ready-fd N args...`` in its own session
    and wait for the one JSON line it reports on N once its mount is live
    (or failed); return it, or raise the error it reported.  If waiting
    fails (no report in time, an unreadable one, an interrupt), *abandon*
    is called with the process and must leave nothing of it behind."""
    r, w = os.pipe()
    proc: Started | None
    try:
        # (forked from this daemon's zygote where it has one: no interpreter
        # to start, no imports to make)
        proc = ZYGOTE.spawn(module, ["--ready-fd", str(w), *args], (w, *pass_fds))
        if proc is None:
            proc = start_detached([module, "--ready-fd", str(w), *args], (w, *pass_fds))
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    try:
        msg = read_report(r, proc, timeout, f"the {module} process (pid {proc.pid})", what)
    except BaseException:
        if abandon is not None:
            abandon(proc)
        raise
    finally:
        os.close(r)
    if not msg.get("ok"):
        proc.wait()
        raise errors.from_dict(msg)
    STARTED.append(proc)
    return msg


def spawn(
    workspace: str,
    mountpoint: str | None = None,
    store: str | None = None,
    timeout: float = 120,
    **options: object,
) -> dict:
    """Start a daemon for *workspace* in its own session and wait until the
    mount is live; return its report (warnings, pid) or raise its error."""
    args = []
    if store:
        args += ["--store", os.path.abspath(store)]
    for name, value in options.items():
        if isinstance(value, list):
            for item in value:
                args += [f"--{name.replace('_', '-')}", item]
        elif value is True:
            args.append(f"--{name.replace('_', '-')}")
        elif value is not None and value is not False:
            args += [f"--{name.replace('_', '-')}", str(value)]
    args.append(os.path.abspath(workspace))
    if mountpoint:
        args.append(os.path.abspath(mountpoint))
    return start_and_wait(DAEMON_MODULE, args, (), timeout, f"mounting {workspace}")


# processes started here that outlive the start (a daemon's views): each is
# reaped once it exits (``reap``), so none stays a zombie of the process
# that started it
STARTED: list[Started] = []


def reap() -> None:
    """Collect the exit status of every process started here that ended."""
    STARTED[:] = [p for p in STARTED if p.poll() is None]


def read_report(fd: int, proc: Started, timeout: float, who: str, what: str) -> dict:
    """The one JSON object *proc* writes on *fd*, within *timeout* seconds."""
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        if not wait_readable(fd, deadline - time.monotonic()):
            raise CowfsError(
                f"{who} did not report within {timeout:.0f} s while {what}", errors.DAEMON_ERROR
            )
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
    if not buf:
        status: int | str
        try:
            status = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = "still running"
        raise CowfsError(f"{who} exited ({status}) without {what}", errors.DAEMON_ERROR)
    try:
        msg = json.loads(buf)
    except ValueError:
        msg = None
    if not isinstance(msg, dict):
        raise CowfsError(
            f"{who} sent an unreadable report while {what}: {buf[:60]!r}", errors.DAEMON_ERROR
        )
    return msg


def detach(ready_fd: int) -> Callable[[dict], None]:
    """For a process started by start_and_wait: stdio to /dev/null, and the
    function that reports (once) on *ready_fd*."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)

    def report(msg: dict) -> None:
        try:
            os.write(ready_fd, json.dumps(msg).encode() + b"\n")
            os.close(ready_fd)
        except OSError:
            pass

    return report
