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

ROOT = 1  # the root's inode number in every FUSE protocol


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
        "live",
        "nopen",
        "nlookup",
        "parent",
        "name",
        "extra",
        "mode",
        "nocap",
        "noxattr",
        "pt",
        "pt_writers",
        "cached",
        "bfd",
        "backing",
    )
    cache: FdCache

    def __init__(self, ino: int, bino: int, fd: int, mode: int):
        self.ino = ino
        self.bino = bino
        self._fd = fd
        self.live = True
        self.nopen = 0
        self.mode = _MODES.setdefault(mode, mode)  # (one int object per mode)
        self.nlookup = 0
        self.parent: Node | None = None
        self.name = b""
        self.extra: set[tuple[Node, bytes]] | None = None
        self.nocap = False  # known to have no security.capability
        # known to have no xattrs at all (True), to have some (False), or not
        self.noxattr: bool | None = None
        # open files: served by the kernel from the backing file (passthrough;
        # of which writable), or through the daemon; the backing file all
        # passthrough opens share, and the engine's id for it
        self.pt = self.pt_writers = self.cached = 0
        self.bfd = -1
        self.backing: int | None = None

    @property
    def fd(self) -> int:
        """An O_PATH fd on the object (opened again if it was evicted)."""
        if self._fd >= 0:
            self.cache.used(self)
            return self._fd
        return self.cache.reopen(self)

    @property
    def isdir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def islnk(self) -> bool:
        return stat.S_ISLNK(self.mode)


class Handle:
    __slots__ = ("node", "fd", "writable", "who", "passthrough", "counted")

    def __init__(self, node: Node, fd: int, writable: bool, who: tuple[int, int] | None):
        self.node = node
        self.fd = fd
        self.writable = writable
        self.who = who  # the process that opened it (writes carry no caller)
        self.passthrough = False
        self.counted = False  # in its node's pt or cached count


class FdCache:
    """Keeps at most *cap* O_PATH fds of nodes open, least recently used
    evicted first.  Nodes with open files keep theirs (an unlinked open file
    has no name to reopen it by)."""

    def __init__(self, cap: int, reopen: Callable[[Node], int]):
        self.cap = cap
        self._reopen = reopen
        self.lru: OrderedDict[int, Node] = OrderedDict()

    def used(self, node: Node) -> None:
        if node.ino in self.lru:
            self.lru.move_to_end(node.ino)

    def add(self, node: Node) -> None:
        if node.nopen == 0 and node.ino > ROOT:
            self.lru[node.ino] = node
            while len(self.lru) > self.cap:
                _, old = self.lru.popitem(last=False)
                os.close(old._fd)
                old._fd = -1

    def reopen(self, node: Node) -> int:
        if not node.live:
            raise OSError(errno.ESTALE, "stale inode")
        node._fd = self._reopen(node)
        self.add(node)
        return node._fd

    def pin(self, node: Node) -> None:
        _ = node.fd  # make sure it is open (the property opens it)
        node.nopen += 1
        self.lru.pop(node.ino, None)

    def unpin(self, node: Node) -> None:
        node.nopen -= 1
        if node.nopen == 0 and node.live and node._fd >= 0:
            self.add(node)

    def close(self, node: Node) -> None:
        self.lru.pop(node.ino, None)
        if node._fd >= 0:
            os.close(node._fd)
            node._fd = -1


def fd_cache_size() -> int:
    """Half the fd limit (the rest: open files, the store, sockets)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(256, min(soft // 2, 200_000))


class DirHandle:
    __slots__ = ("node", "names")

    def __init__(self, node: Node, names: list[bytes]):
        self.node = node
        self.names = names
