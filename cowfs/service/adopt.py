"""`cowfs adopt NAME`: a fork's net changes since its fork point, applied to
its workspace as one new layer, and the fork dropped.

What the fork changed is ``forkdiff.changes`` (its overlay's upper layer,
compared with the fork point); what the workspace changed since the fork
point is its own net changes from the fork point's journal position.  A
path changed on both sides is a conflict -- the same path, or one below a
path the other side removed, replaced by another kind of object or moved
away; a change of the modification time alone conflicts with nothing.
Without a choice (``prefer``: "fork" or "parent", for every conflict or
path by path) any conflict refuses the adopt, naming each, and nothing
changes.

The changes are made as a restore makes them (cowfs/service/restore.py:
through the mount's own operations, each captured in the open layer
before it is made, every name looked up once, no symlink followed), with
the fork as the source instead of a layer's start: a path the fork
removed is removed, a path it added, replaced or rewrote is made as the
fork has it (a directory it added with everything in it), a path whose
attributes alone it changed gets those.  So an adopt is one layer like
any other: a rollback undoes it, redo does it again.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from typing import Any

from .. import errors
from ..errors import CowfsError
from ..layers.past import Past
from ..storage.store import Store
from ..system import backing
from ..system.access import Requester
from ..text import quote
from . import forkdiff


class Conflicts(CowfsError):
    """Paths changed both in the fork and in its workspace since the fork point."""

    code = errors.CONFLICT

    def __init__(self, name: str, conflicts: list[dict]):
        shown = ", ".join(
            f"{quote(c['path'])} (fork: {c['fork']}, workspace: {c['parent']})"
            for c in conflicts[:10]
        ) + (f" and {len(conflicts) - 10} more" if len(conflicts) > 10 else "")
        super().__init__(
            f"fork {name} and the workspace both changed {len(conflicts)} path"
            f"{'s' if len(conflicts) > 1 else ''} since the fork point: {shown}; "
            "choose with --prefer fork|parent (or --prefer PATH=fork|parent); nothing was changed"
        )
        self.details = {"conflicts": conflicts}


def _ancestors(path: str) -> Iterator[str]:
    while "/" in path:
        path = path.rpartition("/")[0]
        yield path


def _theirs(parent: list[dict]) -> tuple[dict[str, str], set[str]]:
    """The workspace's changes (mtimes alone left out), path -> kind; and
    the paths it removed, replaced or moved away."""
    theirs: dict[str, str] = {}
    gone: set[str] = set()
    for c in parent:
        if c["kind"] == "t":
            continue
        theirs[c["path"]] = c["kind"]
        if c["kind"] in ("D", "T"):
            gone.add(c["path"])
        if c["kind"] == "R" and c.get("from"):
            theirs[c["from"]] = "R"
            gone.add(c["from"])
    return theirs, gone


def yielded(fork: list[forkdiff.Change], parent: list[dict]) -> set[bytes]:
    """The paths whose modification time alone the fork changed where the
    workspace changed more (the path itself, or a directory above it that
    it removed, replaced or moved away): the workspace's change stands.  (A
    change of the time alone conflicts with nothing, so it must not be made
    either: making it makes the path as the fork has it -- the fork point's
    bytes, mode and xattrs, or the path itself where the workspace removed
    it.)"""
    theirs, gone = _theirs(parent)
    return {
        c.path
        for c in fork
        if c.kind == "t"
        and ((p := os.fsdecode(c.path)) in theirs or any(a in gone for a in _ancestors(p)))
    }


def conflicts(fork: list[forkdiff.Change], parent: list[dict]) -> list[dict]:
    """The paths both sides changed (see the module's docstring), in path
    order, each with what each side did."""
    theirs, gone = _theirs(parent)  # (gone: removed, replaced or moved away)
    mine = {os.fsdecode(c.path): c.kind for c in fork if c.kind != "t"}
    mine_gone = {p for p, k in mine.items() if k in ("D", "T")}
    out = {}
    for path, kind in mine.items():
        other = theirs.get(path)
        if other is None:
            above = next((a for a in _ancestors(path) if a in gone), None)
            if above is not None:
                other = f"{theirs[above]} {above}"
        if other is None and kind in ("D", "T"):
            below = next((p for p in theirs if p.startswith(path + "/")), None)
            if below is not None:
                other = f"{theirs[below]} {below}"
        if other is not None:
            out[path] = {"path": path, "fork": kind, "parent": other}
    for path, kind in theirs.items():  # (the workspace's, below what the fork removed)
        above = next((a for a in _ancestors(path) if a in mine_gone), None)
        if above is not None and path not in out and above not in out:
            out[above] = {"path": above, "fork": mine[above], "parent": f"{kind} {path}"}
    return [out[p] for p in sorted(out)]


class ForkSource:
    """The fork's tree as a restore's source (what ``History`` is to a
    restore of a layer's start): every object as the fork holds it now,
    read through *root*, a descriptor of the fork's root directory."""

    def __init__(self, store: Store, root: int, name: str):
        self.store = store  # (the workspace's: a restore reads its records as it goes)
        self.root = root
        self.layer = f"fork {name}"  # (how the restore's messages name the source)
        self.j = _NoReading()
        self._dirs: dict[bytes, int] = {}
        # (the fork is quiet while it is adopted: each path is looked up
        # once, and the object last held stays held for the next question
        # of it -- its bytes, its xattrs)
        self._found: dict[bytes, Past | None] = {}
        self._last: tuple[bytes, int, int, os.stat_result] | None = None

    def close(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()
        self._let_go()

    def _let_go(self) -> None:
        if self._last is not None:
            os.close(self._last[2])
            self._last = None

    def _dir(self, rel: bytes) -> int:
        fd = self._dirs.get(rel)
        if fd is None:
            fd = backing.open_dir(self.root, rel) if rel else os.dup(self.root)
            self._dirs[rel] = fd
        return fd

    def object_at(self, rel: bytes) -> Past | None:
        if rel in self._found:
            return self._found[rel]
        head, name = backing.split(rel)
        try:
            st = backing.lstat_at(self._dir(head), name) if name else os.fstat(self.root)
        except OSError:
            st = None
        found = None if st is None else Past(rel, st.st_ino, rel, st)
        self._found[rel] = found
        return found

    def readable(self, rel: bytes, who: Requester) -> bool:
        return True  # (adopt is the owner's or root's)

    @contextlib.contextmanager
    def held(self, obj: Past) -> Iterator[tuple[int, os.stat_result]]:
        """An O_PATH descriptor of *obj*, checked to be it."""
        last = self._last
        if last is not None and last[:2] == (obj.loc, obj.ino):
            yield last[2], last[3]
            return
        self._let_go()
        head, name = backing.split(obj.loc)
        fd = (
            os.open(name, backing.PATH_FLAGS, dir_fd=self._dir(head)) if name else os.dup(self.root)
        )
        try:
            st = os.fstat(fd)
            if (st.st_ino, stat.S_IFMT(st.st_mode)) != (obj.ino, obj.kind):
                raise CowfsError(
                    f"{quote(obj.path)}: changed in the fork while it was adopted",
                    errors.DAEMON_ERROR,
                )
        except BaseException:
            os.close(fd)
            raise
        self._last = (obj.loc, obj.ino, fd, st)
        yield fd, st

    @contextlib.contextmanager
    def opened(self, obj: Past, flags: int = os.O_RDONLY | os.O_CLOEXEC) -> Iterator[int]:
        with self.held(obj) as (pfd, _):
            fd = os.open(backing.proc(pfd), flags)
        try:
            yield fd
        finally:
            os.close(fd)

    def read(
        self, obj: Past, offset: int = 0, size: int | None = None, fd: int | None = None
    ) -> bytes:
        end = obj.size if size is None else min(obj.size, offset + size)
        if offset >= end:
            return b""
        if fd is None:
            with self.opened(obj) as fd:
                data = os.pread(fd, end - offset, offset)
        else:
            data = os.pread(fd, end - offset, offset)
        return data.ljust(end - offset, b"\0")

    def readlink(self, obj: Past) -> bytes:
        with self.held(obj) as (fd, _):
            return os.readlink(b"", dir_fd=fd)

    def xattrs_of(self, obj: Past) -> list[tuple[bytes, bytes]]:
        with self.held(obj) as (fd, _):
            return [
                (k, v)
                for k, v in backing.list_xattrs(backing.proc(fd), True)
                if not k.startswith(forkdiff.OVERLAY)
            ]

    def listdir(self, obj: Past) -> list[bytes]:
        with self.opened(obj, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) as fd:
            with os.scandir(fd) as it:
                names = sorted(os.fsencode(e.name) for e in it)
        if obj.path == b"":
            names = [n for n in names if n != forkdiff.STORE]
        return names


class _NoReading:
    """(A restore feeds its source the records it writes: a fork needs none.)"""

    def feed(self, records: Any) -> int:
        return 0


def plan(changes: list[forkdiff.Change]) -> tuple[list[bytes], list[bytes]]:
    """What to make as the fork has it (a directory the fork added or put
    in place of another object: with everything in it), and the paths
    whose attributes alone to set (directories, and objects whose
    modification time alone the fork changed)."""
    whole: list[bytes] = []
    attrs: list[bytes] = []
    covered: set[bytes] = set()
    for c in sorted(changes, key=lambda c: c.path):
        if any(c.path.startswith(d + b"/") for d in covered):
            continue
        if c.kind == "t" or (c.kind == "m" and _is_dir(c)):
            # (a time alone: set on what the workspace holds there, if
            # anything -- never the fork point's bytes made again)
            attrs.append(c.path)
            continue
        whole.append(c.path)
        if c.kind in ("A", "T", "D"):
            covered.add(c.path)
    return whole, attrs


def _is_dir(c: forkdiff.Change) -> bool:
    return c.is_dir
