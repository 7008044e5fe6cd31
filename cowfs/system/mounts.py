"""Finding mounted workspaces: the kernel's mount table and the runtime
directory where each daemon leaves its control socket and a small record."""

from __future__ import annotations

import json
import os
import select
import stat
import time
from typing import NamedTuple

import xxhash

from ..errors import (
    AlreadyMounted,
    BadWorkspace,
    NoStore,
    NotAnswering,
    NotMounted,
    NotOwner,
    PlantedLink,
    StoreError,
)
from .mountinfo import Mount, mounts, parse_mountinfo  # noqa: F401  (mounts: for its users)

FSTYPE = "fuse.cowfs"
VIEW_FSTYPE = "fuse.cowfs-view"  # a read-only view of the past (cowfs/fuse/view.py)
STORE_DIR = ".cowfs"  # a workspace's store, unless it is given: WORKSPACE/.cowfs


def default_store(workspace: str) -> str:
    return os.path.join(workspace, STORE_DIR)


def runtime_dir() -> str:
    """A 0700 directory for control sockets, private to this user."""
    if os.geteuid() == 0:
        base = "/run/cowfs"
    elif os.environ.get("XDG_RUNTIME_DIR"):
        base = os.path.join(os.environ["XDG_RUNTIME_DIR"], "cowfs")
    else:
        base = f"/tmp/cowfs-{os.geteuid()}"
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.lstat(base)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.chmod(base, 0o700)
        if os.lstat(base).st_uid != os.geteuid():
            raise PermissionError(f"{base} is not owned by this user")
    return base


def _own_dir(base: str, mode: int) -> str:
    """*base*, a directory of this user's with *mode* (made if missing),
    never one another user made or could change, nor a symlink."""
    os.makedirs(base, mode=mode, exist_ok=True)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(f"{base} is not a directory owned by this user")
    if stat.S_IMODE(st.st_mode) != mode:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    return base


def shared_runtime_dir() -> str:
    """Where a daemon whose workspace grants other users operations
    (``cowfs mount --allow``) keeps its control socket (mode 0666: the
    daemon checks each peer's credentials) and a copy of its record, in a
    directory others may search but not change."""
    if os.geteuid() == 0:
        return _own_dir("/run/cowfs-shared", 0o755)
    return _own_dir(f"/tmp/cowfs-shared-{os.geteuid()}", 0o755)


def shared_dirs_of(uid: int) -> list[str]:
    """Where the shared records of *uid*'s daemons are (for other users):
    only a directory of that user's that nobody else may change (another
    user could have made one in /tmp, with records leading to a socket of
    its own)."""
    base = "/run/cowfs-shared" if uid == 0 else f"/tmp/cowfs-shared-{uid}"
    try:
        st = os.lstat(base)
    except OSError:
        return []
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022:
        return []
    return [base]


def runtime_dirs_of(uid: int) -> list[str]:
    """Where a daemon run by *uid* may have its runtime directory (for root,
    which may control every user's workspace)."""
    if uid == 0:
        return ["/run/cowfs"]
    return [f"/run/user/{uid}/cowfs", f"/tmp/cowfs-{uid}"]


def _key(mountpoint: str) -> str:
    return xxhash.xxh3_64_hexdigest(os.fsencode(mountpoint))


def path_key(path: str) -> str:
    """A short name for *path* in file names (runtime directories)."""
    return _key(path)


def socket_path(mountpoint: str, shared: bool = False) -> str:
    """The control socket's path; *shared*: one other users may reach."""
    base = shared_runtime_dir() if shared else runtime_dir()
    return os.path.join(base, _key(mountpoint) + ".sock")


def record_path(mountpoint: str) -> str:
    return os.path.join(runtime_dir(), _key(mountpoint) + ".json")


MNT_DETACH = 2


def unmount(mountpoint: str, lazy: bool) -> None:
    """Unmount *mountpoint*: umount2(2) as root, fusermount3 -u otherwise;
    *lazy* detaches it at once, leaving it to the processes still inside."""
    if os.geteuid() == 0:
        from .backing import checked, libc

        checked(libc.umount2(os.fsencode(mountpoint), MNT_DETACH if lazy else 0), mountpoint)
        return
    import errno
    import subprocess

    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + ["--", mountpoint]
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        busy = "busy" in r.stderr.lower()
        raise OSError(
            errno.EBUSY if busy else errno.EIO,
            r.stderr.strip().removeprefix("fusermount3: ") or "fusermount3 failed",
            mountpoint,
        )


def mount_table() -> dict[str, str]:
    """Mount point -> filesystem type, the last mount at a point winning."""
    return {m.mountpoint: m.fstype for m in mounts()}


def mount_owner(path: str) -> int | None:
    """The uid that mounted the FUSE filesystem at *path* (its user_id)."""
    found = [m for m in mounts() if m.mountpoint == path]
    if not found:
        return None
    for opt in found[-1].options.split(","):
        if opt.startswith("user_id="):
            return int(opt[len("user_id=") :])
    return None


def not_owner(what: str, uid: int) -> NotOwner:
    return NotOwner(
        f"{what} belongs to another user (uid {uid}); only that user or root may control it"
    )


def is_cowfs_mount(path: str) -> bool:
    return mount_table().get(path) == FSTYPE


def pid_alive(pid: int) -> bool:
    """True while *pid* runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return process_state(pid) not in (None, "Z")


def process_state(pid: int) -> str | None:
    """The state letter of process *pid* (proc(5): R, S, D, T stopped, t
    stopped by a tracer, Z, ...), None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def stopped(pid: int) -> bool:
    """Whether process *pid* is stopped (SIGSTOP, SIGTSTP, a debugger)."""
    return process_state(pid) in ("T", "t")


class MountRecord:
    """What a daemon leaves in the runtime directory about its mount (a
    plain class: the command line reads it first thing, and dataclasses cost
    milliseconds to import)."""

    __slots__ = ("mountpoint", "workspace", "store", "pid", "socket", "finishing", "dev")

    def __init__(
        self,
        mountpoint: str,
        workspace: str,
        store: str,
        pid: int,
        socket: str,
        finishing: bool = False,
        dev: str = "",
    ):
        self.mountpoint = mountpoint
        self.workspace = workspace
        self.store = store
        self.pid = pid
        self.socket = socket
        self.finishing = finishing  # unmounted; the daemon records its state and exits
        # the mount's device ("major:minor"), which names it in every mount
        # namespace ("": not known yet) -- in another namespace another
        # cowfs mount may be at the same path (a fork, ``run --fork``)
        self.dev = dev

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MountRecord) and self.as_dict() == other.as_dict()

    def __repr__(self) -> str:
        return f"MountRecord({self.as_dict()})"

    @classmethod
    def load(cls, mountpoint: str, dirs: list[str] | None = None) -> MountRecord | None:
        """The record of the daemon serving *mountpoint*, from this user's
        runtime directory (or the first of *dirs* that has one)."""
        paths = (
            [os.path.join(d, _key(mountpoint) + ".json") for d in dirs]
            if dirs
            else [record_path(mountpoint)]
        )
        for path in paths:
            rec = cls._read(path)
            if rec is not None:
                return rec
        return None

    @classmethod
    def _read(cls, path: str) -> MountRecord | None:
        try:
            with open(path) as f:
                return cls(**json.load(f))
        except (OSError, ValueError, TypeError):
            return None

    @classmethod
    def all(cls) -> list[MountRecord]:
        """Every record in this user's runtime directory (live or not)."""
        base = runtime_dir()
        found = (
            cls._read(os.path.join(base, n))
            for n in sorted(os.listdir(base))
            if n.endswith(".json")
        )
        return [rec for rec in found if rec is not None]

    @property
    def shared(self) -> bool:
        """Whether other users may reach the daemon (its workspace grants
        them operations): its socket and a copy of this record are in the
        shared runtime directory."""
        return os.path.dirname(self.socket) in shared_dirs_of(os.geteuid())

    def _paths(self) -> list[tuple[str, int]]:
        paths = [(record_path(self.mountpoint), 0o600)]
        if self.shared:
            shared = os.path.dirname(self.socket)
            paths.append((os.path.join(shared, _key(self.mountpoint) + ".json"), 0o644))
        return paths

    def save(self) -> None:
        for path, mode in self._paths():
            tmp = path + ".tmp"
            with open(
                os.open(
                    tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode
                ),
                "w",
            ) as f:
                os.fchmod(f.fileno(), mode)
                json.dump(self.as_dict(), f)
            os.replace(tmp, path)

    def remove(self) -> None:
        """Remove the record and the socket, unless they are another
        daemon's by now (one that mounted at the same point since)."""
        current = MountRecord.load(self.mountpoint)
        if current is not None and current.pid != self.pid:
            return
        for p in [path for path, _ in self._paths()] + [self.socket]:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


LIVE, DEAD, UNMOUNTED = "live", "dead", "unmounted"


class Location(NamedTuple):
    """Where the workspace of a path is, and in what state (see locate)."""

    state: str  # LIVE, DEAD or UNMOUNTED
    root: str  # the mount point (live, dead); the workspace (unmounted)
    record: MountRecord | None  # the daemon's record (live; dead: if it left one)
    store: str | None  # unmounted: the store found there; None: no workspace found
    refused: str | None = None  # unmounted: why the store found is not one to trust

    def mounted(self, path: str) -> MountRecord:
        """The record of a live mount; NotMounted, saying what to do, otherwise."""
        if self.state == LIVE and self.record is not None:
            return self.record
        if self.state == DEAD:
            ws = self.record.workspace if self.record else self.root
            raise NotMounted(
                f"{self.root}: the cowfs daemon of this mount is gone; "
                f"run 'cowfs mount {ws}' to recover it"
            )
        real = os.path.realpath(path)
        shown = path if real == path else f"{path} ({real})"
        raise NotMounted(
            f"{shown} is not inside a mounted cowfs workspace; mount one with 'cowfs mount DIR'"
        )

    def unmounted(self, path: str) -> tuple[str, str | None]:
        """(workspace, store) to work on without a mount: a dead mount's (the
        store None when it is the default), or the nearest store above *path*."""
        if self.state != UNMOUNTED:
            return (self.record.workspace, self.record.store) if self.record else (self.root, None)
        if self.refused is not None:
            raise StoreError(self.refused)
        if self.store is None:
            raise NoStore(
                f"{path} is not inside a cowfs workspace (mounted, or with a "
                f"{STORE_DIR} store); give the store with --store DIR"
            )
        if not os.access(self.store, os.X_OK):
            raise not_owner(f"the cowfs store {self.store}", os.stat(self.store).st_uid)
        return self.root, None


def locate(path: str) -> Location:
    """The workspace that contains *path*: the nearest cowfs mount above it,
    live (its daemon answers) or dead (its daemon is gone), else the nearest
    directory above it with a store (STORE_DIR), unmounted; else UNMOUNTED
    with *path* itself as the root and no store.  Another user's mount is
    NotOwner (root reads that user's record).

    Of the stores above *path* only those cowfs may trust count (see
    cowfs/system/trust.py: anyone else could have made or changed the others, say
    an agent in a directory of the workspace it may write), and of those the
    outermost: a store below another workspace's root lies in that
    workspace's tree, where whoever may write it could have put it (or it
    was made through its mount), so it is never adopted.  Where stores were
    found and none may be trusted, the nearest one's refusal (StoreError
    from Location.unmounted)."""
    table = mount_table()
    p = resolve(path, table)
    q = p
    while True:
        if table.get(q) == FSTYPE:
            rec = record_at(q)
            alive = rec is not None and pid_alive(rec.pid)
            return Location(LIVE if alive else DEAD, q, rec, None)
        if q == "/":
            break
        q = os.path.dirname(q)
    from .trust import why_untrusted

    q = p
    found: Location | None = None
    refused: Location | None = None
    while True:
        store = default_store(q)
        if os.path.isdir(os.path.join(store, "db")) or (
            os.path.isdir(store) and not os.access(store, os.X_OK)
        ):
            # (the directories down to the store: opening it checks the rest)
            why = why_untrusted(store, whole=False)
            if why is None:
                found = Location(UNMOUNTED, q, None, store)  # (an outer one wins)
            elif refused is None:
                refused = Location(
                    UNMOUNTED, q, None, store, f"refusing to use the cowfs store {store}: {why}"
                )
        if q == "/":
            return found or refused or Location(UNMOUNTED, p, None, None)
        q = os.path.dirname(q)


def record_at(mountpoint: str) -> MountRecord | None:
    """The record of the daemon of the cowfs mount at *mountpoint*, if it
    left one: this user's, or (root) that of the user who mounted it, or
    one the workspace shares with other users.  Another user's mount that
    shares nothing with this one is NotOwner.  The mount at that path in
    this process's mount namespace is the one meant: where it is another
    cowfs mount than the record's (a fork bound there), that mount's own
    record, found by its device."""
    rec = _record_at(mountpoint)
    table = mounts()
    found = [m for m in table if m.mountpoint == mountpoint and m.fstype == FSTYPE]
    if rec is None or not rec.dev or not found or found[-1].dev == rec.dev:
        return rec
    dev = found[-1].dev
    # (device numbers are reused: a record left by a daemon killed before
    # its mount went is no answer, only one whose mount is there now)
    here = {m.mountpoint for m in table if m.dev == dev and m.fstype == FSTYPE}
    for other in MountRecord.all():
        if other.dev == dev and other.mountpoint in here and pid_alive(other.pid):
            return other
    return None


def _record_at(mountpoint: str) -> MountRecord | None:
    rec = MountRecord.load(mountpoint)
    owner = mount_owner(mountpoint) if rec is None else None
    if owner is not None and owner != os.geteuid():
        if os.geteuid() != 0:
            # (its daemon serves other users only where the
            # workspace grants them something: cowfs mount --allow)
            rec = MountRecord.load(mountpoint, shared_dirs_of(owner))
            if rec is None:
                raise not_owner(f"the cowfs workspace mounted at {mountpoint}", owner)
        else:
            rec = MountRecord.load(mountpoint, runtime_dirs_of(owner))
    return rec


def not_answering(rec: MountRecord, waited: float, why: str = "") -> NotAnswering:
    """The error for the daemon of *rec* that sent nothing for *waited*
    seconds (*why*: what the client saw, when the daemon is not stopped)."""
    pid, state = rec.pid, process_state(rec.pid)
    if state in ("T", "t"):
        why, todo = "it is stopped", f"'kill -CONT {pid}' resumes it; "
    else:
        why = why or f"nothing came from it for {waited:g} s"
        todo = f"see {os.path.join(rec.store, 'daemon.log')}; " if rec.store else ""
    return NotAnswering(
        f"daemon {pid} of {rec.mountpoint} does not answer ({why}): {todo}'kill -9 {pid}', "
        f"then 'cowfs mount {rec.workspace}', recovers the workspace with its layers "
        f"(waited {waited:g} s; COWFS_DEADLINE sets how long)",
        pid,
        rec.mountpoint,
    )


def wait_resumed(mountpoint: str) -> None:
    """Before anything looks at the cowfs mount at *mountpoint*: if its
    daemon is stopped, wait for it to go on, up to the deadline, then
    NotAnswering.  (The kernel would wait for it without a deadline.)"""
    try:
        rec = record_at(mountpoint)
    except NotOwner:
        return  # (whose daemon it is is told where the workspace is looked for)
    if rec is None or rec.pid <= 0 or not stopped(rec.pid):
        return
    from .deadlines import deadline

    waited = deadline()
    end = time.monotonic() + waited
    while stopped(rec.pid):
        if time.monotonic() >= end:
            raise not_answering(rec, waited)
        time.sleep(0.02)


def check_answering(path: str) -> None:
    """*path* may be looked at: no cowfs mount it lies in (as it is written;
    resolve checks each mount point it crosses, through symlinks too) has
    a stopped daemon (see wait_resumed)."""
    p = os.path.abspath(path)
    for m in mounts():
        if m.fstype == FSTYPE and within(p, m.mountpoint):
            wait_resumed(m.mountpoint)


def resolve(path: str, table: dict[str, str] | None = None) -> str:
    """*path* absolute and without symlinks, as os.path.realpath gives it
    (non-strict: a component it cannot look at, such as a dead mount's, ends
    the resolution), but following only a symlink that the invoking user or
    root owns, in a directory that only they may change (or a sticky one):
    a path root names must not lead, through a link an agent planted, to
    another workspace than the one it lies in.  PlantedLink (exit 2)
    otherwise.  A cowfs mount it crosses whose daemon is stopped is waited
    for (wait_resumed; *table*: the mount table, when read already)."""
    table = mount_table() if table is None else table
    trusted = (0, os.geteuid())
    todo = [p for p in os.path.abspath(path).split("/") if p]
    done = "/"
    links = 0
    while todo:
        name = todo.pop(0)
        if name == "..":
            done = os.path.dirname(done)
            continue
        here = os.path.join(done, name)
        if table.get(here) == FSTYPE:
            wait_resumed(here)
        try:
            st = os.lstat(here)
        except OSError:
            return os.path.normpath(os.path.join(here, *todo))
        if not stat.S_ISLNK(st.st_mode):
            done = here
            continue
        try:
            parent = os.lstat(done)
        except OSError:
            return os.path.normpath(os.path.join(here, *todo))
        links += 1
        if (
            st.st_uid not in trusted
            or parent.st_uid not in trusted
            or (parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX)
            or links > 40
        ):
            raise PlantedLink(
                f"{here} is a symlink another user (uid {st.st_uid}) could have put "
                "there; it is not followed: give the path it should lead to"
            )
        target = os.readlink(here)
        if target.startswith("/"):
            done = "/"
        todo[:0] = [p for p in target.split("/") if p and p != "."]
    return done


def find_mount(path: str) -> MountRecord:
    """The mounted workspace that contains *path*."""
    try:
        os.lstat(resolve(path))
    except FileNotFoundError:
        raise NotMounted(f"{path}: no such file or directory") from None
    except OSError:
        pass  # e.g. ENOTCONN: a mount whose daemon died, reported below
    return locate(path).mounted(path)


def mounted_elsewhere(workspace: str) -> Location | None:
    """A workspace mounted at another mount point (cowfs mount WORKSPACE
    MOUNTPOINT), as its daemon's record in this user's runtime directory has
    it: live or dead."""
    table = mount_table()
    for rec in MountRecord.all():
        if rec.workspace == workspace and table.get(rec.mountpoint) == FSTYPE:
            return Location(LIVE if pid_alive(rec.pid) else DEAD, rec.mountpoint, rec, None)
    return None


def mounted_workspaces() -> list[MountRecord]:
    """A record for each cowfs mount in the mount table, live or dead: its
    daemon's record or, where there is none (another user's mount, a record
    lost with its daemon), what the table says: the workspace named in the
    mount's source, pid 0 (unknown)."""
    out: dict[str, MountRecord] = {}
    for m in mounts():
        if m.fstype != FSTYPE:
            continue
        rec = MountRecord.load(m.mountpoint)
        if rec is None:
            ws = m.source.removeprefix("cowfs:") if m.source.startswith("cowfs:/") else m.mountpoint
            rec = MountRecord(m.mountpoint, ws, "", 0, "")
        out[m.mountpoint] = rec
    return list(out.values())


def mount_users(mount: Mount, any_namespace: bool = False) -> list[int]:
    """Pids of the processes (other than this one) that use *mount*, also
    once it is detached: a working or root directory, an open file or a
    mapped file on it.  Read from /proc without touching the mount.  With
    *any_namespace*, those that use any mount of its filesystem, here (a
    bind mount of it) or in another mount namespace (a fork bound over its
    workspace's path by ``run --fork``: each process's mounts are read from
    its own mountinfo)."""
    return mounts_users([mount], any_namespace)[0]


def mounts_users(found: list[Mount], any_namespace: bool = False) -> list[list[int]]:
    """``mount_users`` of each of *found*, in one pass over the processes."""
    devs = [m.dev for m in found]
    mapped = []
    for dev in devs:
        major, minor = (int(x) for x in dev.split(":"))
        mapped.append(f" {major:02x}:{minor:02x} ".encode())
    ours = _namespace("/proc/self")
    table = mounts()
    here = [
        {m.id for m in table if m.dev == mount.dev} if any_namespace else {mount.id}
        for mount in found
    ]
    users: list[list[int]] = [[] for _ in found]
    if not found:
        return users
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        hit: set[int] = set()
        for proc in _tasks(name):
            try:
                ids = here
                if any_namespace and _namespace(proc) != ours:
                    theirs = _ids_by_dev(proc)
                    ids = [theirs.get(dev, set()) for dev in devs]
                hit.update(_uses(proc, ids, mapped))
            except OSError:  # gone, a kernel thread, or not ours to read
                continue
        for i in hit:
            users[i].append(int(name))
    return [sorted(u) for u in users]


# kcmp(2)'s number and the kinds it compares: which threads of a process
# share their leader's descriptors, directories and memory
_KCMP = {"x86_64": 312, "aarch64": 272, "riscv64": 272}.get(os.uname().machine)
KCMP_VM, KCMP_FILES, KCMP_FS = 1, 2, 3


def _tasks(pid: str) -> list[str]:
    """Where to read what process *pid* uses: its own entry, and each
    thread's that does not share the leader's descriptors, working and
    root directory, memory and mount namespace -- a thread may have
    unshared them, and a leader that exited before its threads (a zombie)
    shows none of what they hold."""
    proc = f"/proc/{pid}"
    try:
        threads = os.listdir(f"{proc}/task")
    except OSError:
        return [proc]
    if len(threads) == 1:
        return [proc]
    out = [proc]
    try:
        ns = _namespace(proc)
    except OSError:  # (an exited leader)
        ns = None
    for tid in threads:
        if tid == pid:
            continue
        task = f"{proc}/task/{tid}"
        try:
            if ns is not None and _same_as_leader(int(pid), int(tid)) and _namespace(task) == ns:
                continue
        except OSError:
            pass
        out.append(task)
    return out


def _same_as_leader(pid: int, tid: int) -> bool:
    if _KCMP is None:
        return False
    from .backing import libc

    return all(
        libc.syscall(_KCMP, pid, tid, kind, 0, 0) == 0 for kind in (KCMP_FILES, KCMP_FS, KCMP_VM)
    )


def _namespace(proc: str) -> str:
    return os.readlink(f"{proc}/ns/mnt")


def _ids_by_dev(proc: str) -> dict[str, set[int]]:
    """The ids of the mounts in *proc*'s mount namespace, by device."""
    with open(f"{proc}/mountinfo") as f:
        text = f.read()
    out: dict[str, set[int]] = {}
    for m in parse_mountinfo(text)[0]:
        out.setdefault(m.dev, set()).add(m.id)
    return out


def _uses(proc: str, ids: list[set[int]], mapped: list[bytes]) -> list[int]:
    """Which of the mounts (each: its ids, the device as the maps name it)
    process *proc* uses."""
    used = set()
    for link in ("cwd", "root"):
        used.add(_link_mnt(proc, link))
    for entry in os.listdir(f"{proc}/fdinfo"):
        try:
            used.add(_mnt_id(f"{proc}/fdinfo/{entry}"))
        except OSError:  # closed meanwhile
            continue
    hit = [i for i, these in enumerate(ids) if used & these]
    if len(hit) < len(ids):
        with open(f"{proc}/maps", "rb") as f:
            maps = f.read()
        hit += [i for i, dev in enumerate(mapped) if i not in hit and dev in maps]
    return hit


def _link_mnt(proc: str, link: str) -> int | None:
    """The mount the directory *link* (cwd, root) of process *proc* is on
    (its magic link opened, not the mount walked)."""
    fd = os.open(f"{proc}/{link}", os.O_PATH | os.O_CLOEXEC)
    try:
        return _mnt_id(f"/proc/self/fdinfo/{fd}")
    finally:
        os.close(fd)


def _link_on(proc: str, link: str, ids: set[int]) -> bool:
    """Whether the directory *link* (cwd, root) of process *proc* is on one
    of the mounts *ids*."""
    return _link_mnt(proc, link) in ids


def callers_inside(mountpoint: str) -> list[int]:
    """This process and those it descends from (the shell that ran it, and
    the shells that ran that) whose working directory is on the cowfs
    mount at *mountpoint*: an unmount finds it busy while they are there,
    and only they can leave."""
    ours = [m for m in mounts() if m.mountpoint == mountpoint and m.fstype == FSTYPE]
    if not ours:
        return []
    found: list[int] = []
    pid = os.getpid()
    while pid > 1:  # (the chain of parents ends at 1, or at 0 outside our pid namespace)
        try:
            if _link_on(f"/proc/{pid}", "cwd", {ours[-1].id}):
                found.append(pid)
        except OSError:  # not ours to look at (sudo's), or gone
            pass
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found


def _mnt_id(fdinfo: str) -> int | None:
    with open(fdinfo, "rb") as f:
        for line in f:
            if line.startswith(b"mnt_id:"):
                return int(line.split()[1])
    return None


def lock_holder(path: str) -> int | None:
    """The pid that holds a lock on the file *path* (from /proc/locks)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()  # "1: FLOCK ADVISORY WRITE PID MAJ:MIN:INO 0 EOF"
        if len(fields) > 5 and fields[1] != "->" and fields[5] == key:
            return int(fields[4]) if int(fields[4]) > 0 else None
    return None


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait until process *pid* has exited (True), at most *timeout* s."""
    deadline = time.monotonic() + timeout
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:
        fd = -1
    if fd >= 0:  # (woken as it exits)
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll(max(0, int(timeout * 1000)))
        finally:
            os.close(fd)
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def finish_unmount(rec: MountRecord, result: dict, timeout: float = 60) -> list[int]:
    """After the daemon of *rec* answered an unmount request with *result*:
    the pids still using a lazily detached mount (the daemon goes on serving
    them and exits after the last one), or [] once the daemon has exited.
    A daemon still running after *timeout* is said to be, never hidden."""
    users = result.get("users") or []
    if users:
        return users
    if not wait_gone(rec.pid, timeout):
        raise AlreadyMounted(
            f"{rec.mountpoint} is unmounted, but its daemon (pid {rec.pid}) is still "
            f"finishing after {timeout:.0f} s (recording the workspace's state, closing "
            "the store); the workspace cannot be mounted again until it exits"
        )
    return []


def processes(pids: list[int], limit: int = 10) -> str:
    """'1234 (bash), 1240 (make)' for the first *limit* pids."""

    def one(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/comm") as f:
                return f"{pid} ({f.read().strip()})"
        except OSError:
            return str(pid)

    more = f" and {len(pids) - limit} more" if len(pids) > limit else ""
    return ", ".join(map(one, pids[:limit])) + more


def within(path: str, top: str) -> bool:
    """*path* is *top* or lies below it (both absolute and normalised)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def already_mounted(rec: MountRecord) -> AlreadyMounted:
    where = "over itself" if rec.mountpoint == rec.workspace else f"at {rec.mountpoint}"
    return AlreadyMounted(
        f"{rec.workspace} is already mounted {where} (cowfs daemon pid "
        f"{rec.pid}); 'cowfs unmount {rec.mountpoint}' first"
    )


def recover_stale_mount(mountpoint: str) -> str | None:
    """Clear a dead cowfs mount at *mountpoint* (its daemon is gone); the
    warning that says so, or None when there was none.  A live one is
    refused."""
    if not is_cowfs_mount(mountpoint):
        return None
    rec = MountRecord.load(mountpoint)
    if rec is not None and pid_alive(rec.pid):
        raise AlreadyMounted(f"{mountpoint} is already mounted by cowfs (pid {rec.pid})")
    unmount(mountpoint, lazy=True)
    if rec is not None:
        rec.remove()
    return f"cleared the dead mount at {mountpoint}"


def check_other_mounts(workspace: str, mountpoint: str, store_dir: str) -> list[str]:
    """Before mounting: refuse a workspace that is mounted already
    (anywhere; a dead mount of it is cleared: the warnings say so), a
    mount point where another workspace is mounted, and any nesting with
    another mounted workspace, either way: the outer one's layers would
    capture the inner one's live store, and an outer rollback rewrite it."""
    warnings = []
    for path in (workspace, mountpoint, store_dir):
        check_answering(path)  # (a stopped daemon's mount would hang realpath)
    ws, mp, store = map(os.path.realpath, (workspace, mountpoint, store_dir))
    ours = {"workspace": ws, "mount point": mp, "store": store}
    for rec in mounted_workspaces():
        live = rec.pid > 0 and pid_alive(rec.pid)
        # (their paths as recorded, absolute: resolving them would ask their
        # daemons, and one that hangs would hang this mount)
        theirs = {
            "workspace": os.path.normpath(rec.workspace),
            "mount point": os.path.normpath(rec.mountpoint),
            "store": os.path.normpath(rec.store) if rec.store else None,
        }
        if ws in (theirs["workspace"], theirs["mount point"]) or store == theirs["store"]:
            if live:
                raise already_mounted(rec)
            if rec.pid and theirs["mount point"] != mp:  # (dead, by its record)
                cleared = recover_stale_mount(rec.mountpoint)
                if cleared:
                    warnings.append(cleared)
            continue
        if mp == theirs["mount point"]:
            if live:
                raise AlreadyMounted(
                    f"{mp} is the mount point of the cowfs workspace "
                    f"{rec.workspace} (daemon pid {rec.pid})"
                )
            continue  # a dead mount there is cleared when the store opens
        other = rec.workspace + (
            ""
            if theirs["mount point"] == theirs["workspace"]
            else f" (mounted at {rec.mountpoint})"
        )
        for role, path in ours.items():
            for their_role, their_path in theirs.items():
                if their_path is None:
                    continue
                what = (
                    "the store of " if their_role == "store" else ""
                ) + f"the mounted cowfs workspace {other}"
                if within(path, their_path):
                    where = f"its {role} {path} lies inside {what}"
                elif within(their_path, path):
                    where = f"{what} lies inside its {role} {path}"
                else:
                    continue
                raise BadWorkspace(
                    f"cannot mount {ws}: {where}; nested workspaces are "
                    "refused (the outer one would capture the inner "
                    "one's store)"
                )
    return warnings


def store_in_use(store_dir: str, workspace: str) -> AlreadyMounted:
    """Why the store's lock is taken: by the daemon of a mount (or of a
    lazily unmounted one that still serves), or by another process."""
    store = os.path.realpath(store_dir)
    for rec in MountRecord.all():
        if os.path.normpath(rec.store) != store or not pid_alive(rec.pid):
            continue
        if is_cowfs_mount(rec.mountpoint):
            return already_mounted(rec)
        return AlreadyMounted(
            f"{rec.workspace} was unmounted lazily from {rec.mountpoint} and its daemon "
            f"(pid {rec.pid}) still serves the processes using it; it exits when the "
            "last one leaves"
        )
    pid = lock_holder(os.path.join(store_dir, "lock"))
    return AlreadyMounted(
        f"the store of {workspace} ({store_dir}) is in use "
        "by another cowfs process" + (f" (pid {pid})" if pid else "")
    )


def finishing_daemon(store_dir: str) -> int | None:
    """The pid of the daemon of the last mount of the store at *store_dir*
    while it is still finishing its unmount (recording the workspace's
    state, closing the store)."""
    for rec in MountRecord.all():
        if (
            rec.finishing
            and os.path.normpath(rec.store) == os.path.realpath(store_dir)
            and pid_alive(rec.pid)
        ):
            return rec.pid
    return None
