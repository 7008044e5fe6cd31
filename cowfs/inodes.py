"""The inode table's pieces: kernel-visible nodes, open file and directory
handles, and the bounded cache of O_PATH fds the nodes keep on their
backing objects.  Engine-neutral (see ``ops``)."""

from __future__ import annotations

import errno
import os
import resource
import stat
from collections import OrderedDict
from collections.abc import Callable

from . import backing as B

ROOT = 1  # the root's inode number in every FUSE protocol
DEAD = -(1 << 62)  # the lookup count of a node dropped from the table


# the modes nodes have, each held once (a table of many files holds few)
_MODES: dict[int, int] = {}


class Node:
    """A kernel-visible inode: our inode number, the backing object's inode
    number, the names we know it by (parent node + name), and an O_PATH fd
    on the object, held in a bounded cache (``FdCache``) and reopened from a
    name when it was evicted."""

    __slots__ = (
        "ino",
        "bino",
        "_fd",
        "nopen",
        "nlookup",
        "parent",
        "name",
        "mode",
        "nocap",
        "noxattr",
        "pt",
    )
    cache: FdCache

    def __init__(self, ino: int, bino: int, fd: int, mode: int):
        self.ino = ino
        self.bino = bino
        self._fd = fd
        self.nopen = 0
        self.mode = _MODES.setdefault(mode, mode)  # (one int object per mode)
        self.nlookup = 0
        self.parent: Node | None = None
        self.name = b""  # (its other names, if it has hard links: ``Ops.links``)
        self.nocap = False  # known to have no security.capability
        # known to have no xattrs at all (True), to have some (False), or not
        self.noxattr: bool | None = None
        # open files served by the kernel from the backing file (passthrough:
        # how many) or, as a negative count, through the daemon -- never
        # both (the kernel refuses a mix).  (Rarer state is held apart, not
        # in a node each: the writable passthrough opens, in
        # ``Ops.pt_writers``; the engine's id for the backing file, in its
        # table.)
        self.pt = 0

    @property
    def fd(self) -> int:
        """An O_PATH fd on the object (opened again if it was evicted)."""
        if self._fd >= 0:
            lru = self.cache.lru
            if self in lru:
                lru.move_to_end(self)
            return self._fd
        return self.cache.reopen(self)

    @property
    def live(self) -> bool:
        """Still in the table (``Ops._drop`` marks it DEAD)."""
        return self.nlookup >= 0

    @property
    def isdir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def islnk(self) -> bool:
        return stat.S_ISLNK(self.mode)


class Handle:
    """An open file: the node, and an fd on the backing file opened with
    *flags* -- held in the node's cache like the nodes' own fds: -1 when it
    was evicted, opened again (through the node's fd, without O_TRUNC) by
    the next request that uses the handle (``FdCache.using``)."""

    __slots__ = ("node", "fd", "flags", "writable", "who", "passthrough", "counted")

    def __init__(
        self, node: Node, fd: int, flags: int, writable: bool, who: tuple[int, int] | None
    ):
        self.node = node
        self.fd = fd
        self.flags = flags & ~(os.O_TRUNC | os.O_CREAT | os.O_EXCL)
        self.writable = writable
        self.who = who  # the process that opened it (writes carry no caller)
        self.passthrough = False
        self.counted = False  # in its node's pt or cached count


class FdCache:
    """The daemon's descriptors on backing objects -- the nodes' O_PATH fds
    and the open files' fds -- at most *cap* of them, so that a program
    holding many files open cannot take the descriptors every other request
    and the control channel need (the rest of the daemon's limit is their
    reserve).  Past the cap, the oldest is closed: nodes' fds least recently
    used first, open files' fds in the order they were opened (no touch per
    read or write); each is opened again when next needed -- a node's by a
    name that still leads to it, an open file's through its node.

    An open file whose object has no name left (unlinked, O_TMPFILE) cannot
    be reopened: its node's fd is *pinned* (never evicted) while it is
    open, counted against the user whose request left it nameless; a user
    who holds its share of them is refused more (EMFILE), no one else.

    An open file's fd is never closed in the middle of the request that is
    using it: a request takes the handles it works on (two at most) through
    ``using``, which opens an evicted fd again and marks them ``busy``."""

    def __init__(self, cap: int, reopen: Callable[[Node], int]):
        self.cap = cap
        self.share = max(16, cap // 4)  # pinned fds one user may cause
        self._reopen = reopen
        # evictable fds, oldest first: nodes (touched when used) and handles
        self.lru: OrderedDict[Node | Handle, None] = OrderedDict()
        self.pinned: dict[Node, int] = {}  # node -> uid it is counted against
        self.pins: dict[int, int] = {}  # uid -> pinned fds counted against it
        # what the objects of nodes whose fds were evicted are (B.object_id):
        # a reopened fd must reach the same object, not a later one the
        # filesystem gave its freed inode number
        self.ids: dict[Node, bytes] = {}
        self.busy: Handle | None = None  # the handles the request works on
        self.busy2: Handle | None = None
        self.evicted = 0  # (for status and tests: fds closed to stay under cap)

    def __len__(self) -> int:
        return len(self.lru) + len(self.pinned)

    def info(self) -> dict:
        """For `status --json` (the engine's): the process's fd limit, the
        cap, what is held (of which pinned), and how many were evicted."""
        return {
            "limit": fd_limit(),
            "cap": self.cap,
            "held": len(self),
            "pinned": len(self.pinned),
            "evicted": self.evicted,
        }

    def using(self, h: Handle) -> Handle:
        """*h* is used by the request under way: its fd is open, and stays
        open until the request is over (``Ops._file`` does the same inline)."""
        if h is not self.busy:
            self.busy2, self.busy = self.busy, h
        if h.fd < 0:
            self.reopen_handle(h)
        return h

    def add(self, obj: Node | Handle) -> None:
        """*obj* has an fd now (a node other than the root, or a handle)."""
        if isinstance(obj, Node) and (obj.ino <= ROOT or obj in self.pinned):
            return
        self.lru[obj] = None
        if len(self.lru) + len(self.pinned) > self.cap:
            self._trim(self.cap)

    def _trim(self, target: int, spare: int = 1) -> None:
        """Close the oldest fds until at most *target* are held; the *spare*
        most recently used or added, and the handles in use, stay."""
        lru = self.lru
        kept: list[Node | Handle] = []
        while len(lru) + len(self.pinned) + len(kept) > target and len(lru) > spare:
            obj, _ = lru.popitem(last=False)
            if obj is self.busy or obj is self.busy2:
                kept.append(obj)
                continue
            if isinstance(obj, Node):
                fd = obj._fd
                if obj.nopen:
                    try:
                        nameless = os.fstat(fd).st_nlink == 0
                    except OSError:
                        nameless = False
                    if nameless:  # (an undo or a commit took its last name)
                        self.pinned[obj] = -1
                        continue
                ident = B.object_id(fd)
                if ident is None:  # (a filesystem without file handles: it stays)
                    self.pinned[obj] = -1
                    continue
                self.ids[obj] = ident
                obj._fd = -1
            else:
                fd, obj.fd = obj.fd, -1
            os.close(fd)
            self.evicted += 1
        for obj in kept:
            lru[obj] = None
            lru.move_to_end(obj, last=False)

    def shed(self) -> bool:
        """The process ran out of descriptors (EMFILE, or the system of
        files: ENFILE): close a share of the cache; whether any went."""
        before = self.evicted
        # (not the fds the failed open was given: used last, so the newest)
        self._trim(max(0, len(self) - max(64, self.cap // 16)), spare=16)
        return self.evicted > before

    def open(self, path: bytes, flags: int, mode: int = 0o777, dir_fd: int | None = None) -> int:
        """os.open, for an fd the cache is to hold: where descriptors ran
        out, evict some and try once more.  (The fd is allocated before the
        path is looked at: a failed O_CREAT made nothing.)"""
        try:
            return os.open(path, flags, mode, dir_fd=dir_fd)
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE) or not self.shed():
                raise
        return os.open(path, flags, mode, dir_fd=dir_fd)

    def reopen(self, node: Node) -> int:
        if not node.live:
            raise OSError(errno.ESTALE, "stale inode")
        node._fd = self._reopen(node)
        self.ids.pop(node, None)
        self.add(node)
        return node._fd

    def same(self, node: Node, fd: int) -> bool:
        """Whether *fd* is on the object *node*'s evicted fd was on."""
        want = self.ids.get(node)
        return want is not None and B.object_id(fd) == want

    def found(self, node: Node, fd: int) -> None:
        """*node*'s evicted fd is found again: *fd*, which ``same`` vouched
        for (the cache holds it now)."""
        node._fd = fd
        self.ids.pop(node, None)
        self.add(node)

    def reopen_handle(self, h: Handle) -> None:
        """Open *h*'s evicted fd again (*h* is busy)."""
        node = h.node
        if not node.live:
            raise OSError(errno.ESTALE, "stale inode")
        h.fd = self.open(b"/proc/self/fd/%d" % node.fd, h.flags)
        self.add(h)

    def opened(self, node: Node, h: Handle) -> None:
        """*h* is a new open file of *node*."""
        node.nopen += 1
        if h is not self.busy:
            self.busy2, self.busy = self.busy, h
        self.add(h)

    def closed(self, h: Handle) -> None:
        """Open file *h* was released."""
        self.lru.pop(h, None)
        if h.fd >= 0:
            os.close(h.fd)
            h.fd = -1
        node = h.node
        node.nopen -= 1
        if node.nopen == 0 and node in self.pinned:
            self._unpin(node)
            if node.live and node._fd >= 0:
                self.add(node)

    def pin(self, node: Node, uid: int) -> None:
        """Keep *node*'s fd open (it is about to have no name) while it is
        open, counted against *uid*; EMFILE, before anything changes, when
        *uid* holds its share already."""
        if node in self.pinned or node.ino <= ROOT:
            return
        self.may_pin(uid)
        _ = node.fd  # (opened again if it was evicted)
        self.lru.pop(node, None)
        self.pinned[node] = uid
        self.pins[uid] = self.pins.get(uid, 0) + 1

    def may_pin(self, uid: int) -> None:
        """EMFILE if *uid* holds its share of pinned fds."""
        if self.pins.get(uid, 0) >= self.share:
            raise OSError(errno.EMFILE, "too many open files without a name")

    def _unpin(self, node: Node) -> None:
        uid = self.pinned.pop(node)
        if uid in self.pins:
            self.pins[uid] -= 1
            if not self.pins[uid]:
                del self.pins[uid]

    def close(self, node: Node) -> None:
        self.lru.pop(node, None)
        self.ids.pop(node, None)
        if node in self.pinned:
            self._unpin(node)
        if node._fd >= 0:
            os.close(node._fd)
            node._fd = -1


def fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft


def fd_cache_size(limit: int | None = None) -> int:
    """How many backing fds the daemon keeps: its fd limit less a reserve
    for everything else (the control channel and its clients, the store
    and its blobs, a rollback's directory cache, transient fds of requests)
    -- an eighth, at least 2,048 where the limit allows -- and at most
    200,000 (each pins a kernel inode and dentry)."""
    if limit is None:
        limit = fd_limit()
    reserve = max(limit // 8, min(2048, limit // 2))
    return max(64, min(limit - reserve, 200_000))


class DirHandle:
    __slots__ = ("node", "names")

    def __init__(self, node: Node, names: list[bytes]):
        self.node = node
        self.names = names
