"""`cowfs restore`: put some paths back as they were when a layer was
opened, in the daemon, as a change of the open layer.

A restore is carried out through the mount's own operations (``Ops``:
the same code a FUSE request runs), so every change it makes is captured
in the open layer before it is made, exactly as a program's would be --
it can be rolled back, and a crash in the middle leaves a partial restore
that a rollback undoes or a second restore finishes.  Every name is looked
up once, relative to the node of its directory, without following a
symlink; the object found is the object acted on.  While it runs, file
requests wait (the daemon holds them off during a control operation), so
the tree it reads is the tree it changes.

A restore acts with the requester's rights (``access``): it reveals only
what the requester could have read when the layer was opened (search
permission on every directory above, read permission on what is
restored), and makes only the changes the kernel would let the
requester make now (write permission on the directories whose names
change and the files rewritten; owner, group and xattrs as the kernel
allows them).  Everything is checked before anything changes: a restore
the requester may not make is refused whole, naming the path.
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import DAEMON_ERROR, NOT_OWNER, PARTIAL, USAGE, CowfsError, NothingToDo
from ..fuse.inodes import Node
from ..fuse.ops import Ctx, Ops
from ..layers.past import SHOW_PAGE, History, Past, Replaced
from ..system import access, backing
from ..system.access import R, Requester, W, X
from ..text import quote

PAGE = SHOW_PAGE
T = TypeVar("T")


class Denied(CowfsError):
    """The requester may not make (or see) what a restore needs."""

    code = NOT_OWNER


@dataclass
class Invalid:
    """What the kernel may have cached that a restore changed."""

    entries: set[tuple[int, bytes]] = field(default_factory=set)  # (parent ino, name)
    inodes: set[int] = field(default_factory=set)


def _show(path: bytes) -> str:
    return quote(path) or "."


def _join(parent: bytes, name: bytes) -> bytes:
    return parent + b"/" + name if parent else name


class Restore:
    """One restore of paths from the history *h* (the layer opened at T),
    on the tree that *ops* serves, for *who*: ``run``, then ``close``.

    The history is kept exact while the restore changes the tree: each
    change is recorded in the open layer before it is made, and those
    records are read into the history at once (``_do``), so an object the
    restore moves out of the way (into the grave) is still found where it
    went, and one it writes to still reads as it was at T."""

    def __init__(self, ops: Ops, h: History, who: Requester):
        self.ops = ops
        self.h = h
        self.who = who
        self.ctx = Ctx(who.pid, who.uid, who.gid, 0)
        self.dry = True
        self.done: list[str] = []
        self.invalid = Invalid()
        self._held: Counter[int] = Counter()  # lookups this restore holds
        self._linked: dict[int, Node | None] = {}  # object at T -> its first name restored
        self._noted: set[str] = set()
        self._dirs: set[int] = set()  # directories whose entries changed
        self._seq = h.store.next_seq  # records read into the history so far

    # -- the whole run -----------------------------------------------------------------

    def paths(self, rels: list[bytes]) -> None:
        """Every path names something, now or then (checked before anything
        changes)."""
        for rel in rels:
            if self._now(rel) is None and self.h.object_at(rel) is None:
                raise NothingToDo(
                    f"no such path, now or when layer {self.h.layer} was opened; nothing restored",
                    path=os.fsdecode(rel) or ".",
                )

    def run(self, rels: list[bytes], attrs_only: Sequence[bytes] = ()) -> list[str]:
        """Check everything (nothing changes), then restore; the paths
        changed.  *attrs_only*: paths whose attributes alone are
        restored (not their entries)."""
        self.paths(rels)
        for dry in (True, False):
            self.dry = dry
            self._linked = {}
            for rel in rels:
                parent = self._parents(rel)
                self._restore(parent, rel)
            for rel in attrs_only:
                found, obj = self._now(rel), self._then(rel)
                if found is not None and obj is not None:
                    self._attrs(found, rel, obj, found)
        return self.done

    def _do(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """One change of the tree, as the requester, through the mount's
        operations (captured first); the history reads what was recorded."""
        try:
            return fn(*args, ctx=self.ctx, **kw)
        finally:
            end = self.h.store.next_seq
            if end != self._seq:
                self.h.j.feed(self.h.store.records(self._seq, end))
                self._seq = end

    def _then(self, rel: bytes) -> Past | None:
        return self.h.object_at(rel)

    def close(self) -> None:
        """Let go of the nodes this restore looked up (the kernel's own
        lookups stay); every name in a directory whose entries it changed
        is for the kernel to look up again.  (Not only the names it
        changed: a rename of another name there, waiting meanwhile, was
        sent with what the kernel had cached -- an exchange with a name
        restored swaps the kernel's idea of both -- and it is answered
        before these notices, which wait for the directory it holds.)"""
        for parent in list(self._dirs):
            try:
                names = self.ops.names(parent)
            except OSError:
                continue
            self.invalid.entries.update((parent, name) for name in names)
        self.ops.forget(list(self._held.items()))
        self._held.clear()

    # -- looking things up ---------------------------------------------------------------

    def _lookup(self, parent: Node, name: bytes) -> tuple[Node, os.stat_result] | None:
        try:
            node, st = self.ops.lookup(parent.ino, name, ctx=self.ctx)
        except (FileNotFoundError, NotADirectoryError):
            return None
        self._held[node.ino] += 1
        return node, st

    def _now(self, rel: bytes) -> tuple[Node, os.stat_result] | None:
        """The object at *rel* now, walking directories only (each one
        searchable by the requester)."""
        node: Node = self.ops.root
        st = os.stat(node.fd)
        for comp in rel.split(b"/") if rel else []:
            if not stat.S_ISDIR(st.st_mode):
                return None
            self._may_now(node, st, X, f"{_show(rel)}: cannot reach it")
            found = self._lookup(node, comp)
            if found is None:
                return None
            node, st = found
        return node, st

    # -- permissions ------------------------------------------------------------------------

    def _acl_now(self, node: Node) -> list | None:
        if self.who.root or node.islnk:
            return None
        try:
            return access.parse_acl(os.getxattr(f"/proc/self/fd/{node.fd}", access.ACL_ACCESS))
        except OSError:
            return None

    def _may_now(self, node: Node | None, st: os.stat_result | None, want: int, what: str) -> None:
        """*node* (None: made by this restore, so the requester's) may be
        accessed for *want* now."""
        if node is None or st is None or self.who.root:
            return
        if not access.permitted(
            self.who, st.st_mode, st.st_uid, st.st_gid, want, self._acl_now(node)
        ):
            raise Denied(f"{what}: permission denied; nothing restored")

    def _may_remove(
        self, dnode: Node | None, dst: os.stat_result | None, obj: os.stat_result, rel: bytes
    ) -> None:
        if dnode is None or dst is None or self.who.root:
            return
        self._may_now(dnode, dst, W | X, f"{_show(rel)}: cannot change its directory")
        if not access.may_remove(self.who, dst.st_mode, dst.st_uid, obj.st_uid):
            raise Denied(
                f"{_show(rel)}: the sticky bit of its directory keeps it; nothing restored"
            )

    def _may_read_past(self, rel: bytes) -> None:
        """The requester could have read what *rel* held when the layer was
        opened: searched every directory above it, read it."""
        if self.who.root or not self.dry:  # (checked by the dry run)
            return
        if not self.h.readable(rel, self.who):
            raise Denied(
                f"{_show(rel)}: not yours to read as it was when layer "
                f"{self.h.layer} was opened; nothing restored"
            )

    # -- changing the tree (each a request of the mount's operations) -----------------------

    def _changed(self, parent: Node, name: bytes, rel: bytes) -> None:
        self._dirs.add(parent.ino)
        self.invalid.entries.add((parent.ino, name))
        self.invalid.inodes.add(parent.ino)
        self._note(rel)

    def _note(self, rel: bytes) -> None:
        """*rel* changed (listed once, in the order first changed)."""
        path = os.fsdecode(rel)
        if path not in self._noted:
            self._noted.add(path)
            self.done.append(path)

    def _remove(
        self,
        parent: Node | None,
        pst: os.stat_result | None,
        name: bytes,
        rel: bytes,
        node: Node,
        st: os.stat_result,
    ) -> None:
        """Remove what is at *rel* (a whole subtree)."""
        _run(self._removing(parent, pst, name, rel, node, st))

    def _removing(
        self,
        parent: Node | None,
        pst: os.stat_result | None,
        name: bytes,
        rel: bytes,
        node: Node,
        st: os.stat_result,
    ) -> Steps:
        """``_remove``, each directory below yielded as its own steps."""
        _not_too_long(rel)
        self._may_remove(parent, pst, st, rel)
        if stat.S_ISDIR(st.st_mode):
            self._may_now(node, st, R | W | X, f"{_show(rel)}: cannot empty it")
            for child in self.ops.names(node.ino):
                found = self._lookup(node, child)
                if found is not None:
                    yield self._removing(node, st, child, _join(rel, child), *found)
        if self.dry:
            return
        assert parent is not None  # (made by this restore: nothing to remove)
        self._do(self.ops.rmdir if stat.S_ISDIR(st.st_mode) else self.ops.unlink, parent.ino, name)
        self._changed(parent, name, rel)

    def _parents(self, rel: bytes) -> Node | None:
        """The directory *rel* goes into, made again (empty, with its
        attributes then) where it is missing or not a directory now;
        None when this run, being a dry one, would have made it."""
        node: Node | None = self.ops.root
        st: os.stat_result | None = os.stat(self.ops.root.fd)
        comps = rel.split(b"/")[:-1]
        for i, name in enumerate(comps):
            here = b"/".join(comps[: i + 1])
            self._may_now(node, st, X, f"{_show(rel)}: cannot reach it")
            found = self._lookup(node, name) if node is not None else None
            if found is not None and stat.S_ISDIR(found[1].st_mode):
                node, st = found
                continue
            obj = self._then(here)
            if obj is None or not stat.S_ISDIR(obj.mode):
                raise CowfsError(
                    f"{_show(here)} was not a directory when layer {self.h.layer} "
                    "was opened; nothing restored",
                    USAGE,
                )
            self._may_read_past(here)
            if found is not None:
                self._remove(node, st, name, here, *found)
                obj = self._then(here) or obj
            made = self._make(node, st, name, here, obj)
            self._attrs(made, here, obj, None)
            node, st = made if made is not None else (None, None)
        return node

    def _make(
        self,
        parent: Node | None,
        pst: os.stat_result | None,
        name: bytes,
        rel: bytes,
        obj: Past,
    ) -> tuple[Node, os.stat_result] | None:
        """Make a new object of *obj*'s kind at *rel* (a file: empty)."""
        self._may_now(parent, pst, W | X, f"{_show(rel)}: cannot make it in its directory")
        kind = obj.kind
        if kind in (stat.S_IFCHR, stat.S_IFBLK) and not self.who.root:
            raise Denied(f"{_show(rel)}: only root may make a device; nothing restored")
        if kind not in (
            stat.S_IFREG,
            stat.S_IFDIR,
            stat.S_IFLNK,
            stat.S_IFIFO,
            stat.S_IFSOCK,
            stat.S_IFCHR,
            stat.S_IFBLK,
        ):
            raise CowfsError(f"{_show(rel)}: an object of this kind cannot be restored", USAGE)
        if self.dry or parent is None:
            return None
        if kind == stat.S_IFREG:
            fh, _, node, st = self._do(
                self.ops.create, parent.ino, name, 0o600, os.O_WRONLY | os.O_CREAT | os.O_EXCL
            )
            self.ops.release(fh)
        elif kind == stat.S_IFDIR:
            node, st = self._do(self.ops.mkdir, parent.ino, name, 0o700)
        elif kind == stat.S_IFLNK:
            node, st = self._do(self.ops.symlink, parent.ino, name, self.h.readlink(obj))
        else:
            rdev = obj.now.st_rdev if kind in (stat.S_IFCHR, stat.S_IFBLK) else 0
            node, st = self._do(self.ops.mknod, parent.ino, name, kind | 0o600, rdev)
        self._held[node.ino] += 1
        self._changed(parent, name, rel)
        return node, st

    def _restore(self, parent: Node | None, rel: bytes) -> None:
        """Put *rel* (in directory *parent*; None: one this dry run would
        have made) back as it was at T."""
        _run(self._restoring(parent, rel))

    def _restoring(self, parent: Node | None, rel: bytes) -> Steps:
        """``_restore``, each name of a directory yielded as its own steps
        (however deep the tree: no recursion)."""
        _not_too_long(rel)
        name = rel.rpartition(b"/")[2]
        pst = os.stat(parent.fd) if parent is not None else None
        self._may_now(parent, pst, X, f"{_show(rel)}: cannot reach it")
        found = self._lookup(parent, name) if parent is not None else None
        obj = self._then(rel)
        if obj is None:  # made after T: it goes
            if found is not None:
                self._remove(parent, pst, name, rel, *found)
            return
        self._may_read_past(rel)
        if not stat.S_ISDIR(obj.mode) and obj.ino in self._linked:
            # another name of an object restored already: linked again
            first = self._linked[obj.ino]
            if found is not None:
                self._remove(parent, pst, name, rel, *found)
            self._may_now(parent, pst, W | X, f"{_show(rel)}: cannot make it in its directory")
            if not self.dry and parent is not None and first is not None:
                node, _ = self._do(self.ops.link, first.ino, parent.ino, name)
                self._held[node.ino] += 1
                self._changed(parent, name, rel)
            return
        if found is not None:
            node, st = found
            shared = (
                stat.S_ISREG(st.st_mode)
                and self.ops.nlink(node, st) > 1
                and not self._as_then(node, st, obj)
            )
            if stat.S_IFMT(st.st_mode) != obj.kind or shared:
                # (a name that shares its object with others is replaced,
                # never written through)
                self._remove(parent, pst, name, rel, node, st)
                found = None
            elif obj.kind == stat.S_IFLNK and self.h.readlink(obj) != os.readlink(
                b"", dir_fd=node.fd
            ):
                self._remove(parent, pst, name, rel, node, st)
                found = None
            elif obj.kind in (stat.S_IFCHR, stat.S_IFBLK) and st.st_rdev != obj.now.st_rdev:
                self._remove(parent, pst, name, rel, node, st)
                found = None
        made = found is None
        if made and not self.dry:
            obj = self._then(rel) or obj  # (it may have been moved out of the way)
        if made:
            found = self._make(parent, pst, name, rel, obj)
        if obj.kind == stat.S_IFREG:
            self._content(found, rel, obj, made)
        elif obj.kind == stat.S_IFDIR:
            yield from self._entries(found, rel, obj)
        self._attrs(found, rel, obj, None if made else found)
        if not stat.S_ISDIR(obj.mode):
            self._linked[obj.ino] = found[0] if found is not None else None

    def _as_then(self, node: Node, st: os.stat_result, obj: Past) -> bool:
        """Whether the file at a name is the very object it held at T, in
        every respect as it was then (then it stays, whatever other names
        it has now)."""
        return (
            st.st_ino == obj.ino
            and obj.live_bytes
            and st.st_size == obj.size
            and (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns)
            == (obj.mode, obj.uid, obj.gid, obj.mtime_ns)
            and dict(self._xattrs_now(node)) == dict(self.h.xattrs_of(obj))
        )

    def _entries(self, found: tuple[Node, os.stat_result] | None, rel: bytes, obj: Past) -> Steps:
        """A directory's names as they were: what was not there goes, what
        was is restored."""
        wanted = self.h.listdir(obj)
        if found is not None:
            node, st = found
            keep = set(wanted)
            for name in self.ops.names(node.ino):
                if name in keep:
                    continue
                child = self._lookup(node, name)
                if child is not None:
                    self._remove(node, st, name, _join(rel, name), *child)
        for name in wanted:
            yield self._restoring(found[0] if found is not None else None, _join(rel, name))

    def _content(
        self, found: tuple[Node, os.stat_result] | None, rel: bytes, obj: Past, made: bool
    ) -> None:
        """A file's bytes as they were.  The very object it held then needs
        only the chunks recorded since, and its size -- and, where it was
        cut below that size since (``Past.low``), holes again where it holds
        data no record kept; another one gets every range that holds data
        (holes stay holes).  What is read of the past is read through one
        descriptor of the object the history found, checked to be it
        (``History.opened``)."""
        node, st = found if found is not None else (None, None)
        same = st is not None and st.st_ino == obj.ino and not made
        if same and obj.live_bytes and st is not None and st.st_size == obj.size:
            return
        if not made:
            self._may_now(node, st, W, f"{_show(rel)}: cannot write it")
        if self.dry or node is None:
            return
        assert st is not None
        C = self.h.store.chunk_size
        with self.h.opened(obj) as past:
            if same:
                ranges = [
                    (k * C, min(obj.size, k * C + C))
                    for k in sorted(obj.chunks.one)
                    if k * C < obj.size
                ]
            else:
                ranges = self._data_ranges(obj, past)
            fh, _ = self.ops.open(node.ino, os.O_WRONLY, ctx=self.ctx)
            try:
                size = st.st_size
                if not same and size:  # (another object's bytes all go)
                    self._do(self.ops.setattr, node.ino, fh, size=0)
                    size = 0
                if size != obj.size:
                    self._do(self.ops.setattr, node.ino, fh, size=obj.size)
                # (ranges of zeros: what the file holds there now is punched
                # out, never written as zeros -- they may span TiBs; found at
                # its size then, so that data that ended the file now is
                # punched to its block's end, not zeroed in its block)
                zeros = _live_data(past, _holes_then(obj)) if same else []
                for lo, hi in zeros:
                    self._do(
                        self.ops.fallocate,
                        fh,
                        lo,
                        hi - lo,
                        backing.FALLOC_FL_PUNCH_HOLE | backing.FALLOC_FL_KEEP_SIZE,
                    )
                for lo, hi in ranges:
                    for off in range(lo, hi, PAGE):
                        data = self.h.read(obj, off, min(PAGE, hi - off), fd=past)
                        if not same and not data.strip(b"\0"):
                            continue  # (zeros: the hole there reads the same)
                        self._do(self.ops.write, fh, off, data)
            finally:
                self.ops.release(fh)
        self.invalid.inodes.add(node.ino)
        self._note(rel)

    def _data_ranges(self, obj: Past, fd: int) -> list[tuple[int, int]]:
        """Where *obj*'s bytes at T may be other than zero: the ranges of its
        live object (open at *fd*) that hold data below the size it was cut
        to since, if it was, and the chunks recorded since (a range of
        zeros recorded reads as zeros)."""
        C = self.h.store.chunk_size
        spans = [(k * C, min(obj.size, k * C + C)) for k in obj.chunks.one if k * C < obj.size]
        spans += backing.data_ranges(fd, obj.size if obj.low is None else min(obj.size, obj.low))
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(spans):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        return merged

    def _attrs(
        self,
        found: tuple[Node, os.stat_result] | None,
        rel: bytes,
        obj: Past,
        before: tuple[Node, os.stat_result] | None,
    ) -> None:
        """Owner, mode, xattrs and times as they were (times last, so that
        nothing after them moves them); only what differs is changed.
        *before*: the object as it was found (None: made by this restore)."""
        mine = before is None  # (made now: the requester owns it)
        if found is None:  # (a dry run's new object: owned by the requester)
            st_uid, st_gid = self.who.uid, self.who.gid
            node = None
            st = None
        else:
            node, _ = found
            st = os.stat(node.fd)
            st_uid, st_gid = st.st_uid, st.st_gid
        where = _show(rel)
        owner = mine or st_uid == self.who.uid
        link = obj.kind == stat.S_IFLNK
        if (obj.uid, obj.gid) != (st_uid, st_gid) and not self.who.root:
            if obj.uid != st_uid:
                raise Denied(
                    f"{where}: belonged to uid {obj.uid}; only root may give it back; "
                    "nothing restored"
                )
            if not (owner and self.who.in_group(obj.gid)):
                raise Denied(f"{where}: cannot give it group {obj.gid}; nothing restored")
        want_mode = stat.S_IMODE(obj.mode)
        if not link and not owner and not self.who.root:
            if st is None or stat.S_IMODE(st.st_mode) != want_mode:
                raise Denied(f"{where}: not its owner, cannot set its mode; nothing restored")
        xattrs = [] if link else self.h.xattrs_of(obj)
        now_x = [] if link or node is None else self._xattrs_now(node)
        if not self.who.root and dict(xattrs) != dict(now_x):
            writable = mine or (
                st is not None
                and node is not None
                and access.permitted(
                    self.who, st.st_mode, st.st_uid, st.st_gid, W, self._acl_now(node)
                )
            )
            for name in set(dict(xattrs)) ^ set(dict(now_x)) | {
                n for n, v in xattrs if dict(now_x).get(n, v) != v
            }:
                if not access.may_set_xattr(self.who, name, obj.uid, writable):
                    raise Denied(f"{where}: cannot set its xattr {name!r}; nothing restored")
        if not link and not owner and not self.who.root:
            if st is None or st.st_mtime_ns != obj.mtime_ns:
                raise Denied(f"{where}: not its owner, cannot set its times; nothing restored")
        if self.dry or node is None or st is None:
            return
        changed = False
        if (obj.uid, obj.gid) != (st.st_uid, st.st_gid):
            self._do(self.ops.setattr, node.ino, None, uid=obj.uid, gid=obj.gid)
            changed = True
        st = os.stat(node.fd)  # (a chown drops setuid and setgid)
        if not link and stat.S_IMODE(st.st_mode) != want_mode:
            self._do(self.ops.setattr, node.ino, None, mode=want_mode)
            changed = True
        if dict(xattrs) != dict(now_x):
            wanted = dict(xattrs)
            for name in dict(now_x):
                if name not in wanted:
                    self._do(self.ops.removexattr, node.ino, name)
            for name, value in xattrs:
                if dict(now_x).get(name) != value:
                    self._do(self.ops.setxattr, node.ino, name, value)
            changed = True
        st = os.stat(node.fd)
        # (the atime alone is no reason: reading the tree moves it)
        if st.st_mtime_ns != obj.mtime_ns or changed or mine:
            self._do(self.ops.setattr, node.ino, None, atime_ns=obj.atime_ns, mtime_ns=obj.mtime_ns)
            changed = True
        if changed:
            self.invalid.inodes.add(node.ino)
            self._note(rel)

    def _xattrs_now(self, node: Node) -> list[tuple[bytes, bytes]]:
        return [
            (name, self.ops.getxattr(node.ino, name, ctx=self.ctx))
            for name in self.ops.listxattr(node.ino, ctx=self.ctx)
        ]


def _so_far(r: Restore) -> str:
    if r.done:
        return (
            " (what it restored so far is a change of the open layer: roll it "
            "back, or restore again)"
        )
    return "; nothing restored"


def _holes_then(obj: Past) -> list[tuple[int, int]]:
    """The ranges, in order, where *obj* (a regular file) was a hole at T
    though its live object may hold data there: those recorded as zeros,
    and where it was cut below its size at T since, what past the cut no
    record holds."""
    out = list(obj.chunks.zero_spans(obj.size))
    if obj.low is not None and obj.low < obj.size:
        pos = obj.low
        for lo, hi in obj.chunks.spans(obj.size):
            if hi <= pos:
                continue
            if lo > pos:
                out.append((pos, lo))
            pos = hi
        if pos < obj.size:
            out.append((pos, obj.size))
        out.sort()
    return out


def _live_data(fd: int, within: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the ranges *within* (in order) where the file open at
    *fd* holds data (SEEK_DATA: what it holds, not their size)."""
    out: list[tuple[int, int]] = []
    for lo, hi in within:
        pos = lo
        while pos < hi:
            found = backing.next_data(fd, pos, hi)
            if found is None:
                break
            out.append(found)
            pos = found[1]
    return out


def restore(ops: Ops, h: History, who: Requester, rels: list[bytes]) -> tuple[list[str], Invalid]:
    """Restore *rels* (workspace paths, b"" never) from *h* for *who*: the
    paths changed, and what the kernel may have cached of them."""
    if not all(rels):
        raise CowfsError(
            "restore takes paths inside the workspace; to put back everything, use rollback",
            USAGE,
        )
    r = Restore(ops, h, who)
    try:
        done = r.run(rels)
    except OSError as e:
        what = f": {quote(e.filename)}" if isinstance(e.filename, str | bytes) else ""
        raise CowfsError(
            f"restore failed{what}: {e.strerror or e}" + _so_far(r),
            PARTIAL if r.done else DAEMON_ERROR,
        ) from None
    except Replaced as e:  # (what it read of the past went meanwhile)
        raise CowfsError(
            f"restore failed: {e}" + _so_far(r), PARTIAL if r.done else e.code
        ) from None
    finally:
        r.close()
    return done, r.invalid


# The steps of a restore or a removal of a tree: a generator that yields
# the steps of each name below it, taken whole before it goes on (as
# calls would, without a frame a level).
Steps = Generator["Steps", None, None]


def _run(steps: Steps) -> None:
    stack = [steps]
    try:
        while stack:
            try:
                below = next(stack[-1])
            except StopIteration:
                stack.pop()
                continue
            stack.append(below)
    except BaseException:
        for pending in reversed(stack):  # (their finally blocks, innermost first)
            pending.close()
        raise


# The longest path a restore walks to: twice PATH_MAX.  Each level of a
# tree is held by its whole path while the levels below it are walked, and
# looked up from the top: a deeper tree (an agent's, of long names) would
# cost memory and time in the square of its depth, every request waiting.
MAX_PATH = 8192


def _not_too_long(rel: bytes) -> None:
    if len(rel) > MAX_PATH:
        raise CowfsError(
            f"{_show(rel[:200])}...: a path longer than {MAX_PATH} bytes; nothing restored",
            USAGE,
        )
