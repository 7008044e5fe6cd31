"""Who asks, and what they may do: the kernel's permission rules applied
for a requester to objects cowfs reads or changes on its behalf.

The daemon runs as root; a control request comes from a user (SO_PEERCRED
and SO_PEERGROUPS on the control socket).  What cowfs reveals of the tree
(`show`, `diff`, `view`) or changes in it (`restore`) it does only where
the kernel would let that user do the same: ``permitted`` is the kernel's
``generic_permission`` (owner, group and other bits, POSIX ACLs with their
mask) for a user without capabilities, and root may do anything but run a
file that nobody may run.  It is applied to an object as it is now (its
stat and ACL) and as a layer recorded it (the mode, owner and ACL at T),
so a user who could not read a file then cannot read it through the past
either.
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass

R, W, X = 4, 2, 1

ACL_ACCESS = b"system.posix_acl_access"
_ACL_VERSION = 2
_ACL_HEADER = struct.Struct("<I")
_ACL_ENTRY = struct.Struct("<HHI")
# tags (linux/posix_acl.h)
ACL_USER_OBJ, ACL_USER, ACL_GROUP_OBJ, ACL_GROUP, ACL_MASK, ACL_OTHER = 1, 2, 4, 8, 0x10, 0x20

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


@dataclass(frozen=True)
class Requester:
    """A user on whose behalf an operation runs: uid, primary gid,
    supplementary groups, and the process that asked (for `--who`)."""

    uid: int
    gid: int
    groups: frozenset[int]
    pid: int

    @property
    def root(self) -> bool:
        return self.uid == 0

    def in_group(self, gid: int) -> bool:
        return gid == self.gid or gid in self.groups

    @classmethod
    def this_process(cls) -> Requester:
        return cls(os.geteuid(), os.getegid(), frozenset(os.getgroups()), os.getpid())

    @classmethod
    def of_user(cls, uid: int, pid: int = 0) -> Requester:
        """*uid* with the groups the user database gives it."""
        try:
            pw = pwd.getpwuid(uid)
        except KeyError:
            return cls(uid, uid, frozenset(), pid)
        return cls(uid, pw.pw_gid, frozenset(os.getgrouplist(pw.pw_name, pw.pw_gid)), pid)

    @classmethod
    def of_process(cls, pid: int, uid: int, gid: int) -> Requester:
        """The process *pid* making a FUSE request as *uid*/*gid*, with the
        supplementary groups /proc says it has (none, if it is gone)."""
        groups: frozenset[int] = frozenset()
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Groups:"):
                        groups = frozenset(int(g) for g in line.split()[1:])
                        break
        except (OSError, ValueError):
            pass
        return cls(uid, gid, groups, pid)

    @classmethod
    def of_peer(cls, sock: socket.socket) -> Requester:
        """The process at the other end of a Unix socket, as the kernel
        knows it (its credentials when it connected)."""
        pid, uid, gid = struct.unpack(
            "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 65536)
            groups = frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
        except OSError:  # (kernels before 4.13)
            groups = cls.of_user(uid).groups
        return cls(uid, gid, groups, pid)


def parse_acl(blob: bytes | None) -> list[tuple[int, int, int]] | None:
    """The entries (tag, perm, id) of a POSIX ACL xattr value, or None
    when there is none (or it is not one the kernel would use)."""
    if not blob or len(blob) < _ACL_HEADER.size:
        return None
    (version,) = _ACL_HEADER.unpack_from(blob)
    body = blob[_ACL_HEADER.size :]
    if version != _ACL_VERSION or len(body) % _ACL_ENTRY.size:
        return None
    return [e for e in _ACL_ENTRY.iter_unpack(body)]


def permitted(
    who: Requester,
    mode: int,
    uid: int,
    gid: int,
    want: int,
    acl: Iterable[tuple[int, int, int]] | None = None,
) -> bool:
    """Whether *who* may access an object of *mode*, *uid* and *gid* (and
    POSIX ACL entries *acl*) for *want* (a mask of R, W, X), as the kernel
    decides it (fs/namei.c: generic_permission, acl_permission_check)."""
    if who.root:
        # CAP_DAC_OVERRIDE: all but executing a file no one may execute
        return not (want & X and not stat.S_ISDIR(mode) and not mode & 0o111)
    if who.uid == uid:
        return (mode >> 6) & want == want
    entries = list(acl) if acl is not None else []
    if entries:
        mask = next((perm for tag, perm, _ in entries if tag == ACL_MASK), 7)
        for tag, perm, ident in entries:
            if tag == ACL_USER and ident == who.uid:
                return perm & mask & want == want
        found = False
        for tag, perm, ident in entries:
            if (tag == ACL_GROUP_OBJ and who.in_group(gid)) or (
                tag == ACL_GROUP and who.in_group(ident)
            ):
                if perm & mask & want == want:
                    return True
                found = True
        if found:
            return False
        return mode & want == want
    if who.in_group(gid):
        return (mode >> 3) & want == want
    return mode & want == want


def may_remove(who: Requester, dir_mode: int, dir_uid: int, obj_uid: int) -> bool:
    """The sticky bit's rule on top of write permission: in a sticky
    directory only the object's owner, the directory's owner or root may
    remove or replace a name."""
    return who.root or not dir_mode & stat.S_ISVTX or who.uid in (dir_uid, obj_uid)


def may_set_xattr(who: Requester, name: bytes, owner: int, writable: bool) -> bool:
    """Whether *who* may set or remove xattr *name* (kernel:
    xattr_permission): user.* needs write permission, POSIX ACLs
    ownership; trusted.* and security.* need capabilities."""
    if who.root:
        return True
    if name.startswith(b"user."):
        return writable
    if name.startswith(b"system.posix_acl_"):
        return who.uid == owner
    return False


# -- grants: what the workspace's owner lets other users ask for ---------------------------

# the grants a workspace can give another user (what each lets it ask the
# daemon for is declared with the operations: ``service.operations``)
GRANTS = ("read", "step")
DEFAULT_GRANT = "step"


class BadGrant(ValueError):
    pass


def parse_grant(spec: str) -> dict:
    """``USER[:OPS]`` or ``@GROUP[:OPS]`` (a name or a number; OPS: read,
    step or both, comma-separated; default step) as kept in the store:
    {"user"|"group": id, "name": str, "ops": [...]}."""
    import grp

    who, _, ops_text = spec.partition(":")
    ops = [o.strip() for o in ops_text.split(",")] if ops_text else [DEFAULT_GRANT]
    bad = [o for o in ops if o not in GRANTS]
    if bad or not who or who == "@":
        raise BadGrant(
            f"--allow {spec!r}: expected USER[:OPS] or @GROUP[:OPS], OPS one or more of "
            f"{', '.join(GRANTS)}"
        )
    if who.startswith("@"):
        name = who[1:]
        try:
            gid = int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
        except KeyError:
            raise BadGrant(f"--allow {spec!r}: no group {name!r}") from None
        return {"group": gid, "name": name, "ops": sorted(set(ops))}
    try:
        uid = int(who) if who.isdigit() else pwd.getpwnam(who).pw_uid
    except KeyError:
        raise BadGrant(f"--allow {spec!r}: no user {who!r}") from None
    return {"user": uid, "name": who, "ops": sorted(set(ops))}


def granted(grants: list[dict], who: Requester) -> frozenset[str]:
    """The grants ("read", "step") the workspace's *grants* give *who*."""
    names: set[str] = set()
    for g in grants:
        if g.get("user") == who.uid or ("group" in g and who.in_group(g["group"])):
            names.update(n for n in g.get("ops", ()) if n in GRANTS)
    return frozenset(names)


def describe_grant(g: dict) -> str:
    who = g["name"] if "user" in g else "@" + g["name"]
    return f"{who}:{','.join(g['ops'])}"
