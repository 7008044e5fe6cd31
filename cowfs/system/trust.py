"""Which stores cowfs trusts.

A store tells cowfs what to put back where, and the daemon (usually root)
does it: whoever can write a store can make a rollback give a file to root
and set its setuid bit.  So a store is used only where nobody but the
invoking user and root can have written it, nor swap it for another between
this check and its use (see DESIGN.md, "Threat model"):

* Every directory on the store's path -- from / down to the store
  directory, then its ``db`` and ``grave`` subdirectories -- is owned by the
  invoking user or by root, is no symbolic link (the path is resolved
  first: one found afterwards was put there meanwhile), and is not writable
  by its group or by others.  The group bits are checked whatever the group
  is (a group of one is still a group), and they include an ACL's mask, so
  an ACL that lets anyone else write shows there too.
* One exception, above the store directory only: a directory writable by
  others that is sticky (``/tmp``).  In it only an entry's owner (the
  directory's owner, root) may rename or remove the entry, so the next
  component -- owned by the invoking user or root, as every component must
  be, and checked like them -- cannot be swapped by anyone else.  The store
  directory and its subdirectories get no exception: others could put files
  in them (a ``lock``, a ``data.mdb``) whatever the sticky bit says.
* The store's own files (``lock``, ``db/data.mdb``, ``db/lock.mdb``), where
  they exist: regular files, owned by the invoking user or root, not
  writable by group or others.
* No component lies on a FUSE filesystem mounted by another user (its
  daemon says who owns what), nor inside a mounted cowfs workspace or view:
  what is there was made through a mount, by whoever may write there.

With every component safe, nobody else can rename, replace or write any of
them, so the path found safe stays the path opened.  Refusals are
StoreError (exit code 6), one line naming the path and the reason.
"""

from __future__ import annotations

import os
import stat

from ..errors import StoreError

STORE_SUBDIRS = ("db", "grave")
STORE_FILES = ("lock", "db/data.mdb", "db/lock.mdb")
_COWFS_FSTYPES = ("fuse.cowfs", "fuse.cowfs-view")


def trusted_owners() -> tuple[int, ...]:
    """The owners a store of this process may have: its user and root."""
    uid = os.geteuid()
    return (0,) if uid == 0 else (uid, 0)


def _whom() -> str:
    uid = os.geteuid()
    return "root" if uid == 0 else f"you (uid {uid}) or root"


def _writable(mode: int) -> str | None:
    if mode & stat.S_IWOTH:
        return "others"
    if mode & stat.S_IWGRP:
        return "its group"
    return None


def _fuse_owners(devs: set[int]) -> dict[int, tuple[str, str, int | None]]:
    """For each of *devs* that is a FUSE filesystem: (fstype, mount point,
    the uid that mounted it)."""
    from .mountinfo import mounts

    wanted = {f"{os.major(d)}:{os.minor(d)}": d for d in devs}
    out: dict[int, tuple[str, str, int | None]] = {}
    for m in mounts():
        dev = wanted.get(m.dev)
        if dev is None or not (m.fstype in ("fuse", "fuseblk") or m.fstype.startswith("fuse.")):
            continue
        uid = None
        for opt in m.options.split(","):
            if opt.startswith("user_id="):
                uid = int(opt[len("user_id=") :])
        out[dev] = (m.fstype, m.mountpoint, uid)
    return out


def why_untrusted(store: str, *, whole: bool = True, parent_only: bool = False) -> str | None:
    """Why the store at *store* may not be used (a sentence naming the
    path at fault), or None when it may.  *whole*: also its subdirectories
    and files (those that exist); without it, the directories from / down
    to the store directory only (to find a workspace, before its store is
    opened -- maybe by a user who may not look inside).  *parent_only*: the
    directories down to the store directory's parent (before it is made)."""
    real = os.path.realpath(store)
    owners = trusted_owners()
    parts = [p for p in real.split("/") if p]
    if parent_only:
        parts = parts[:-1]
    dirs = ["/"] + ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]
    last = len(dirs) - 1 if not parent_only else len(dirs)  # the store dir's index
    if whole and not parent_only:
        dirs += [os.path.join(real, sub) for sub in STORE_SUBDIRS]
    devs: dict[int, str] = {}
    for i, d in enumerate(dirs):
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            if i > last:
                continue  # (a subdirectory a store may lack: opening it says so)
            return f"{d} does not exist"
        except OSError as e:
            return f"{d} cannot be examined ({e.strerror})"
        if stat.S_ISLNK(st.st_mode):
            return f"{d} is a symbolic link (it was made one meanwhile)"
        if not stat.S_ISDIR(st.st_mode):
            return f"{d} is not a directory"
        if st.st_uid not in owners:
            return f"{d} is owned by uid {st.st_uid}, not by {_whom()}"
        who = _writable(st.st_mode)
        if who is not None and not (i < last and st.st_mode & stat.S_ISVTX):
            sticky = st.st_mode & stat.S_ISVTX and " (sticky, but the store's own)" or ""
            return f"{d} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}){sticky}"
        devs.setdefault(st.st_dev, d)
    if whole and not parent_only:
        for name in STORE_FILES:
            f = os.path.join(real, name)
            try:
                st = os.lstat(f)
            except FileNotFoundError:
                continue
            except OSError as e:
                return f"{f} cannot be examined ({e.strerror})"
            if not stat.S_ISREG(st.st_mode):
                return f"{f} is not a regular file"
            if st.st_uid not in owners:
                return f"{f} is owned by uid {st.st_uid}, not by {_whom()}"
            who = _writable(st.st_mode)
            if who is not None:
                return f"{f} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    for dev, (fstype, mountpoint, uid) in _fuse_owners(set(devs)).items():
        if fstype in _COWFS_FSTYPES:
            return (
                f"{devs[dev]} lies inside the mounted cowfs workspace at {mountpoint} "
                "(what is there was made through the mount)"
            )
        if uid not in owners:
            return (
                f"{devs[dev]} lies on a FUSE filesystem mounted at {mountpoint} by "
                f"uid {uid}, whose daemon says who owns what"
            )
    return None


def check_store(store: str, *, parent_only: bool = False) -> str:
    """The real path of the store at *store* if it may be used (see the
    module's docstring); StoreError naming the path and the reason if not.
    *parent_only*: before the store directory is made, the directories it
    will be made in."""
    why = why_untrusted(store, parent_only=parent_only)
    if why is not None:
        what = "create a cowfs store in" if parent_only else "use the cowfs store"
        where = os.path.dirname(os.path.abspath(store)) if parent_only else store
        hint = "; give it a safe place with --store DIR" if parent_only else ""
        raise StoreError(f"refusing to {what} {where}: {why}{hint}")
    return os.path.realpath(store)
