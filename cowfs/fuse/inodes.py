"""The inode table (``InodeTable``: the kernel-visible nodes by inode
number and by backing object, the names each is known by, lookup counts)
and its pieces: the nodes, open file and directory handles, and the
bounded cache of O_PATH fds the nodes keep on their backing objects.
Engine-neutral (see ``ops``, which holds one table)."""

from __future__ import annotations

import errno
import os
import resource
import stat
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable

from ..storage import schema
from ..system import backing

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
        "cache",
        "ident",
    )

    def __init__(self, ino: int, bino: int, fd: int, mode: int, cache: FdCache):
        self.ino = ino
        self.bino = bino
        self._fd = fd
        self.cache = cache  # (the table's: it holds the fd, and reopens it)
        self.nopen = 0
        self.mode = _MODES.setdefault(mode, mode)  # (one int object per mode)
        self.nlookup = 0
        self.parent: Node | None = None
        self.name = b""  # (its other names, if it has hard links: ``InodeTable.links``)
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
        # what the object is while its fd is evicted (``backing.object_id``):
        # a reopened fd must reach the same object, not a later one the
        # filesystem gave its freed inode number (a slot, not a dict of the
        # cache's: a table of 200,000 files holds most of them evicted)
        self.ident: bytes | None = None

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
        """Still in the table (``InodeTable.drop`` marks it DEAD)."""
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
                ident = backing.object_id(fd)
                if ident is None:  # (a filesystem without file handles: it stays)
                    self.pinned[obj] = -1
                    continue
                obj.ident = ident
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
        node.ident = None
        self.add(node)
        return node._fd

    def same(self, node: Node, fd: int) -> bool:
        """Whether *fd* is on the object *node*'s evicted fd was on."""
        want = node.ident
        return want is not None and backing.object_id(fd) == want

    def found(self, node: Node, fd: int) -> None:
        """*node*'s evicted fd is found again: *fd*, which ``same`` vouched
        for (the cache holds it now)."""
        node._fd = fd
        node.ident = None
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
        node.ident = None
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


# Inode numbers for the nodes that cannot have their object's own (see
# ``InodeTable.new_ino``): counted down from here, within 32 bits (a program
# built without large-file support fails a stat(2) of anything higher).
SPARE_INO = 0xFFFF_FFFF


class Numbers:
    """The inode numbers a FUSE server gives the kernel for objects: an
    object's own, as the filesystem underneath has it, unless *taken* (a
    node the kernel still holds has it -- the object removed since, its
    number given to a new one; or the root's, 1): then a spare one.  The
    mount's table numbers live objects so (``InodeTable.new_ino``), a view
    the objects as they were (``view.View``): each keeps its number however
    often the kernel forgets it and looks it up again."""

    def __init__(self) -> None:
        self.spare = SPARE_INO

    def new(self, own: int, taken: Container[int]) -> int:
        if own > ROOT and own not in taken:
            return own
        while self.spare in taken or self.spare <= ROOT:
            self.spare = self.spare - 1 if self.spare > ROOT + 1 else SPARE_INO
        ino = self.spare
        self.spare -= 1
        return ino


Link = tuple[Node, bytes]  # a name of a node: (parent node, name)


class InodeTable:
    """The nodes the kernel knows, by inode number (``nodes``) and by
    backing object (``by_bino``); the names each is known by (a node's
    ``parent`` and ``name``, and for hard-linked files the others, in
    ``links``); the lookup counts the kernel holds (``forget``, ``drop``);
    and the fds the nodes keep (``fds``), reopened through those names.

    The root is the workspace's directory (*rootfd*); the grave (the
    store's directory of removed objects, *grave_fd*) is a node outside
    the tree, inode 0, under which removed objects keep a name; *hidden*:
    the store's name in the root when it is inside the workspace (never
    shown, never searched); *cap*: how many fds the nodes and open files
    may hold (``fd_cache_size``)."""

    def __init__(self, rootfd: int, grave_fd: int, hidden: bytes | None, cap: int | None = None):
        self.fds = fds = FdCache(fd_cache_size() if cap is None else cap, self.reopen)
        self.hidden = hidden
        st = os.stat(rootfd)
        self.root = Node(ROOT, st.st_ino, rootfd, st.st_mode, fds)
        self.root.nlookup = 1
        self.grave = Node(0, 0, grave_fd, stat.S_IFDIR, fds)
        self.nodes: dict[int, Node] = {self.root.ino: self.root}
        # The node of each backing object is nodes[its inode number] (a
        # node's number is its object's: ``new_ino``), but for these
        # exceptions, few: an object whose node has another number (a
        # spare one; the root's, 1), or None where nodes[the object's
        # number] is a node whose object is gone (``orphan``) -- one
        # mapping for the table, not two (some 50 bytes a node).
        self.moved: dict[int, Node | None] = {}
        # the other names (parent, name) of nodes known by more than one
        # (hard links: few), kept apart from the nodes
        self.links: dict[Node, set[Link]] = {}
        self._map(self.root)
        self.numbers = Numbers()

    # -- finding and adding nodes ------------------------------------------------

    def node(self, ino: int) -> Node:
        """The node of inode number *ino* (ESTALE: the kernel's is gone)."""
        try:
            return self.nodes[ino]
        except KeyError:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE)) from None

    def by_bino(self, bino: int) -> Node | None:
        """The node of backing object *bino*, if the table has one."""
        moved = self.moved
        if moved and bino in moved:
            return moved[bino]
        node = self.nodes.get(bino)
        return node if node is not None and node.bino == bino else None

    def lookup(
        self, parent: Node, name: bytes, count: bool = True, made: os.stat_result | None = None
    ) -> tuple[Node, os.stat_result]:
        """The node of the object *name* in *parent* leads to (a new one if
        the table has none), known by that name from now on; *count*: the
        kernel takes a reference.  *made*: the stat of an object the daemon
        has just made there."""
        st = made if made is not None else os.stat(name, dir_fd=parent.fd, follow_symlinks=False)
        bino = st.st_ino
        moved = self.moved
        if moved and bino in moved:  # (``by_bino``, inline: every lookup and create)
            node = moved[bino]
        else:
            node = self.nodes.get(bino)
            if node is not None and node.bino != bino:
                node = None
        if node is None or (node._fd < 0 and node is not self.root):
            fd = self.fds.open(name, backing.PATH_FLAGS, dir_fd=parent.fd)
            try:
                if made is None or node is not None:
                    st = os.fstat(fd)
                    node = self.by_bino(st.st_ino)
                if node is not None and node._fd < 0 and node is not self.root:
                    # Its fd was evicted: the object may have gone since,
                    # and this be a later one given its inode number.
                    if self.fds.same(node, fd):
                        self.fds.found(node, fd)
                        fd = -1
                    else:
                        self.orphan(node.bino)
                        node = None
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                raise
            if node is None:
                node = Node(self.new_ino(st.st_ino), st.st_ino, fd, st.st_mode, self.fds)
                node.parent, node.name = parent, name
                self.add(node)
                self.fds.add(node)
            else:
                if fd >= 0:  # (the name led to an object with a node of its fd)
                    os.close(fd)
                self.add_link(node, parent, name)
        else:
            self.add_link(node, parent, name)
        if count:
            node.nlookup += 1
        return node, st

    def new_ino(self, bino: int) -> int:
        """The inode number (the kernel's node id, and the st_ino programs
        see) of a new node for backing object *bino*: the object's own, as
        the filesystem underneath has it.  So an object keeps its number
        however often the kernel forgets it (under memory pressure, or when
        a rollback or redo drops the names it cached) and looks it up again
        -- a number of our own, new at each lookup, made two names of one
        file that were looked up either side of that seem two files to
        whatever counts hard links by it (tar, rsync -H, du, cp -a, find
        -samefile), and git's index took every file for touched.  Unless a
        node the kernel still holds has that number (the object removed
        since, its number given to a new one; or the root's, 1): then a
        spare one (``Numbers``)."""
        return self.numbers.new(bino, self.nodes)

    def add(self, node: Node) -> None:
        """*node* (numbered by ``new_ino``) is in the table, its object's."""
        self.nodes[node.ino] = node
        self._map(node)

    def _map(self, node: Node) -> None:
        """*node* (in ``nodes`` now) is its object's."""
        if node.ino == node.bino:
            self.moved.pop(node.bino, None)
        else:
            self.moved[node.bino] = node

    def _unmap(self, bino: int) -> None:
        """No node is object *bino*'s any more."""
        moved = self.moved
        moved.pop(bino, None)
        stale = self.nodes.get(bino)
        if stale is not None and stale.bino == bino:
            moved[bino] = None

    # -- letting nodes go --------------------------------------------------------

    def forget(self, inode_list: Iterable[tuple[int, int]]) -> None:
        """The kernel let go of *n* references to each inode (ino, n)."""
        nodes = self.nodes
        for ino, n in inode_list:
            node = nodes.get(ino)
            if node is None or node is self.root:
                continue
            node.nlookup -= n
            if node.nlookup <= 0:
                self.drop(node)

    def drop(self, node: Node) -> None:
        """*node* leaves the table (the kernel holds it no longer)."""
        if node is self.root or self.nodes.get(node.ino) is not node:
            return
        current = self.by_bino(node.bino) is node
        del self.nodes[node.ino]
        moved = self.moved
        if moved:
            if node.ino in moved and moved[node.ino] is None:
                del moved[node.ino]  # (it said that this node was no object's)
            if current:
                self._unmap(node.bino)
        node.nlookup = DEAD  # (not live)
        self.links.pop(node, None)
        self.fds.close(node)

    def orphan(self, bino: int) -> None:
        """The object *bino* is gone for good: its inode number may be reused,
        so it must no longer lead to its node (which lives on for the kernel
        while it holds it, with the fd it has, if any)."""
        node = self.by_bino(bino)
        if node is not None:
            self._unmap(bino)
            node.parent, node.name = None, b""
            self.links.pop(node, None)

    def let_go(self, bino: int) -> None:
        """The object *bino* is gone: the fd its node holds closes now (not
        when the kernel forgets it) unless the object is open."""
        node = self.by_bino(bino)
        if node is not None and node.nopen == 0:
            self.fds.close(node)
            self.orphan(bino)

    # -- the names of nodes ----------------------------------------------------------

    def names(self, node: Node) -> list[tuple[Node | None, bytes]]:
        """The names *node* is known by, the last one it was found by first
        (any may have gone stale since; a parent None: no name known)."""
        return [(node.parent, node.name), *self.links.get(node, ())]

    def add_link(self, node: Node, parent: Node, name: bytes) -> None:
        """*node* is known by *name* in *parent* (found by it last)."""
        if node.parent is parent and node.name == name:
            return
        if node.isdir or node.parent is None:
            node.parent, node.name = parent, name
            return
        extra = self.links.get(node)
        if extra is None:
            extra = self.links[node] = set()
        extra.add((node.parent, node.name))
        extra.discard((parent, name))
        node.parent, node.name = parent, name

    def remove_link(self, node: Node, parent: Node, name: bytes) -> None:
        """*node* is no longer known by *name* in *parent*."""
        extra = self.links.get(node)
        if node.parent is parent and node.name == name:
            if extra:
                node.parent, node.name = extra.pop()
            else:
                node.parent, node.name = None, b""
        elif extra:
            extra.discard((parent, name))
        if extra is not None and not extra:
            del self.links[node]

    def relink(self, bino: int, old: Node, old_name: bytes, new: Node, new_name: bytes) -> None:
        """Object *bino*'s name *old_name* in *old* is *new_name* in *new* now."""
        node = self.by_bino(bino)
        if node is not None:
            self.remove_link(node, old, old_name)
            self.add_link(node, new, new_name)

    def path(self, node: Node) -> bytes:
        """The location of *node* now (workspace path or grave entry)."""
        parts: list[bytes] = []
        n = node
        while n is not self.root:
            p = n.parent
            if p is not None and not p.live:
                # (forgotten by the kernel, which may hold a node inside it
                # that an undo moved there: the object's node, if it has
                # one again)
                alt = self.by_bino(p.bino)
                if alt is not None and alt.live and alt.isdir:
                    n.parent = p = alt
            if p is None or not p.live:
                raise OSError(errno.ESTALE, "object has no known name")
            if p is self.grave:
                if parts:
                    raise OSError(errno.ESTALE, "object inside a removed directory")
                return schema.GRAVE_PREFIX + n.name
            parts.append(n.name)
            n = p
        return b"/".join(reversed(parts))

    def loc(self, node: Node) -> bytes:
        """Like ``path``, but first make sure the name still leads to the
        object (names of hard-linked files can go stale)."""
        if node is self.root:
            return b""
        for parent, name in self.names(node):
            if parent is None or not parent.live:
                continue
            st = backing.lstat_at(parent.fd, name)
            if st is not None and st.st_ino == node.bino:
                if (parent, name) != (node.parent, node.name):
                    self.add_link(node, parent, name)
                try:
                    return self.path(node)
                except OSError:
                    continue
        path = self.search(node.bino)
        if path is None:
            raise OSError(errno.EIO, "cannot locate the object to capture it")
        return path

    def symlink_name(self, node: Node) -> Link:
        """A name that leads to symlink *node* now (checked: the calls that
        take a symlink itself take it by name -- a stale name of ours must
        never lead them to whatever is there now)."""
        for parent, name in self.names(node):
            if parent is None or not parent.live:
                continue
            st = backing.lstat_at(parent.fd, name)
            if st is not None and st.st_ino == node.bino and stat.S_ISLNK(st.st_mode):
                return parent, name
        raise OSError(errno.ESTALE, "the symlink has no known name left")

    def named(self, node: Node) -> bool:
        """Whether *node*'s object still has a name the kernel may know it
        by.  (An fd evicted from the cache says nothing: orphaning a live
        object would give its other names a second inode number.)"""
        if node._fd >= 0:
            return os.fstat(node._fd).st_nlink > 0
        for parent, name in self.names(node):
            if parent is None or not parent.live or parent is self.grave:
                continue
            try:
                if os.stat(name, dir_fd=parent.fd, follow_symlinks=False).st_ino == node.bino:
                    return True
            except OSError:
                continue
        return False

    def dir_node(self, path: bytes) -> Node | None:
        """The node of the directory at workspace path *path*, if any."""
        try:
            fd = backing.open_dir(self.root.fd, path)
        except OSError:
            return None
        try:
            return self.by_bino(os.fstat(fd).st_ino)
        finally:
            os.close(fd)

    def search(self, bino: int) -> bytes | None:
        """Find a name of backing inode *bino* by walking the tree (a last
        resort when every name we knew has gone stale)."""
        gfd = os.open(backing.proc(self.grave.fd), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with os.scandir(gfd) as it:
                for e in it:
                    if e.inode() == bino:
                        return schema.GRAVE_PREFIX + os.fsencode(e.name)
        finally:
            os.close(gfd)
        pending = [b""]
        while pending:
            rel = pending.pop()
            try:
                fd = backing.open_dir(self.root.fd, rel)
                rfd = backing.open_noatime(
                    backing.proc(fd), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
                )
                os.close(fd)
            except OSError:
                continue
            try:
                with os.scandir(rfd) as it:
                    for e in it:
                        name = os.fsencode(e.name)
                        if not rel and name == self.hidden:
                            continue
                        path = backing.join(rel, name)
                        if e.inode() == bino:
                            return path
                        if e.is_dir(follow_symlinks=False):
                            pending.append(path)
            finally:
                os.close(rfd)
        return None

    def reopen(self, node: Node) -> int:
        """Open an O_PATH fd on *node*'s object again, through a name that
        still leads to it (the fd cache's way to reopen an evicted one)."""
        if self.by_bino(node.bino) is not node:
            raise OSError(errno.ESTALE, "the object is gone")
        for parent, name in self.names(node):
            if parent is None or not parent.live:
                continue
            try:
                fd = self.fds.open(name, backing.PATH_FLAGS, dir_fd=parent.fd)
            except OSError:
                continue
            if os.fstat(fd).st_ino == node.bino and self.fds.same(node, fd):
                return fd
            os.close(fd)
        path = self.search(node.bino)
        if path is not None:
            with backing.Resolver(self.root.fd, self.grave.fd).at(path) as (d, n):
                fd = os.open(n, backing.PATH_FLAGS, dir_fd=d)
            if os.fstat(fd).st_ino == node.bino and self.fds.same(node, fd):
                return fd
            os.close(fd)
        # (gone: its inode number may be another object's by now)
        raise OSError(errno.ESTALE, "the object has no name left")
