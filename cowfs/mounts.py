"""Finding mounted workspaces: the kernel's mount table and the runtime
directory where each daemon leaves its control socket and a small record."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import xxhash

from .errors import NotMounted, NotOwner

FSTYPE = "fuse.cowfs"


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


def runtime_dirs_of(uid: int) -> list[str]:
    """Where a daemon run by *uid* may have its runtime directory (for root,
    which may control every user's workspace)."""
    if uid == 0:
        return ["/run/cowfs"]
    return [f"/run/user/{uid}/cowfs", f"/tmp/cowfs-{uid}"]


def _key(mountpoint: str) -> str:
    return xxhash.xxh3_64_hexdigest(os.fsencode(mountpoint))


def socket_path(mountpoint: str) -> str:
    return os.path.join(runtime_dir(), _key(mountpoint) + ".sock")


def record_path(mountpoint: str) -> str:
    return os.path.join(runtime_dir(), _key(mountpoint) + ".json")


def _unescape(field: str) -> str:
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mountinfo() -> dict[str, list[str]]:
    """Mount point -> the fields after the separator of its mountinfo line
    (type, source, super options), the last mount at a point winning."""
    table = {}
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            table[_unescape(left.split(" ")[4])] = right.split(" ")
    return table


def mount_table() -> dict[str, str]:
    """Mount point -> filesystem type, the last mount at a point winning."""
    return {mp: fields[0] for mp, fields in _mountinfo().items()}


def mount_owner(path: str) -> int | None:
    """The uid that mounted the FUSE filesystem at *path* (its user_id)."""
    fields = _mountinfo().get(path)
    if fields is None or len(fields) < 3:
        return None
    for opt in fields[2].strip().split(","):
        if opt.startswith("user_id="):
            return int(opt[len("user_id="):])
    return None


def not_owner(what: str, uid: int) -> NotOwner:
    return NotOwner(f"{what} belongs to another user (uid {uid}); only that user or root "
                    "may control it")


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
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


@dataclass
class MountRecord:
    mountpoint: str
    workspace: str
    store: str
    pid: int
    socket: str

    @classmethod
    def load(cls, mountpoint: str, dirs: list[str] | None = None) -> "MountRecord | None":
        """The record of the daemon serving *mountpoint*, from this user's
        runtime directory (or the first of *dirs* that has one)."""
        paths = [os.path.join(d, _key(mountpoint) + ".json") for d in dirs] if dirs \
            else [record_path(mountpoint)]
        for path in paths:
            try:
                with open(path) as f:
                    return cls(**json.load(f))
            except (OSError, ValueError, TypeError):
                continue
        return None

    def save(self) -> None:
        path = record_path(self.mountpoint)
        tmp = path + ".tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600),
                  "w") as f:
            json.dump(self.__dict__, f)
        os.replace(tmp, path)

    def remove(self) -> None:
        for p in (record_path(self.mountpoint), self.socket):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def find_mount(path: str) -> MountRecord:
    """The mounted workspace that contains *path*."""
    try:
        p = os.path.realpath(path)
    except OSError as e:
        raise NotMounted(f"{path}: {e.strerror}") from None
    try:
        os.lstat(p)
    except FileNotFoundError:
        raise NotMounted(f"{path}: no such file or directory") from None
    except OSError:
        pass  # e.g. ENOTCONN: a mount whose daemon died, reported below
    table = mount_table()
    while True:
        if table.get(p) == FSTYPE:
            rec = MountRecord.load(p)
            owner = mount_owner(p) if rec is None else None
            if owner is not None and owner != os.geteuid():
                if os.geteuid() != 0:
                    raise not_owner(f"the cowfs workspace mounted at {p}", owner)
                rec = MountRecord.load(p, runtime_dirs_of(owner))
            if rec is None or not pid_alive(rec.pid):
                raise NotMounted(f"{p}: the cowfs daemon of this mount is gone; "
                                 f"run 'cowfs mount {rec.workspace if rec else p}' to recover it")
            return rec
        if p == "/":
            raise NotMounted(f"{path} is not inside a mounted cowfs workspace")
        p = os.path.dirname(p)
