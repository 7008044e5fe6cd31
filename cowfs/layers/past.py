"""Reading the past without restoring it: the tree as it was when a layer
was opened, computed from the live tree and the reverse diffs recorded
since, changing nothing.

The records since layer T's start, read in the order they were written,
say which object each path held at T (a name record is written before the
first change of that name), where that object is now (renames replayed
forwards; a removed object is in the grave), and what its metadata, bytes
and xattrs were at T: the first META, CHUNK and XATTRS record of an object
after T holds its state at T (later layers capture again, from later
states).  What no record mentions is unchanged since T.
"""

from __future__ import annotations

import base64
import difflib
import errno
import heapq
import os
import stat
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

import xxhash

from ..errors import NOTHING_TO_DO, USAGE, CowfsError
from ..storage import datahash, schema
from ..storage.journal import Reading
from ..storage.store import Store
from ..storage.zeros import ChunkMap
from ..system import access, backing
from ..system.access import Requester
from ..text import CONTROL, quote
from .listing import Changes
from .treesnap import KINDS


class NotThere(CowfsError):
    """The path did not exist when the layer was opened."""

    code = NOTHING_TO_DO


class Replaced(CowfsError):
    """The object a reading of the past found at a location is no longer
    there: another object (or none) is, put there by a change nothing
    captured (at an ignored path, or while the workspace was not
    mounted).  Nothing was read from what is there now."""

    code = NOTHING_TO_DO


# how the past's bytes and names are read from a descriptor checked first
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK


def parent(path: bytes) -> bytes:
    return path.rpartition(b"/")[0]


def _at_t(name: str) -> property:
    attr = "st_" + name
    return property(lambda self: getattr(self.meta, name) if self.meta else getattr(self.now, attr))


@dataclass
class Past:
    """One object as it was at T."""

    path: bytes  # its path at T
    ino: int
    loc: bytes  # where it is now: a workspace path or a grave entry
    now: os.stat_result  # its status now
    meta: schema.Meta | None = None  # the META record holding its state at T, if any
    chunks: ChunkMap = field(default_factory=lambda: ChunkMap(1))  # (no records: any size)
    xattrs_blob: bytes | None = None
    low: int | None = None  # its smallest size since T (``Reading.low``)
    # its file handle (backing.object_id), once a descriptor of it was
    # checked (``History.held``): every later one must reach that object
    oid: bytes | None = None

    # each from the META record when there is one (the state at T), else now
    mode = _at_t("mode")
    uid = _at_t("uid")
    gid = _at_t("gid")
    size = _at_t("size")
    atime_ns = _at_t("atime_ns")
    mtime_ns = _at_t("mtime_ns")

    @property
    def kind(self) -> int:
        return stat.S_IFMT(self.mode)

    @property
    def live_bytes(self) -> bool:
        """Whether its bytes at T are its live object's (up to its size
        then): no chunk recorded since, and never cut below that size
        (past ``low``, what no record holds was a hole)."""
        return not self.chunks and (self.low is None or self.low >= self.size)


class History:
    """What the records since layer *layer_id* was opened say about that
    moment (T)."""

    def __init__(
        self,
        store: Store,
        resolver: backing.Resolver,
        layer_id: int,
        hidden: bytes | None = None,
        reading: Reading | None = None,
        start: int | None = None,
    ):
        """*reading*: of the records since the layer was opened, if the
        caller keeps one (``StackView.reading``).  *start*: the moment is
        when the record at that journal position was written (a fork
        point: its layer may have been merged into the one below since)."""
        self.store = store
        self.r = resolver
        self.hidden = hidden  # the store's name in the root, when it is there
        if start is None:
            start = store.get_layer(layer_id).start
        self.layer = layer_id
        self.j = (
            reading
            if reading is not None
            else Reading(store.records(start, store.next_seq), store.chunk_size)
        )
        self.start = self.j.start  # path at T -> object there (None: absent)
        self.graves = self.j.graves
        self._links: dict[int, int] | None = None

    def extend(self, records: Iterable[tuple[int, schema.Record]]) -> None:
        """Read *records*, the ones appended to the journal since those this
        history read (none deleted or put back meanwhile: the journal's
        epoch is the same): it then says what one made afresh would."""
        self.j.feed(records)
        self._links = None

    @property
    def links(self) -> dict[int, int]:
        """Object -> hard links made to it since T (that still exist)."""
        if self._links is None:
            self._links = {}
            for slot in self.j.linked:
                where = self.j.names.where(slot)
                st = self.r.lstat(where) if where is not None else None
                if st is not None:
                    self._links[st.st_ino] = self._links.get(st.st_ino, 0) + 1
        return self._links

    def fwd(self, p: bytes) -> bytes | None:
        """Where what was at path *p* at T is now (None: removed, or moved
        with a directory that was)."""
        return self.j.names.now(p)

    def back(self, p: bytes) -> bytes | None:
        """The path at T of what is at *p* now (None: made since)."""
        return self.j.names.back(p)

    def _past(self, path: bytes, ino: int, loc: bytes, now: os.stat_result) -> Past:
        meta = self.j.meta.get(ino)
        return Past(
            path,
            ino,
            loc,
            now,
            meta.rec if meta is not None else None,
            self.j.chunks.get(ino) or ChunkMap(self.store.chunk_size),
            self.j.xattrs.get(ino),
            self.j.low.get(ino),
        )

    def object_at(self, path: bytes) -> Past | None:
        """The object at *path* (workspace-relative, b"" the root) at T,
        or None when there was none."""
        comps = path.split(b"/") if path else []
        for i in range(1, len(comps)):  # a directory above made after T
            if self.start.get(b"/".join(comps[:i]), 0) is None:
                return None
        known = path in self.start
        ino = self.start.get(path)
        if known and ino is None:
            return None
        cur = self.fwd(path)
        st = self.r.lstat(cur) if cur is not None else None
        if cur is not None and st is not None and (not known or st.st_ino == ino):
            return self._past(path, st.st_ino, cur, st)
        if ino is not None:  # (known)
            for gid in self.graves.get(ino, []):
                loc = schema.grave_loc(gid)
                st = self.r.lstat(loc)
                if st is not None and st.st_ino == ino:
                    return self._past(path, ino, loc, st)
            raise CowfsError(
                f"{schema.show_loc(path)}: the object it held when layer "
                f"{self.layer} was opened cannot be found",
                NOTHING_TO_DO,
            )
        return None

    # -- who may see it -------------------------------------------------------------

    def _acl(self, obj: Past) -> list | None:
        if stat.S_ISLNK(obj.mode):
            return None
        return access.parse_acl(dict(self.xattrs_of(obj)).get(access.ACL_ACCESS))

    def _acl_now(self, loc: bytes, st: os.stat_result) -> list | None:
        if stat.S_ISLNK(st.st_mode):
            return None
        try:
            with self.r.at(loc) as (d, n):
                target, follow = backing.xattr_target(d, n)
                return access.parse_acl(
                    os.getxattr(target, access.ACL_ACCESS, follow_symlinks=follow)
                )
        except OSError:
            return None

    @staticmethod
    def _acl_of(fd: int, st: os.stat_result) -> list | None:
        """The access ACL of the object behind the O_PATH descriptor *fd*."""
        if stat.S_ISLNK(st.st_mode):
            return None
        try:
            return access.parse_acl(os.getxattr(backing.proc(fd), access.ACL_ACCESS))
        except OSError:
            return None

    def from_the_past(self, obj: Past) -> bool:
        """Whether all of *obj*'s content at T comes from what the records
        kept (pre-images of every chunk of a file), none of it from the
        live object -- whose bytes (or names) may be ones written since,
        uncaptured (an ignored path), under other permissions."""
        if stat.S_ISREG(obj.mode):
            # (counted before they are looked at: a file of TiBs with few
            # chunks recorded costs what was recorded, not its size)
            return obj.chunks.covers_all(-(-obj.size // self.store.chunk_size))
        return not stat.S_ISDIR(obj.mode)

    def live_readable(self, obj: Past, who: Requester) -> bool:
        """Whether *who* may read the live object *obj*'s content comes
        from (as it is now: its mode, owner and ACL)."""
        if who.root or self.from_the_past(obj):
            return True
        try:
            with self.held(obj) as (fd, st):
                return self.readable_live(who, fd, st)
        except Replaced:
            return False

    def readable_live(self, who: Requester, fd: int, st: os.stat_result) -> bool:
        """Whether *who* may read the object behind the O_PATH descriptor
        *fd* (*st* its status) as it is now: its mode, owner and ACL."""
        want = access.R | access.X if stat.S_ISDIR(st.st_mode) else access.R
        return access.permitted(who, st.st_mode, st.st_uid, st.st_gid, want, self._acl_of(fd, st))

    def readable(self, path: bytes, who: Requester) -> bool:
        """Whether *who* could have read what *path* held at T, as the
        kernel would have decided then: search permission on every
        directory above it, read permission on a file, read and search on
        a directory (a symlink, a device: the directories above)."""
        if who.root:
            return True
        comps = path.split(b"/") if path else []
        for i in range(len(comps)):
            d = self.object_at(b"/".join(comps[:i]))
            if d is None or not access.permitted(who, d.mode, d.uid, d.gid, access.X, self._acl(d)):
                return False
        obj = self.object_at(path)
        if obj is None:
            return True  # (nothing to reveal)
        if not self.live_readable(obj, who):
            return False
        want = (
            access.R | access.X
            if stat.S_ISDIR(obj.mode)
            else access.R
            if stat.S_ISREG(obj.mode)
            else 0
        )
        return not want or access.permitted(who, obj.mode, obj.uid, obj.gid, want, self._acl(obj))

    def readable_now(self, path: bytes, who: Requester) -> bool:
        """Whether *who* may read what *path* holds now (as ``readable``,
        on the tree as it is)."""
        if who.root:
            return True
        acl = self._acl_now
        comps = path.split(b"/") if path else []
        for i in range(len(comps) + 1):
            loc = b"/".join(comps[:i])
            st = self.r.lstat(loc)
            if st is None:
                return i == len(comps)  # (nothing there to reveal)
            want = (
                access.X
                if i < len(comps)
                else access.R | access.X
                if stat.S_ISDIR(st.st_mode)
                else access.R
                if stat.S_ISREG(st.st_mode)
                else 0
            )
            if want and not access.permitted(
                who, st.st_mode, st.st_uid, st.st_gid, want, acl(loc, st)
            ):
                return False
        return True

    def named(self, path: bytes, who: Requester) -> bool:
        """Whether *path* names something now, or named something at T, as
        far as *who* may tell: below a directory it may not search (now, or
        then), a path counts as named (its absence is not revealed)."""
        comps = path.split(b"/") if path else []
        if not comps:
            return True
        if comps[0] == self.hidden:
            return False
        for i in range(len(comps)):
            loc = b"/".join(comps[:i])
            st = self.r.lstat(loc)
            if st is None or not stat.S_ISDIR(st.st_mode):
                break
            if not who.root and not access.permitted(
                who, st.st_mode, st.st_uid, st.st_gid, access.X, self._acl_now(loc, st)
            ):
                return True
        else:
            if self.r.lstat(path) is not None:
                return True
        try:
            for i in range(len(comps)):
                d = self.object_at(b"/".join(comps[:i]))
                if d is None or not stat.S_ISDIR(d.mode):
                    return False
                if not who.root and not access.permitted(
                    who, d.mode, d.uid, d.gid, access.X, self._acl(d)
                ):
                    return True
            return self.object_at(path) is not None
        except CowfsError:  # (what it held then cannot be found: it held something)
            return True

    def need(self, path: bytes) -> Past:
        """The object at *path* at T; NotThere if there was none."""
        obj = self.object_at(path)
        if obj is None:
            raise NotThere(
                f"did not exist when layer {self.layer} was opened", path=os.fsdecode(path) or "."
            )
        return obj

    # -- the live objects the past is read from -----------------------------------

    @contextmanager
    def held(self, obj: Past) -> Iterator[tuple[int, os.stat_result]]:
        """An O_PATH descriptor of *obj*'s live object and its status: its
        location opened once, following no symlink, and checked to hold
        that very object -- its inode number, its kind, and its file handle
        when one was taken (the first check takes it: every later one then
        reaches the same object, not one given its freed number).
        Replaced when another object, or none, is there.  Whatever is read
        of it is read through this descriptor, never by its name again (an
        agent may rename or exchange names between a check and a read)."""
        try:
            with self.r.at(obj.loc) as (d, n):
                fd = os.open(n, backing.PATH_FLAGS, dir_fd=d)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                raise
            fd = -1  # (a directory on its path is gone, or is a symlink now)
        try:
            st = os.fstat(fd) if fd >= 0 else None
            if (
                st is None
                or st.st_ino != obj.ino
                or stat.S_IFMT(st.st_mode) != stat.S_IFMT(obj.now.st_mode)
            ):
                raise self._replaced(obj)
            oid = backing.object_id(fd)
            if obj.oid is None:
                obj.oid = oid
            elif oid != obj.oid:
                raise self._replaced(obj)
            yield fd, st
        finally:
            if fd >= 0:
                os.close(fd)

    def _replaced(self, obj: Past) -> Replaced:
        return Replaced(
            f"{schema.show_loc(obj.path)}: the object it held when layer {self.layer} was "
            f"opened is no longer at {schema.show_loc(obj.loc)} (another object is, or none: "
            "a change nothing captured); nothing read"
        )

    @contextmanager
    def opened(self, obj: Past, flags: int = READ_FLAGS) -> Iterator[int]:
        """A descriptor of *obj*'s live object to read it through (a
        regular file or a directory: ``held``, then opened again through
        that very descriptor -- never a device or fifo swapped in, never
        by its name)."""
        with self.held(obj) as (pfd, _):
            fd = os.open(backing.proc(pfd), flags)
        try:
            yield fd
        finally:
            os.close(fd)

    # -- contents -------------------------------------------------------------------

    def read(
        self, obj: Past, offset: int = 0, size: int | None = None, fd: int | None = None
    ) -> bytes:
        """The bytes of a regular file at T (live bytes with the recorded
        pre-image chunks laid over them, cut to the size at T).  *fd*: a
        descriptor of its live object from ``opened`` (else one is opened
        and checked for this read)."""
        if not stat.S_ISREG(obj.mode):
            raise CowfsError(
                f"{schema.show_loc(obj.path)} was not a regular file "
                f"when layer {self.layer} was opened",
                NOTHING_TO_DO,
            )
        end = obj.size if size is None else min(obj.size, offset + size)
        if offset >= end:
            return b""
        if fd is None:
            with self.opened(obj) as fd:
                live = os.pread(fd, end - offset, offset)
        else:
            live = os.pread(fd, end - offset, offset)
        out = bytearray(live.ljust(end - offset, b"\0"))
        if obj.low is not None and obj.low < end:
            cut = max(offset, obj.low)  # (holes then: what is there now came later)
            out[cut - offset :] = bytes(end - cut)
        C = self.store.chunk_size
        for k in range(offset // C, (end - 1) // C + 1):
            rec = obj.chunks.get(k)
            if rec is None:
                continue
            length, h = rec
            data = self.store.chunk(h) if h else bytes(length)
            if data is None:
                raise CowfsError(
                    f"{schema.show_loc(obj.path)}: its pre-image (chunk {k}) "
                    "is missing from the store",
                    NOTHING_TO_DO,
                )
            lo, hi = max(offset, k * C), min(end, k * C + length)
            out[lo - offset : hi - offset] = data[lo - k * C : hi - k * C]
        return bytes(out)

    def readlink(self, obj: Past) -> bytes:
        with self.held(obj) as (fd, _):
            return os.readlink(b"", dir_fd=fd)

    def xattrs_of(self, obj: Past) -> list[tuple[bytes, bytes]]:
        if obj.xattrs_blob is not None:
            return schema.decode_xattrs(obj.xattrs_blob)
        # (the magic link of an O_PATH descriptor leads to its object itself,
        # a symlink included: followed, it is not followed further)
        with self.held(obj) as (fd, _):
            return backing.list_xattrs(backing.proc(fd), True)

    def listdir(self, obj: Past) -> list[bytes]:
        """The names in directory *obj* at T."""
        if not stat.S_ISDIR(obj.mode):
            raise CowfsError(
                f"{schema.show_loc(obj.path)} was not a directory "
                f"when layer {self.layer} was opened",
                NOTHING_TO_DO,
            )
        names: set[bytes] = set()
        try:
            with self.opened(obj, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) as fd:
                live = [os.fsencode(x) for x in os.listdir(fd)]
        except OSError:
            live = []
        here = obj.loc if schema.grave_id(obj.loc) is None else None
        for name in live:
            if here is None:
                continue  # a directory removed after T held no live names then
            now = here + b"/" + name if here else name
            was = self.back(now)
            if was is not None and was and parent(was) == obj.path:
                names.add(was.rpartition(b"/")[2])
        for was, ino in self.start.items():
            if ino is not None and was and parent(was) == obj.path:
                names.add(was.rpartition(b"/")[2])
        return sorted(
            n
            for n in names
            if not (obj.path == b"" and n == self.hidden)
            and self.object_at(obj.path + b"/" + n if obj.path else n) is not None
        )


# -- for the control operations ----------------------------------------------------------

SHOW_PAGE = 4 << 20


def wpath(path: str) -> bytes:
    """A workspace-relative path from a request (b"" is the root)."""
    p = os.fsencode(path).strip(b"/")
    parts = [c for c in p.split(b"/") if c not in (b"", b".")]
    if b".." in parts:
        raise CowfsError(
            f"{quote(path)}: paths are relative to the workspace root, without '..'", USAGE
        )
    return b"/".join(parts)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def describe_past(h: History, obj: Past, offset: int = 0, size: int = SHOW_PAGE) -> dict:
    """The status of *obj* at T and a page of its content."""
    d = {
        "path": os.fsdecode(obj.path),
        "kind": KINDS.get(obj.kind, "unknown"),
        "object": obj.ino,  # the same for every name of one object (hard links)
        "mode": obj.mode,
        "uid": obj.uid,
        "gid": obj.gid,
        "size": obj.size,
        "atime_ns": obj.atime_ns,
        "mtime_ns": obj.mtime_ns,
        "xattrs": [[b64(n), b64(v)] for n, v in h.xattrs_of(obj)],
    }
    if stat.S_ISREG(obj.mode):
        d["offset"] = offset
        d["data"] = b64(h.read(obj, offset, size))
    elif stat.S_ISDIR(obj.mode):
        d["entries"] = [os.fsdecode(n) for n in h.listdir(obj)]
    elif stat.S_ISLNK(obj.mode):
        d["target"] = os.fsdecode(h.readlink(obj))
    elif stat.S_ISCHR(obj.mode) or stat.S_ISBLK(obj.mode):
        d["rdev"] = obj.now.st_rdev
    return d


def filter_paths(changes: Changes, paths: list[str]) -> Changes:
    """The changes under any of *paths* (workspace-relative; a directory
    takes everything below it)."""
    if not paths:
        return changes
    wanted = [os.fsdecode(wpath(p)) for p in paths]

    def under(p: str | None) -> bool:
        return p is not None and any(
            w in ("", ".") or p == w or p.startswith(w + "/") for w in wanted
        )

    return changes.where(lambda path, was: under(path) or under(was))


# what a file's blocks may fall short of its size and still count as data
SPARSE_SLACK = 1 << 20


def _dense(size: int, held: int) -> bool:
    """Whether a file of *size* is (nearly) all data, *held* bytes of it
    on disk or in the store: reading it costs what it holds.  A sparse
    file -- a TiB that holds nothing costs an agent nothing to make -- is
    not read whole: its side says "sparse" and has no hash or text."""
    return held + SPARSE_SLACK >= size


def _side(
    kind: int,
    size: int,
    mode: int,
    mtime: int,
    read: Callable[[int, int], bytes],
    hash_limit: int,
    dense: bool = True,
    data: Callable[[int], list[tuple[int, int]] | None] | None = None,
) -> dict:
    """One side of a change.  A regular file no larger than *hash_limit*
    that is (nearly) all data gets the xxh3-128 of its bytes; a sparse one
    is not read whole: it says so, and with *data* (its data ranges, up to
    a limit: None beyond) gets the digest of what it holds (``datahash``),
    reading only that."""
    d = {"kind": KINDS.get(kind, "unknown"), "mode": mode, "size": size, "mtime_ns": mtime}
    if kind == stat.S_IFREG and not dense:
        d["sparse"] = True
        ranges = data(size) if data is not None else None
        if ranges is not None:
            found = datahash.of_ranges(read, size, ranges)
            assert found is not None  # (nothing stops it)
            d["xxh3_data"] = found.hex()
    elif kind == stat.S_IFREG and size <= hash_limit:
        hasher = xxhash.xxh3_128()
        for off in range(0, size, SHOW_PAGE):
            hasher.update(read(off, SHOW_PAGE))
        d["xxh3"] = hasher.hexdigest()
    return d


def _ranges_within(
    ranges: Iterable[tuple[int, int]], size: int, limit: int
) -> list[tuple[int, int]] | None:
    """The block-aligned data ranges of a side, or None past *limit* bytes."""
    return datahash.within(datahash.aligned(ranges, size), limit)


def past_data(h: History, obj: Past, limit: int) -> list[tuple[int, int]] | None:
    """Where *obj*'s bytes at T may be other than zero, up to *limit* bytes
    of such ranges (None beyond): the ranges of its live object that hold
    data, and the chunks recorded since that are not all zeros (a chunk
    recorded as zeros reads so whatever the live object holds there)."""
    C = h.store.chunk_size
    spans = sorted(
        (k * C, min(obj.size, k * C + length))
        for k, (length, digest) in obj.chunks.one.items()
        if digest and k * C < obj.size
    )
    with h.opened(obj) as fd:
        live = obj.size if obj.low is None else min(obj.size, obj.low)
        return _ranges_within(heapq.merge(spans, backing.iter_data(fd, live)), obj.size, limit)


@contextmanager
def _held_now(h: History, path: bytes, st: os.stat_result) -> Iterator[int]:
    """An O_PATH descriptor of the object *st* describes, found at *path*
    now: the name opened once, following no symlink, checked to be that
    object."""
    with h.r.at(path) as (d, n):
        pfd = os.open(n, backing.PATH_FLAGS, dir_fd=d)
    try:
        now = os.fstat(pfd)
        if (now.st_ino, stat.S_IFMT(now.st_mode)) != (st.st_ino, stat.S_IFMT(st.st_mode)):
            raise Replaced(
                f"{schema.show_loc(path)}: another object is there than the one found a "
                "moment ago (a change nothing captured); nothing read"
            )
        yield pfd
    finally:
        os.close(pfd)


@contextmanager
def _open_now(h: History, path: bytes, st: os.stat_result) -> Iterator[int]:
    """A descriptor to read the object *st* describes, found at *path* now
    (``_held_now``, opened again through that descriptor)."""
    with _held_now(h, path, st) as pfd:
        fd = os.open(backing.proc(pfd), READ_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)


def _is_text(data: bytes, head: bool = False) -> bool:
    """Whether *data* is text: no NUL in its first 64 KiB, and UTF-8 (*head*:
    the first bytes of a longer file, which may end within a character)."""
    if b"\0" in data[:TEXT_SAMPLE]:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return head and e.start >= len(data) - 3 and e.reason == "unexpected end of data"
    return True


# what is read of a file too large for a text diff to tell text from binary
TEXT_SAMPLE = 64 << 10


# difflib's matching costs about lines x changed lines (measured: 20,000
# lines with every tenth changed took 5.5 s, 100,000 took 187 s; 500,000
# with three changed took 1.2 s): a text diff is made only below this
# product, about two seconds; larger ones are said to be too large
MAX_DIFF_WORK = 30_000_000


def diff_entry(
    h: History, change: dict, text_limit: int, hash_limit: int = 1 << 62, data_limit: int = 0
) -> dict:
    """One change (from StackView.changes_since) with both sides: kind, mode,
    size, mtime and xxh3 of regular files, the target of symlinks; for text
    no larger than *text_limit*, a unified diff and the lines added and
    removed (of a symlink: its target, as git shows it)."""
    out, finish = diff_sides(h, change, text_limit, hash_limit, data_limit)
    if finish is not None:
        finish()
    return out


def diff_sides(
    h: History,
    change: dict,
    text_limit: int,
    hash_limit: int = 1 << 62,
    data_limit: int = 0,
    sample: bool = False,
) -> tuple[dict, Callable[[], None] | None]:
    """``diff_entry`` in two parts: what reads the tree and the store (to
    run while the tree holds still), and a function that computes the text
    diff from the bytes read (None: nothing to compute), which touches
    neither and may run while file requests are served.  A sparse side
    holding at most *data_limit* bytes of data (in 4 KiB blocks) gets the
    digest of what it holds (``xxh3_data``, see ``datahash``).  *sample*:
    a file larger than *text_limit* has its first TEXT_SAMPLE bytes read,
    and when every side is text the change says so: not binary, too large
    (``too_large``) for the limit (``text_limit``)."""
    out = dict(change)
    new_path = os.fsencode(change["path"]) if change["path"] != "." else b""
    old_path = os.fsencode(change["from"]) if change.get("from") else new_path
    old = h.object_at(old_path) if change["kind"] != "A" else None
    new_st = h.r.lstat(new_path) if change["kind"] != "D" else None
    old_bytes = new_bytes = None
    heads: dict[str, bytes] = {}  # the first bytes of a side too large to diff
    if old is not None:
        held = old.now.st_blocks * 512 + len(old.chunks.one) * h.store.chunk_size
        old_dense = _dense(old.size, held)
        out["old"] = _side(
            old.kind,
            old.size,
            old.mode,
            old.mtime_ns,
            lambda o, n: h.read(old, o, n),
            hash_limit,
            old_dense,
            (lambda size: past_data(h, old, data_limit)) if data_limit > 0 else None,
        )
        if old.kind == stat.S_IFREG and old_dense:
            if old.size <= text_limit:
                old_bytes = h.read(old)
            elif sample:
                heads["old"] = h.read(old, 0, TEXT_SAMPLE)
        elif old.kind == stat.S_IFLNK:
            with suppress(Replaced, OSError):  # (then no target: the rest still says it)
                out["old"]["target"] = os.fsdecode(h.readlink(old))
    if new_st is not None:

        def read_new(o: int, n: int) -> bytes:
            with _open_now(h, new_path, new_st) as fd:
                return os.pread(fd, n, o)

        def new_data(size: int) -> list[tuple[int, int]] | None:
            with _open_now(h, new_path, new_st) as fd:
                return _ranges_within(backing.iter_data(fd, size), size, data_limit)

        new_dense = _dense(new_st.st_size, new_st.st_blocks * 512)
        out["new"] = _side(
            stat.S_IFMT(new_st.st_mode),
            new_st.st_size,
            new_st.st_mode,
            new_st.st_mtime_ns,
            read_new,
            hash_limit,
            new_dense,
            new_data if data_limit > 0 else None,
        )
        if stat.S_ISREG(new_st.st_mode) and new_dense:
            if new_st.st_size <= text_limit:
                new_bytes = read_new(0, new_st.st_size)
            elif sample:
                heads["new"] = read_new(0, TEXT_SAMPLE)
        elif stat.S_ISLNK(new_st.st_mode):
            with suppress(Replaced, OSError):
                out["new"]["target"] = os.fsdecode(_readlink_now(h, new_path, new_st))
    names = (
        f"a/{os.fsdecode(old_path)}" if old else "/dev/null",
        f"b/{change['path']}" if new_st else "/dev/null",
    )
    present = [
        (side, data) for side, data in (("old", old_bytes), ("new", new_bytes)) if side in out
    ]
    kinds = {out[side]["kind"] for side, _ in present}
    if kinds == {"symlink"} and all("target" in out[side] for side, _ in present):
        # its target as the content, as git shows it
        out["binary"] = False
        a, b = ([printable_target(out[s]["target"])] if s in out else [] for s in ("old", "new"))
        if a != b:
            _unified(out, a, b, names)
        return out, None
    files = bool(present) and kinds == {"file"}

    def text(side: str, data: bytes | None) -> bool:
        head = heads.get(side)
        return _is_text(head, True) if head is not None else data is not None and _is_text(data)

    if files and heads and all(text(side, data) for side, data in present):
        out["binary"] = False
        out["too_large"] = True  # (sizes and hashes say what changed)
        out["text_limit"] = text_limit
        return out, None
    if not (files and all(text(side, data) for side, data in present)):
        out["binary"] = any(out.get(s, {}).get("kind") == "file" for s in ("old", "new"))
        return out, None
    out["binary"] = False

    def finish() -> None:
        if not old_bytes or not new_bytes:  # (against nothing: every line, made at once)
            _one_sided(out, (old_bytes or new_bytes or b"").decode(), bool(new_bytes), names)
            return
        a = old_bytes.decode().splitlines(keepends=True)
        b = new_bytes.decode().splitlines(keepends=True)
        changed = Counter(a)
        changed.subtract(b)
        if max(len(a), len(b)) * sum(map(abs, changed.values())) > MAX_DIFF_WORK:
            out["too_large"] = True  # (sizes and hashes say what changed)
            return
        _unified(out, a, b, names)

    return out, finish


def _one_sided(out: dict, text: str, added: bool, names: tuple[str, str]) -> None:
    """The unified diff of a text against nothing (*added*: the new side is
    *text*), as difflib makes it, made from the text in one piece: some
    three times its size at the most, not an object per line."""
    if not text:
        out["diff"], out["added"], out["removed"] = "", 0, 0
        return
    n = text.count("\n") + (not text.endswith("\n"))
    sign = "+" if added else "-"
    body = sign + text.replace("\n", "\n" + sign)
    body = body[:-1] if text.endswith("\n") else body + "\n\\ No newline at end of file\n"
    span = f"1,{n}" if n > 1 else "1"
    hunk = f"@@ -0,0 +{span} @@\n" if added else f"@@ -{span} +0,0 @@\n"
    out["diff"] = f"--- {names[0]}\n+++ {names[1]}\n{hunk}{body}"
    out["added"], out["removed"] = (n, 0) if added else (0, n)


def _unified(out: dict, a: list[str], b: list[str], names: tuple[str, str]) -> None:
    """The unified diff of lines *a* and *b* into change *out*: its text and
    the lines added and removed."""
    lines = list(difflib.unified_diff(a, b, *names))
    out["diff"] = "".join(
        x if x.endswith("\n") else x + "\n\\ No newline at end of file\n" for x in lines
    )
    out["added"] = sum(1 for x in lines if x.startswith("+") and not x.startswith("+++"))
    out["removed"] = sum(1 for x in lines if x.startswith("-") and not x.startswith("---"))


def printable_target(target: str) -> str:
    """A symlink's target as a line of its diff: as it is, or quoted
    (``text.quote``) when it holds what a line may not (a newline, bytes
    that are not UTF-8); the side's "target" keeps it exactly."""
    return quote(target) if CONTROL.search(target) else target


def _readlink_now(h: History, path: bytes, st: os.stat_result) -> bytes:
    """The target of the symlink *st* describes, found at *path* now."""
    with _held_now(h, path, st) as fd:
        return os.readlink(b"", dir_fd=fd)
