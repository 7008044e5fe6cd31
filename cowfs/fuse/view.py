"""`cowfs view ID DIR`: a read-only mount at DIR of the whole tree as it was
when layer ID was opened, computed like `show` (cowfs/layers/past.py) from the live
tree and the reverse diffs, changing nothing.

A view runs in a process of its own (pyfuse3 serves one mount per
process), started by the workspace's daemon (or, for a workspace that is
not mounted, by the CLI) with the workspace root and the store passed as
open directory fds: the backing directory may be hidden under the
workspace's own mount.  It reads the store as a second LMDB reader, without
the store's lock, and follows it: a change made in the workspace after the
view was mounted is captured first (the daemon commits a pre-image before
it changes a file), and the view reads again whenever the journal grew
while it read, so it keeps showing the past.  It lasts while its layer
does: once that layer is rolled back or merged, its start cannot be
computed any more and every access fails with ESTALE.  `cowfs unmount DIR`
ends it.

The directory it mounts on is opened by the one that starts it
(launch.open_view_dir: no planted symlink followed) and passed as an open
O_PATH fd too; as root the view mounts on that descriptor
(/proc/self/fd/N), so the mount lands on exactly the directory that was
checked, whatever was renamed or swapped since.  (A user's view mounts
through fusermount3, a process of its own, which needs the path and checks
it as that user.)
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence

import pyfuse3
import trio

from .. import errors
from ..errors import CowfsError
from ..layers.past import History, Past, Replaced
from ..storage import schema
from ..storage.store import Store, meta_int
from ..system import backing
from ..system.access import Requester
from ..system.mounts import VIEW_FSTYPE
from .inodes import ROOT, Numbers
from .ops import fail
from .pyfuse3_engine import handler, statvfs_data

log = logging.getLogger("cowfs.view")
FSTYPE = VIEW_FSTYPE
TIMEOUT = 1.0  # the past does not change, but the view must notice its end
# A fork's view (of a fork point, pinned while the fork lives, ignored
# paths captured from it on: nothing it shows ever changes) lets the kernel
# keep what it read.
FORK_TIMEOUT = 3600.0
PENDING_WAIT = 120.0  # (how long a request waits for a rollback to finish)
# The metadata an overlay keeps in its layers' xattrs: never served from a
# workspace's objects (a view is the lower layer of a fork's overlay, and
# whoever may write the workspace could plant redirects there).
OVERLAY_XATTR = b"trusted.overlay."


Opened = tuple[bytes, int, bytes | None]


class View(pyfuse3.Operations):
    supports_dot_lookup = False

    def __init__(
        self,
        store: Store,
        rootfd: int,
        layer: int,
        hidden: bytes | None,
        on_init: Callable[[], None] | None = None,
        start: int | None = None,
    ):
        """*start*: the view is of the tree when the record at that journal
        position was written (a fork point), not of the layer's start."""
        super().__init__()
        self.store = store
        self.rootfd = rootfd
        self.resolver = backing.Resolver(rootfd, store.grave_fd)
        self.layer = layer
        self.start = start
        self.hidden = hidden
        self.on_init = on_init
        self.h: History | None = None
        self.seen: tuple | None = None
        self._graves: tuple = (None, {})  # (grave state, grave_counts())
        # the objects the kernel holds (its lookups, ``counts``), numbered
        # as the mount numbers live ones (``Numbers``: an object's own
        # number, which it keeps however often it is forgotten and looked
        # up again): view inode -> the path it was reached by; backing ino
        # at T -> view inode where the two differ (spares)
        self.paths: dict[int, bytes] = {ROOT: b""}
        self.counts: dict[int, int] = {}
        self.spares: dict[int, int] = {}
        self.spare_of: dict[int, int] = {}  # (the other way)
        self.numbers = Numbers()
        # open directories and files: (path, object at T, its file handle)
        self.dirs: dict[int, Opened] = {}
        self.files: dict[int, Opened] = {}
        self.next_fh = 1

    def init(self) -> None:
        if self.on_init is not None:
            self.on_init()

    # -- following the store -------------------------------------------------------

    def _state(self) -> tuple[int, int, tuple[int, ...]]:
        """The journal's end and epoch, and the layers, as the store holds
        them -- once no rollback or redo is under way (it puts the tree back
        before it deletes the records that say so: in between, neither says
        where the objects of the past are), or after PENDING_WAIT seconds."""
        deadline = time.monotonic() + PENDING_WAIT
        while True:
            with self.store.env.begin(db=self.store.db_meta) as txn:
                seq = meta_int(txn, schema.K_NEXT_SEQ)
                raw = txn.get(schema.K_EPOCH)
                busy = txn.get(schema.K_PENDING) is not None
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        epoch = 0 if raw is None else schema.meta_int(schema.K_EPOCH, raw)
        with self.store.env.begin(db=self.store.db_layers) as txn:
            layers = tuple(schema.from_u64(k) for k, _ in txn.cursor())
        return seq, epoch, layers

    def history(self) -> History:
        """The history of the view's layer, following the store: records
        appended since it was read are read alone (the workspace's daemon
        writes all the time), all of them again only when a record already
        read was deleted or put back (a rollback or commit above the layer)."""
        state = self._state()
        if state == self.seen and self.h is not None:
            return self.h
        seq, epoch, layers = state
        if self.layer not in layers if self.start is None else not layers:
            raise fail(errno.ESTALE)
        seen = self.seen
        self.store.follow(seq)
        if self.h is not None and seen is not None and seen[1] == epoch and seen[0] <= seq:
            self.h.extend(self.store.records(seen[0], seq))
        else:
            self.h = History(self.store, self.resolver, self.layer, self.hidden, start=self.start)
        self.seen = state
        return self.h

    def past(self, path: bytes) -> Past:
        obj = self.history().object_at(path)
        if obj is None:
            raise fail(errno.ENOENT)
        return obj

    # -- attributes ------------------------------------------------------------------

    def _ino(self, obj: Past) -> int:
        if obj.path == b"":
            return ROOT
        ino = self.spares.get(obj.ino)
        if ino is None:
            if obj.ino in self.paths and obj.ino not in self.spare_of:
                return obj.ino  # (held already, by its own number)
            ino = self.numbers.new(obj.ino, self.paths)
            if ino != obj.ino:
                self.spares[obj.ino], self.spare_of[ino] = ino, obj.ino
            self.paths[ino] = obj.path
        return ino

    def _looked_up(self, ino: int) -> None:
        """The kernel took a reference to *ino* (a lookup, or an entry of
        a readdir it kept)."""
        if ino != ROOT:
            self.counts[ino] = self.counts.get(ino, 0) + 1

    def _attr(self, obj: Past) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = self._ino(obj)
        e.generation = 0
        e.entry_timeout = e.attr_timeout = TIMEOUT if self.start is None else FORK_TIMEOUT
        e.st_mode = obj.mode
        e.st_nlink = self.nlink(obj)
        e.st_uid, e.st_gid = obj.uid, obj.gid
        e.st_rdev = obj.now.st_rdev
        e.st_size = obj.size if not stat.S_ISDIR(obj.mode) else obj.now.st_size
        e.st_blksize = obj.now.st_blksize
        e.st_blocks = (obj.size + 511) // 512 if stat.S_ISREG(obj.mode) else obj.now.st_blocks
        e.st_atime_ns, e.st_mtime_ns = obj.atime_ns, obj.mtime_ns
        e.st_ctime_ns = obj.now.st_ctime_ns
        return e

    def nlink(self, obj: Past) -> int:
        """Names the object had at T: its names now (the grave's excluded),
        plus those it had at T and lost since, minus the links made since T
        that are still there."""
        if stat.S_ISDIR(obj.mode):
            return 2
        h = self.history()
        buried = self._grave_counts().get(obj.ino, 0)
        removed = h.j.removed.get(obj.ino, 0)
        linked = h.links.get(obj.ino, 0)
        return max(1, obj.now.st_nlink - buried + removed - linked)

    def _grave_counts(self) -> dict[int, int]:
        """The store's grave_counts(), read again only when the grave's
        entries change (not on every getattr): their number, or a new one."""
        with self.store.env.begin() as txn:
            key = (
                txn.stat(self.store.db_graves)["entries"],
                txn.get(schema.K_NEXT_GRAVE, db=self.store.db_meta),
            )
        if self._graves[0] != key:
            self._graves = (key, self.store.grave_counts())
        return self._graves[1]

    def _path(self, inode: int) -> bytes:
        try:
            return self.paths[inode]
        except KeyError:
            raise fail(errno.ESTALE) from None

    # -- operations --------------------------------------------------------------------

    @handler
    async def getattr(
        self, inode: int, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        return self._attr(self.past(self._path(inode)))

    @handler
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        parent = self._path(parent_inode)
        if name in (b".", b".."):
            raise fail(errno.ENOENT)
        if parent == b"" and name == self.hidden:
            raise fail(errno.ENOENT)
        obj = self.past(parent + b"/" + name if parent else name)
        if obj.path != (parent + b"/" + name if parent else name):
            raise fail(errno.ENOENT)
        attr = self._attr(obj)
        self.paths[attr.st_ino] = obj.path  # the name it was reached by
        self._looked_up(attr.st_ino)
        return attr

    @handler
    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        """The kernel let go of objects: those it holds no more leave the
        table (looked up again, each gets the same number)."""
        for ino, n in inode_list:
            left = self.counts.get(ino, 0) - n
            if left > 0:
                self.counts[ino] = left
                continue
            self.counts.pop(ino, None)
            if ino != ROOT:
                self.paths.pop(ino, None)
                own = self.spare_of.pop(ino, None)
                if own is not None:
                    del self.spares[own]

    def _open(self, obj: Past, ctx: pyfuse3.RequestContext) -> Opened:
        """What an open directory or file handle keeps of *obj*: its
        identity, from a descriptor of its live object checked to be it
        (``History.held``), on which the caller's permission is checked too.
        The kernel checked the permissions recorded at T (the mount's
        default_permissions); what is read from the live object (a file's
        bytes no record kept, a directory's names) must also be readable
        by the caller as that object is now -- its mode may have closed
        since, over bytes written uncaptured."""
        h = self.history()
        try:
            with h.held(obj) as (fd, st):
                if (
                    ctx.uid != 0
                    and not h.from_the_past(obj)
                    and not h.readable_live(Requester.of_process(ctx.pid, ctx.uid, ctx.gid), fd, st)
                ):
                    raise fail(errno.EACCES)
        except Replaced:
            raise fail(errno.ESTALE) from None
        return obj.path, obj.ino, obj.oid

    def _same(self, h: History, opened: Opened) -> Past:
        """The object an open handle was opened on, as the history says it
        was at T -- ESTALE when its path leads to another object now (one
        put there uncaptured: at an ignored path, or in a workspace not
        mounted).  Every read of it checks its file handle too."""
        path, ino, oid = opened
        obj = h.object_at(path)
        if obj is None or obj.ino != ino:
            raise fail(errno.ESTALE)
        obj.oid = oid
        return obj

    @handler
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        obj = self.past(self._path(inode))
        if not stat.S_ISDIR(obj.mode):
            raise fail(errno.ENOTDIR)
        opened = self._open(obj, ctx)
        fh = self.next_fh
        self.next_fh += 1
        self.dirs[fh] = opened
        return fh

    @handler
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        opened = self.dirs[fh]
        path = opened[0]
        h = self.history()
        here = self._same(h, opened)
        try:
            names = [b".", b".."] + h.listdir(here)
        except Replaced:
            raise fail(errno.ESTALE) from None
        for i in range(start_id, len(names)):
            if names[i] in (b".", b".."):
                up = h.need(path.rpartition(b"/")[0]) if names[i] == b".." and path else here
                if not pyfuse3.readdir_reply(token, names[i], self._attr(up), i + 1):
                    return
                continue
            child = path + b"/" + names[i] if path else names[i]
            obj = h.object_at(child)
            if obj is None:
                continue
            attr = self._attr(obj)
            self.paths[attr.st_ino] = child
            if not pyfuse3.readdir_reply(token, names[i], attr, i + 1):
                return
            self._looked_up(attr.st_ino)

    @handler
    async def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    @handler
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise fail(errno.EROFS)
        obj = self.past(self._path(inode))
        if stat.S_ISDIR(obj.mode):
            raise fail(errno.EISDIR)
        opened = self._open(obj, ctx)
        fh = self.next_fh
        self.next_fh += 1
        self.files[fh] = opened
        # (no cached pages kept between opens, but in a fork's view: an inode
        # number a view shows at an ignored path can be a later object's,
        # given a freed number)
        return pyfuse3.FileInfo(fh=fh, keep_cache=self.start is not None)

    @handler
    async def read(self, fh: int, off: int, size: int) -> bytes:
        opened = self.files[fh]
        while True:
            h = self.history()
            state = self.seen
            try:
                data = h.read(self._same(h, opened), off, size)  # (the object opened)
            except Replaced:
                raise fail(errno.ESTALE) from None
            except CowfsError:
                raise fail(errno.EIO) from None
            # A change captured meanwhile has its pre-image in the store by
            # now: read again with it.
            if self._state() == state:
                return data

    @handler
    async def release(self, fh: int) -> None:
        self.files.pop(fh, None)

    @handler
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        h = self.history()
        try:
            return h.readlink(h.need(self._path(inode)))
        except Replaced:
            raise fail(errno.ESTALE) from None

    def _xattrs(self, inode: int) -> list[tuple[bytes, bytes]]:
        h = self.history()
        try:
            return [
                (k, v)
                for k, v in h.xattrs_of(h.need(self._path(inode)))
                if not k.startswith(OVERLAY_XATTR)
            ]
        except Replaced:
            raise fail(errno.ESTALE) from None

    @handler
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return [n for n, _ in self._xattrs(inode)]

    @handler
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        for n, v in self._xattrs(inode):
            if n == name:
                return v
        raise fail(errno.ENODATA)

    # (under default_permissions the kernel checks the rest itself, and
    # sends no ACCESS request at all)
    @handler
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        if mode & os.W_OK:
            raise fail(errno.EROFS)
        return True

    @handler
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        return statvfs_data(os.fstatvfs(self.rootfd))


def serve(
    rootfd: int,
    store_dirfd: int,
    layer: int,
    mountpoint: str,
    hidden: bytes | None,
    report: Callable[[dict], None],
    dirfd: int | None = None,
    start: int | None = None,
) -> int:
    target = f"/proc/self/fd/{dirfd}" if dirfd is not None and os.geteuid() == 0 else mountpoint
    ws_path = os.readlink(f"/proc/self/fd/{rootfd}")
    try:
        store = Store.open(  # (checked: the session that holds it opened it)
            f"/proc/self/fd/{store_dirfd}",
            f"/proc/self/fd/{rootfd}",
            readonly=True,
            locked=False,
            checked=True,
        )
        if start is None:
            store.get_layer(layer)
    except CowfsError as e:
        report({"ok": False, **e.to_dict()})
        return e.code
    fs = View(
        store,
        rootfd,
        layer,
        hidden,
        on_init=lambda: report(
            {"ok": True, "pid": os.getpid(), "mountpoint": mountpoint, "layer": layer}
        ),
        start=start,
    )
    options = {
        "ro",
        "default_permissions",
        f"fsname=cowfs-view:{ws_path}@{layer}",
        "subtype=cowfs-view",
    }
    if os.geteuid() == 0:
        options.add("allow_other")
    try:
        pyfuse3.init(fs, target, options)
    except (OSError, RuntimeError) as e:
        report(
            {
                "ok": False,
                "code": errors.DAEMON_ERROR,
                "error": f"cannot mount the view at {mountpoint}: {e}",
            }
        )
        return errors.DAEMON_ERROR
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)
        store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cowfs-view")
    p.add_argument("--root-fd", type=int, required=True)
    p.add_argument("--store-fd", type=int, required=True)
    p.add_argument("--ready-fd", type=int, required=True)
    p.add_argument("--hidden", default="")
    p.add_argument("--layer", type=int, required=True)
    p.add_argument("--dir-fd", type=int, default=None)
    p.add_argument("--since", type=int, default=None, help="a fork point's journal position")
    p.add_argument("mountpoint")
    a = p.parse_args(argv)
    os.chdir("/")  # (out of the directory it was started from: see the daemon)
    from ..service.launch import detach

    return serve(
        a.root_fd,
        a.store_fd,
        a.layer,
        a.mountpoint,
        os.fsencode(a.hidden) or None,
        detach(a.ready_fd),
        a.dir_fd,
        a.since,
    )


if __name__ == "__main__":
    sys.exit(main())
