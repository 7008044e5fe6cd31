"""Applying undo records to the backing directory.

Every step is idempotent on its own: a rollback interrupted between applying a
record and deleting it applies that one record again when it resumes, and a
step whose object is already where it belongs does nothing.  Names are always
resolved relative to directory fds without following symlinks.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import assert_never

from ..storage import schema
from ..storage.store import Store, digest
from ..system import backing
from ..text import quote


class UndoError(Exception):
    pass


@dataclass
class Touched:
    """What an undo run changed, for the mount to bring its inode table in
    line and invalidate kernel caches.  A directory is named by its
    backing inode (0: the grave), the one the step acted in, never by a
    path: looked up after the run, a path may lead elsewhere (a later step
    moved a directory above it)."""

    entries: set[tuple[int, bytes]] = field(default_factory=set)  # (directory, name)
    objects: set[int] = field(default_factory=set)  # backing inodes
    moves: list[tuple[int, int, bytes]] = field(default_factory=list)  # (ino, new dir, name)
    removed: list[int] = field(default_factory=list)  # inodes freed
    # names taken from objects that keep others: (ino, directory, name)
    unnamed: list[tuple[int, int, bytes]] = field(default_factory=list)

    def entry(self, dino: int, name: bytes) -> None:
        if dino:
            self.entries.add((dino, name))

    def merge(self, other: Touched) -> None:
        self.entries |= other.entries
        self.objects |= other.objects
        self.moves += other.moves
        self.removed += other.removed
        self.unnamed += other.unnamed


class Undoer:
    def __init__(
        self,
        store: Store,
        resolver: backing.Resolver,
        touched: Touched | None = None,
        ignored: Callable[[bytes | Callable[[], bytes], bool], bool] | None = None,
        undone: Collection[int] = (),
    ):
        self.store = store
        self.r = resolver
        self.touched = touched if touched is not None else Touched()
        self.ignored = ignored  # (path, is_dir) -> bool: the capture filter, if any
        # the layers whose changes the steps take away (a rollback's): what
        # they made goes with a directory they made (``_only_ignored``)
        self.undone = undone

    def apply(self, rec: schema.Record, keep: tuple[int, int] | None = None) -> bool:
        """Apply one undo record.  *keep*: (grave id, inode): move the object
        a CREATE or LINK step removes into that grave entry instead (kept for
        a redo), if it is that object.  Returns whether the step moved an
        object into the grave (keeping it) or out of it (a GRAVE record)."""
        if keep is not None and isinstance(rec, schema.Create | schema.Link):
            return self._keep(rec.path, *keep, rec.dir)
        match rec:
            case schema.Grave():
                return self._grave(rec.path, rec.grave, rec.ino, rec.dir)
            case schema.Create() | schema.Link():
                self._remove(rec.path, rec.dir)
            case schema.Rename():
                self._rename(rec.src, rec.dst, rec.ino, rec.src_dir, rec.dst_dir)
            case schema.Exchange():
                self._exchange(rec.a, rec.b, rec.ino_a, rec.ino_b, rec.a_dir, rec.b_dir)
            case schema.Meta():
                self._meta(rec)
            case schema.Xattrs():
                self._xattrs(rec.loc, rec.ino, rec.blob)
            case schema.Chunk():
                self._chunk(rec)
            case schema.Damaged():  # (callers report these, never apply them)
                raise UndoError("a damaged record cannot be applied")
            case _:
                assert_never(rec)
        return False

    def _dino(self, d: int) -> int:
        """The backing inode of directory fd *d* (0: the grave)."""
        return 0 if d == self.r.grave_fd else os.fstat(d).st_ino

    def _in(self, d: int, loc: bytes, want: int) -> int:
        """The backing inode of directory fd *d*, where *loc* led, which
        must be directory *want* when the record names one (else
        UndoError: the step would act in a directory other than the one
        the change was made in)."""
        dino = self._dino(d)
        if want and dino and dino != want:
            raise UndoError(
                f"{_show(loc)}: not the directory the change was made in "
                "(moved or replaced, and not by a change the layers recorded)"
            )
        return dino

    def put_back_and_remove(
        self, ren: schema.Rename, keep: tuple[int, int] | None, seen: os.stat_result | None = None
    ) -> bool:
        """The undo steps of a file written under a temporary name and
        renamed into place -- RENAME src -> dst, and before it the CREATE of
        src -- taken as one: the file goes from dst straight to where the
        CREATE step puts it (into grave entry *keep*, kept for a redo, when
        that is its (grave id, inode); else nowhere).  The tree ends as the
        two steps leave it, with one rename or unlink instead of two; applied
        again, each of them finds the file gone from its name and does
        nothing.  Only for a file that is no directory, at dst, with nothing
        at src (*seen*: what the caller's plan has at dst, having seen
        nothing at src; else both are looked at), each in the directory the
        record names; returns False, having done nothing, otherwise: the
        steps are then applied one by one."""
        src, dst, ino = ren.src, ren.dst, ren.ino
        if keep is not None and keep[1] != ino:
            return False
        if ren.src_dir:
            try:
                with self.r.at(src) as (sd, sn):
                    if self._dino(sd) != ren.src_dir or (
                        seen is None and backing.lstat_at(sd, sn) is not None
                    ):
                        return False
                    src_entry = (ren.src_dir, sn)
            except OSError:
                return False
        else:
            if seen is None and self.r.lstat(src) is not None:
                return False
            src_entry = None
        with self.r.at(dst) as (d, n):
            dino = self._dino(d)
            if ren.dst_dir and dino != ren.dst_dir:
                return False
            st = backing.lstat_at(d, n) if seen is None else seen
            if st is None or st.st_ino != ino or stat.S_ISDIR(st.st_mode):
                return False
            if keep is not None:
                backing.renameat2(
                    d, n, self.store.grave_fd, str(keep[0]).encode(), backing.RENAME_NOREPLACE
                )
            else:
                os.unlink(n, dir_fd=d)
        if src_entry is not None:
            self.touched.entry(*src_entry)
        else:
            self._entry_at(src)
        self.touched.entry(dino, n)
        if keep is not None:
            self._buried(ino, keep[0])
        else:
            self._unlinked(st, dino, n)
        return True

    def _entry_at(self, loc: bytes) -> None:
        """The entry *loc* (in whatever directory it leads into now) changed."""
        if schema.grave_id(loc) is not None or not loc:
            return
        try:
            with self.r.at(loc) as (d, n):
                self.touched.entry(self._dino(d), n)
        except OSError:
            pass  # (no directory there: no entry the kernel may hold)

    def _unlinked(self, st: os.stat_result, dino: int, name: bytes) -> None:
        """Object *st* lost its name *name* in directory *dino*: gone, or
        one link fewer."""
        if stat.S_ISDIR(st.st_mode) or st.st_nlink == 1:
            self.touched.removed.append(st.st_ino)
        else:
            self.touched.objects.add(st.st_ino)  # its other names: one link fewer
            self.touched.unnamed.append((st.st_ino, dino, name))

    def _buried(self, ino: int, gid: int) -> None:
        """Object *ino* was moved into grave entry *gid*."""
        self.touched.moves.append((ino, 0, str(gid).encode()))
        self.touched.objects.add(ino)  # (names in the grave are not counted)

    # -- names -------------------------------------------------------------------

    def _remove(self, path: bytes, want: int = 0) -> None:
        with self.r.at(path) as (d, n):
            st = backing.lstat_at(d, n)
            if st is None:
                return
            dino = self._in(d, path, want)
            if stat.S_ISDIR(st.st_mode):
                try:
                    os.rmdir(n, dir_fd=d)
                except OSError as e:
                    # A directory made in the layer goes with what was made
                    # in it at ignored paths (never captured), and only that.
                    if e.errno != errno.ENOTEMPTY or not self._only_ignored(d, n, path):
                        raise
                    backing.remove_tree_at(d, n)
            else:
                os.unlink(n, dir_fd=d)
        if stat.S_ISDIR(st.st_mode):
            self.r.moved()
        self._unlinked(st, dino, n)
        self.touched.entry(dino, n)

    def _keep(self, path: bytes, gid: int, ino: int, want: int = 0) -> bool:
        """Remove object *ino*, created at *path* (in directory *want*), by
        moving it into the grave: a directory only when it holds nothing
        but ignored paths, as `_remove` would."""
        with self.r.at(path) as (d, n):
            st = backing.lstat_at(d, n)
            if st is None:
                return False
            dino = self._in(d, path, want)
            if st.st_ino != ino:
                raise UndoError(f"{_show(path)}: a different object is there")
            if stat.S_ISDIR(st.st_mode) and not self._only_ignored(d, n, path):
                raise OSError(errno.ENOTEMPTY, "directory not empty")
            backing.renameat2(
                d, n, self.store.grave_fd, str(gid).encode(), backing.RENAME_NOREPLACE
            )
        if stat.S_ISDIR(st.st_mode):
            self.r.moved()
        self.touched.entry(dino, n)
        self._buried(st.st_ino, gid)
        return True

    def _only_ignored(self, d: int, n: bytes, path: bytes, inside: bool = False) -> bool:
        """Whether directory *n* holds nothing but ignored paths (true when
        it is empty; *inside*: it is below an ignored directory) and no
        object that is not the undone layers' to take away (``_foreign``).
        (A directory at a time, however deep: no recursion.)"""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        # each: a directory read, and its subdirectories still to read
        stack: list[tuple[int, list[tuple[bytes, bytes, bool]]]] = []

        def scan(fd: int, here_path: bytes, here_inside: bool) -> list | None:
            """Its subdirectories, or None where it holds what must stay."""
            subdirs = []
            with os.scandir(fd) as entries:
                for entry in entries:
                    if self.ignored is None or self._foreign(entry.inode()):
                        return None
                    child_name = os.fsencode(entry.name)
                    is_dir = entry.is_dir(follow_symlinks=False)
                    # (below an ignored directory no path is needed: none
                    # is made, however deep the tree)
                    child = b"" if here_inside else here_path + b"/" + child_name
                    here = here_inside or self.ignored(child, is_dir)
                    if is_dir:
                        subdirs.append((child_name, child, here))
                    elif not here:
                        return None
            return subdirs

        def enter(parent: int, name: bytes, here_path: bytes, here_inside: bool) -> bool:
            fd = os.open(name, flags, dir_fd=parent)
            try:
                subdirs = scan(fd, here_path, here_inside)
            except BaseException:
                os.close(fd)
                raise
            if subdirs is None:
                os.close(fd)
                return False
            stack.append((fd, subdirs))
            return True

        try:
            if not enter(d, n, path, inside):
                return False
            while stack:
                fd, subdirs = stack[-1]
                if subdirs:
                    if not enter(fd, *subdirs.pop()):
                        return False
                    continue
                stack.pop()
                os.close(fd)
            return True
        finally:
            for fd, _ in stack:
                os.close(fd)

    def _foreign(self, ino: int) -> bool:
        """Whether object *ino*, found in a directory the undone layers
        made, is no creation of theirs but an object a layer knows
        (``Store.knows``): something moved it there that the records do not
        say (their steps would have taken it out first), and removing it
        with the directory would lose it.  (What the undone layers made is
        theirs to remove, whatever they recorded of it since -- a file
        written under an ignored name and renamed, or one given the number
        of a file they made and removed.)"""
        return not self.store.created_in(ino, self.undone) and self.store.knows(ino)

    def _grave(self, path: bytes, gid: int, ino: int, want: int = 0) -> bool:
        g = str(gid).encode()
        if backing.lstat_at(self.store.grave_fd, g) is None:
            with self.r.at(path) as (d, n):
                st = backing.lstat_at(d, n)
                if st is not None and st.st_ino == ino:
                    self._in(d, path, want)
                    return False  # put back already (a resumed rollback)
            raise UndoError(
                f"{_show(path)}: not restored: the removed object "
                f"(grave {gid}) is missing from the store"
            )
        with self.r.at(path) as (d, n):
            dino = self._in(d, path, want)
            backing.renameat2(self.store.grave_fd, g, d, n, backing.RENAME_NOREPLACE)
        self.touched.entry(dino, n)
        self.touched.moves.append((ino, dino, n))
        self.touched.objects.add(ino)  # (names in the grave are not counted)
        return True

    def _rename(self, src: bytes, dst: bytes, ino: int, src_dir: int = 0, dst_dir: int = 0) -> None:
        with self.r.at(dst) as (dd, dn):
            st = backing.lstat_at(dd, dn)
            if st is None or st.st_ino != ino:
                return
            ddino = self._in(dd, dst, dst_dir)
            with self.r.at(src) as (sd, sn):
                sdino = self._in(sd, src, src_dir)
                backing.renameat2(dd, dn, sd, sn, backing.RENAME_NOREPLACE)
        if stat.S_ISDIR(st.st_mode):
            self.r.moved()
        self.touched.entry(sdino, sn)
        self.touched.entry(ddino, dn)
        self.touched.moves.append((ino, sdino, sn))
        if schema.grave_id(src) is not None or schema.grave_id(dst) is not None:
            self.touched.objects.add(ino)  # (names in the grave are not counted)

    def _exchange(
        self, a: bytes, b: bytes, ino_a: int, ino_b: int, a_dir: int = 0, b_dir: int = 0
    ) -> None:
        with self.r.at(a) as (ad, an), self.r.at(b) as (bd, bn):
            sa, sb = backing.lstat_at(ad, an), backing.lstat_at(bd, bn)
            if not (
                (sa is not None and sb is not None and sa.st_ino == ino_b and sb.st_ino == ino_a)
                or (sa is not None and sb is None and sa.st_ino == ino_b)
                or (sb is not None and sa is None and sb.st_ino == ino_a)
            ):
                return
            adino, bdino = self._in(ad, a, a_dir), self._in(bd, b, b_dir)
            if sa is not None and sb is not None:
                backing.renameat2(ad, an, bd, bn, backing.RENAME_EXCHANGE)
            elif sa is not None:
                backing.renameat2(ad, an, bd, bn, backing.RENAME_NOREPLACE)
            else:
                backing.renameat2(bd, bn, ad, an, backing.RENAME_NOREPLACE)
        if any(x is not None and stat.S_ISDIR(x.st_mode) for x in (sa, sb)):
            self.r.moved()
        self.touched.entry(adino, an)
        self.touched.entry(bdino, bn)
        self.touched.moves.append((ino_a, adino, an))
        self.touched.moves.append((ino_b, bdino, bn))

    # -- objects -------------------------------------------------------------------

    @contextmanager
    def _held(self, loc: bytes, ino: int) -> Iterator[tuple[int, os.stat_result, int, bytes]]:
        """An O_PATH fd on the object at *loc*, which must be object *ino*
        (else UndoError), its stat, and its directory fd and name: a step
        acts on the object through the fd, never by its name again (the
        agent may swap names between a check and a call)."""
        with self.r.at(loc) as (d, n):
            try:
                fd = os.open(n, backing.PATH_FLAGS, dir_fd=d)
            except FileNotFoundError:
                raise UndoError(f"{_show(loc)}: object missing") from None
            try:
                st = os.fstat(fd)
                if st.st_ino != ino:
                    raise UndoError(f"{_show(loc)}: a different object is there")
                yield fd, st, d, n
            finally:
                os.close(fd)

    def _meta(self, rec: schema.Meta) -> None:
        loc, ino, size, uid, gid = rec.loc, rec.ino, rec.size, rec.uid, rec.gid
        with self._held(loc, ino) as (fd, st, _, _):
            if stat.S_ISREG(st.st_mode) and st.st_size != size:
                wfd = os.open(backing.proc(fd), os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                try:
                    os.ftruncate(wfd, size)
                finally:
                    os.close(wfd)
            if (st.st_uid, st.st_gid) != (uid, gid):
                backing.chown_fd(fd, uid, gid)
            if not stat.S_ISLNK(st.st_mode):
                backing.chmod_fd(fd, stat.S_IMODE(rec.mode))
            backing.utime_fd(fd, rec.atime_ns, rec.mtime_ns)
        self.touched.objects.add(ino)

    def _xattrs(self, loc: bytes, ino: int, blob: bytes) -> None:
        with self._held(loc, ino) as (fd, st, d, n):
            # (a symlink's by its name, as the daemon's own calls: xattr
            # calls have no form that takes an fd on a symlink)
            target = (
                backing.xattr_target(d, n) if stat.S_ISLNK(st.st_mode) else (backing.proc(fd), True)
            )
            backing.set_all_xattrs(*target, schema.decode_xattrs(blob))
        self.touched.objects.add(ino)

    def _chunk(self, rec: schema.Chunk) -> None:
        loc, ino, index, length, h = rec.loc, rec.ino, rec.chunk, rec.length, rec.digest
        C = self.store.chunk_size
        problem = schema.chunk_problem(rec, C)
        if problem is not None:
            raise UndoError(f"{_show(loc)}: its pre-image record is invalid ({problem})")
        data = None
        if h:
            data = self.store.chunk(h)
            if data is None:
                raise UndoError(f"{_show(loc)}: pre-image chunk {index} is missing")
            if len(data) != length or digest(data) != h:
                raise UndoError(f"{_show(loc)}: pre-image chunk {index} is corrupt")
        with self._held(loc, ino) as (pfd, st, _, _):
            if not stat.S_ISREG(st.st_mode):
                raise UndoError(f"{_show(loc)}: not a regular file")
            fd = os.open(backing.proc(pfd), os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                off = index * C
                size = os.fstat(fd).st_size
                if data is None and length > C:
                    # a range of zeros (of TiBs, maybe): only what holds data
                    # now is punched out (the size is the META record's)
                    zero_data(fd, off, min(off + length, size))
                elif data is None:
                    backing.punch_hole(fd, off, min(length, max(0, size - off)))
                else:
                    write_sparse(fd, data, off, size)
            finally:
                os.close(fd)
        self.touched.objects.add(ino)


PAGE = 4096
_ZERO_PAGE = bytes(PAGE)


def zero_data(fd: int, lo: int, hi: int) -> None:
    """Make [lo, hi) read as zeros by punching out the ranges that hold
    data (SEEK_DATA): what it costs follows what the file holds there."""
    pos = lo
    while pos < hi:
        found = backing.next_data(fd, pos, hi)
        if found is None:
            return
        backing.punch_hole(fd, found[0], found[1] - found[0])
        pos = found[1]


def write_sparse(fd: int, data: bytes, off: int, size: int) -> None:
    """Write *data* at *off*, leaving (or punching) holes where whole pages
    are zeros, so sparse files stay sparse."""
    view = memoryview(data)
    pos = 0
    while pos < len(data):
        end = min(pos + PAGE, len(data))
        zero = view[pos:end] == _ZERO_PAGE[: end - pos]
        run_end = end
        while run_end < len(data):
            nxt = min(run_end + PAGE, len(data))
            if (view[run_end:nxt] == _ZERO_PAGE[: nxt - run_end]) != zero:
                break
            run_end = nxt
        if not zero:
            os.pwrite(fd, view[pos:run_end], off + pos)
        elif off + pos < size:
            backing.punch_hole(fd, off + pos, min(run_end, size - off) - pos)
        pos = run_end


def _show(loc: bytes) -> str:
    gid = schema.grave_id(loc)
    if gid is not None:
        return f"<removed object {gid}>"
    return quote(loc) if loc else "."


def describe(rec: schema.Record) -> str:
    """A short human description of a record, for error reports."""
    if isinstance(rec, schema.Damaged):
        return schema.record_name(rec)
    return f"{schema.record_name(rec)} {_show(schema.record_loc(rec))}"
