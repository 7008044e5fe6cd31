"""Reading the journal: what the records since a layer was opened (time T)
say about T, in one pass, in time linear in the records.

Records name paths as they were when each was written.  To map those to
paths at T and to paths now, the reader keeps a tree of *name slots*
(``Names``): a slot is the place an object occupies in the directory tree,
and a rename moves the slot (with everything below it) instead of being
replayed on every path later -- so each record costs a walk down its own
path, whatever the number of renames before it.  A slot knows the path at T
of what it holds (its origin), or that it was made after T.
"""

from __future__ import annotations

import logging
import stat
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from . import schema
from .zeros import ChunkMap

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger(__name__)

_GRAVE = schema.GRAVE_PREFIX


class Slot:
    """A place in the tree (see ``Names``).  Where an object was made after
    T and nothing else is known of its place (a new file, or a directory
    no record has named anything in yet), its parent's ``children`` hold
    LEAF for it instead of a slot of its own (some 90 bytes less a new
    file): it is made into one when its path is looked up."""

    __slots__ = ("name", "parent", "children", "origin", "vacated", "made")

    def __init__(self, name: bytes, parent: Slot | None, origin: bytes | None):
        self.name = name
        self.parent = parent
        self.origin = origin  # the path at T of what is here, if it was
        self.children: dict[bytes, Slot] | None = None  # (made with the first)
        self.vacated: set[bytes] | None = None  # names whose holder at T has left
        self.made = False  # listed in a reading's ``created``


# a slot made after T, with nothing known of it but its name (see ``Slot``)
LEAF: Any = object()


class Names:
    """The directory tree as far as the journal has named it, followed
    through renames, exchanges and removals in record order.

    ``slot(path)`` is the slot at *path* as the tree stands now (made on
    first use: an untouched name holds what it held at T, unless the object
    that had that name at T has left it -- then what is there was made
    after T).  ``move``/``exchange``/``remove`` change the tree as the
    recorded operations did.  ``where(slot)`` is the slot's path now;
    ``now(path_at_T)`` where the object that was at that path at T is now.
    Each costs a walk along one path.
    """

    def __init__(self) -> None:
        self.root = Slot(b"", None, b"")
        self.by_origin: dict[bytes, Slot] = {b"": self.root}
        # path -> slot, for slots at those paths now that had slots looked
        # up below them (directories: a layer of many files holds no entry
        # per file): a move of a slot that has slots below it empties it,
        # any other move drops one entry
        self._at: dict[bytes, Slot] = {b"": self.root}
        # what was made after T: slots, and the slots whose children
        # include LEAFs (``made``)
        self.made_slots: list[Slot] = []
        self.leaf_dirs: dict[Slot, None] = {}

    def slot(self, path: bytes) -> Slot:
        at = self._at
        s = at.get(path)
        if s is not None:
            return s
        parent_path, _, name = path.rpartition(b"/")
        p = at.get(parent_path)
        if p is None:
            # (from the nearest directory above with a slot at hand, down:
            # no recursion, whatever the depth)
            above = [parent_path]
            while True:
                up = above[-1].rpartition(b"/")[0]
                p = at.get(up)
                if p is not None:
                    break
                above.append(up)
            for d in reversed(above):
                p = at[d] = self._child(p, d.rpartition(b"/")[2])
        return self._child(p, name)

    def _child(self, p: Slot, name: bytes) -> Slot:
        """The slot of *name* in directory slot *p* (see ``slot``)."""
        children = p.children
        if children is None:
            children = p.children = {}
        s = children.get(name)
        if s is LEAF:  # (made into a slot, made after T)
            s = children[name] = Slot(name, p, None)
            s.made = True
            self.made_slots.append(s)
        elif s is None:
            origin = p.origin
            if origin is not None:
                if p.vacated and name in p.vacated:
                    origin = None
                else:
                    origin = origin + b"/" + name if origin else name
            s = children[name] = Slot(name, p, origin)
            if origin is not None:
                self.by_origin[origin] = s
        return s

    def _moved(self, s: Slot, path: bytes) -> None:
        """Slot *s* leaves *path*: forget where it and what is below it were."""
        if s.children:
            self._at.clear()
            self._at[b""] = self.root
        else:
            self._at.pop(path, None)

    def back(self, path: bytes) -> bytes | None:
        """The path at T of what is at *path* now (None: made after T)."""
        return self.slot(path).origin

    def detach(self, path: bytes) -> Slot:
        """Take the slot at *path* (and what is below it) out of the tree."""
        s = self.slot(path)
        p = s.parent
        self._moved(s, path)
        if p is not None:
            assert p.children is not None  # (it is one of them)
            del p.children[s.name]
            if p.vacated is None:
                p.vacated = set()
            p.vacated.add(s.name)
            s.parent = None
        return s

    def attach(self, s: Slot, path: bytes) -> None:
        """Put slot *s* at *path*; whatever was there is replaced."""
        parent_path, _, name = path.rpartition(b"/")
        p = self.slot(parent_path)
        if p.children is None:
            p.children = {}
        old = p.children.get(name)
        if old is LEAF:
            self._at.pop(path, None)
        elif old is not None:
            self._moved(old, path)
            old.parent = None
        elif p.origin is not None:
            if p.vacated is None:
                p.vacated = set()
            p.vacated.add(name)  # (nothing there now comes from T)
        p.children[name] = s
        s.parent, s.name = p, name
        if s.children:  # (what is below it is found by walking from here)
            self._moved(s, path)
        self._at[path] = s

    def move(self, a: bytes, b: bytes) -> None:
        if a != b:
            self.attach(self.detach(a), b)

    def exchange(self, a: bytes, b: bytes) -> None:
        sa, sb = self.detach(a), self.detach(b)
        self.attach(sa, b)
        self.attach(sb, a)

    def prune(self, path: bytes) -> None:
        """Take everything below *path* out of the tree."""
        s = self.slot(path)
        self._moved(s, path)
        for child in (s.children or {}).values():
            if child is not LEAF:
                child.parent = None
        s.children = None
        self._at[path] = s

    def remove(self, path: bytes) -> None:
        """The object at *path* left the tree (into the grave)."""
        self.detach(path)

    def where(self, s: Slot) -> bytes | None:
        """The path of slot *s* now; None once it has left the tree."""
        parts = []
        while s.parent is not None:
            parts.append(s.name)
            s = s.parent
        if s is not self.root:  # it, or a directory above it, was taken out
            return None
        return b"/".join(reversed(parts))

    def made(self) -> Iterator[bytes]:
        """The paths now of what was made after T and is still in the tree
        (each once; in no particular order)."""
        for head, name in self.made_in():
            yield name if head is None else head + b"/" + name if head else name

    def made_in(self) -> Iterator[tuple[bytes | None, bytes]]:
        """``made`` as (the directory's path now, the name in it) -- a name
        this reading holds, the same object for every path of a directory
        -- or (None, the path)."""
        for s in self.made_slots:
            where = self.where(s)
            if where is not None:
                yield None, where
        for p in self.leaf_dirs:
            children = p.children
            if not children:
                continue
            where = self.where(p)
            if where is None:
                continue
            for name, c in children.items():
                if c is LEAF:
                    yield where, name

    def now(self, path: bytes) -> bytes | None:
        """Where the object that was at *path* at T is now (None: it left
        the tree, or a directory above it did)."""
        rest: list[bytes] = []
        p = path
        while True:
            s = self.by_origin.get(p)
            if s is not None:
                here = self.where(s)
                if here is None:
                    return None
                tail = b"/".join(reversed(rest))
                return (here + b"/" + tail if here else tail) if rest else here
            p, _, name = p.rpartition(b"/")
            rest.append(name)


class MetaAt(NamedTuple):
    seq: int
    rec: schema.Meta


class Reading:
    """What the records since T say, read once in order:

    * ``start``: path at T -> the object (backing inode) there at T, or None
      where the records show nothing was;
    * ``created()``: the paths now of what was made after T;
    * ``linked``: slots where hard links were made after T;
    * ``meta`` (ino -> its META record and that record's seq), ``chunks`` (ino -> a
      ``ChunkMap``: chunk index -> (length, digest), and the ranges of
      zeros records span), ``xattrs`` (ino -> blob): the first record of
      each (of each chunk) after T, which holds the object's state at T;
    * ``graves``: ino -> the grave ids it was moved into, in order;
    * ``removed``: ino -> how many of the names it had at T were removed
      since (moved into the grave): a name made after T and removed again
      is not one of them.
    """

    def __init__(self, records: Iterable[tuple[int, schema.Record]], chunk_size: int):
        self.C = chunk_size
        self.names = Names()
        self.start: dict[bytes, int | None] = {}
        self.linked: list[Slot] = []
        self.meta: dict[int, MetaAt] = {}
        # the smallest size a regular file had at a META record since T: its
        # bytes at T past it that no record holds were holes (a truncation
        # records only the cut chunks that hold data), whatever is there now
        self.low: dict[int, int] = {}
        self.chunks: dict[int, ChunkMap] = {}
        self.xattrs: dict[int, bytes] = {}
        self.graves: dict[int, list[int]] = {}
        self.removed: dict[int, int] = {}
        self.feed(records)

    def feed(self, records: Iterable[tuple[int, schema.Record]]) -> int:
        """Read *records* (the ones after those read so far, in order);
        return how many there were.  Queries never change what a reading
        holds, so one kept between them and fed what is written meanwhile
        says what one read afresh would."""
        read = self._READ
        n = 0
        for seq, rec in records:
            n += 1
            f = read.get(type(rec))
            if f is not None:  # (a damaged record says nothing)
                f(self, seq, rec)
        return n

    def _seen(self, path: bytes, ino: int | None) -> Slot | None:
        """*path* (as named when the record was written) held *ino* just
        before (None: nothing); note what that says about T."""
        if path.startswith(_GRAVE):
            return None
        s = self.names.slot(path)
        if s.origin is not None and s.origin not in self.start:
            self.start[s.origin] = ino
        return s

    def created(self) -> Iterator[bytes]:
        """The paths now of what was made after T (``Names.made``)."""
        return self.names.made()

    def _create(self, seq: int, rec: schema.Create | schema.Link) -> None:
        path = rec.path
        if type(rec) is schema.Create and not path.startswith(_GRAVE):
            # A name nothing was recorded at yet: the parent holds a LEAF
            # for what was made there (nothing was there at T: ``start``
            # says so where the parent is from T).
            names = self.names
            head, _, name = path.rpartition(b"/")
            p = names.slot(head)
            children = p.children
            if children is None:
                children = p.children = {}
            if name not in children:
                origin = p.origin
                if origin is not None and not (p.vacated and name in p.vacated):
                    origin = origin + b"/" + name if origin else name
                    if origin not in self.start:
                        self.start[origin] = None
                children[name] = LEAF
                if p not in names.leaf_dirs:
                    names.leaf_dirs[p] = None
                return
        s = self._seen(path, None)
        if s is not None:
            self._made(s)
            if type(rec) is schema.Link:
                self.linked.append(s)
            origin = s.origin
            if origin is not None:
                # What is here now was not here at T (``start`` says so), nor
                # was anything that will be named below it: such slots need
                # no origin, and a layer of many new files keeps no path at T
                # for each.
                # (Slots a query named below it before it was made -- the
                # path of a file asked about -- lose theirs too.)
                by_origin = self.names.by_origin
                todo = [s]
                while todo:
                    t = todo.pop()
                    if t.origin is not None and by_origin.get(t.origin) is t:
                        del by_origin[t.origin]
                    t.origin = None
                    if t.children:
                        todo.extend(c for c in t.children.values() if c is not LEAF)

    def _grave(self, seq: int, rec: schema.Grave) -> None:
        s = self._seen(rec.path, rec.ino)
        if s is not None:
            if s.origin is not None and self.start.get(s.origin) == rec.ino:
                self.removed[rec.ino] = self.removed.get(rec.ino, 0) + 1
            self.names.remove(rec.path)
        self.graves.setdefault(rec.ino, []).append(rec.grave)

    def _rename(self, seq: int, rec: schema.Rename) -> None:
        s = self._seen(rec.src, rec.ino)
        self._seen(rec.dst, None)
        self.names.move(rec.src, rec.dst)
        self._made(s if s is not None else self.names.slot(rec.dst))

    def _made(self, s: Slot) -> None:
        if not s.made:
            s.made = True
            self.names.made_slots.append(s)

    def _exchange(self, seq: int, rec: schema.Exchange) -> None:
        self._seen(rec.a, rec.ino_a)
        self._seen(rec.b, rec.ino_b)
        self.names.exchange(rec.a, rec.b)

    def _meta(self, seq: int, rec: schema.Meta) -> None:
        self._seen(rec.loc, rec.ino)
        if rec.ino not in self.meta:
            self.meta[rec.ino] = MetaAt(seq, rec)
        if stat.S_ISREG(rec.mode):
            low = self.low.get(rec.ino)
            if low is None or rec.size < low:
                self.low[rec.ino] = rec.size

    def _chunk(self, seq: int, rec: schema.Chunk) -> None:
        m = self.chunks.get(rec.ino)
        if m is None:
            m = self.chunks[rec.ino] = ChunkMap(self.C)
        m.add(rec.chunk, rec.length, rec.digest)

    def _xattrs(self, seq: int, rec: schema.Xattrs) -> None:
        self.xattrs.setdefault(rec.ino, rec.blob)

    # what each kind of record says (by type: this runs for every record)
    _READ: dict[type, Callable[[Reading, int, Any], None]] = {
        schema.Create: _create,
        schema.Link: _create,
        schema.Grave: _grave,
        schema.Rename: _rename,
        schema.Exchange: _exchange,
        schema.Meta: _meta,
        schema.Chunk: _chunk,
        schema.Xattrs: _xattrs,
    }

    def touched(self) -> set[bytes]:
        """Every path (now) whose state the records describe: where each
        object named at T is now and the path it had, and every path where
        something was made."""
        out: set[bytes] = set()
        for path, ino in self.start.items():
            if ino is not None:
                out.add(path)
                now = self.names.now(path)
                if now is not None:
                    out.add(now)
        out.update(self.created())
        out.discard(b"")
        return out


class _Entry:
    """A kept reading: of the records from *start* up to *upto* (those in
    *waiting* not yet fed to it), as the store was at *epoch*."""

    __slots__ = ("epoch", "upto", "count", "reading", "waiting")

    def __init__(
        self,
        epoch: int,
        start: int,
        chunk_size: int,
        reading: Reading | None = None,
        count: int = 0,
    ):
        self.epoch = epoch
        self.upto = start
        self.count = count  # records read (fed or waiting)
        self.reading = reading if reading is not None else Reading((), chunk_size)
        self.waiting: list[tuple[int, schema.Record]] = []

    def catch_up(self) -> None:
        if self.waiting:
            self.reading.feed(self.waiting)
            self.waiting = []


class Readings:
    """Readings of the journal from a layer's start up to now, kept between
    requests, so that status, diff, the audit of a rollback and the
    fingerprint at unmount do not read a large layer again each time.  A
    kept reading is handed the records each write transaction appends as it
    commits (``Store.on_append``) and reads them WAIT at a time (in one go
    they stay in the processor's caches: a few microseconds a record), or
    when asked; what it missed it reads from the store.  It is dropped when
    the store's epoch moves on (records deleted or put back).  At most KEEP
    readings, of at most LIMIT records in all (a reading holds some 200
    bytes a record of a new file, more of a captured one: at most some
    30 MB kept): past that, a layer is read afresh each time (200,000
    records in about a second), and its reading is freed after the request
    -- while a request still holds it (a diff: the history and the changes),
    it is handed out again.
    """

    KEEP = 3
    LIMIT = 100_000
    WAIT = 4096

    def __init__(self, store: Store):
        self.store = store
        self._kept: dict[int, _Entry] = {}  # by start; the most recently used last
        # readings trimmed while still held: start -> (the reading, epoch,
        # records read, the next record to read)
        self._held: dict[int, tuple[weakref.ref[Reading], int, int, int]] = {}
        self._lock = threading.Lock()
        store.on_append = self._appended

    def get(self, start: int, collect: list | None = None) -> Reading:
        """What the records from sequence number *start* on say (the reading
        is the caller's to query, not to keep past the request).  When it
        reads them all from the store, they are also added to *collect*."""
        st = self.store
        with self._lock:
            e = self._kept.pop(start, None)
            end = st.next_seq
            if e is None or e.epoch != st.epoch or e.upto > end:
                e = self._still_held(start) or _Entry(st.epoch, start, st.chunk_size)
            e.catch_up()
            if e.upto < end:
                records: Iterable[tuple[int, schema.Record]] = st.records(e.upto, end)
                if collect is not None and e.upto == start:
                    records = list(records)
                    collect.extend(records)
                e.count += e.reading.feed(records)
                e.upto = end
            self._kept[start] = e
            self._trim()
            return e.reading

    def holds(self, reading: Reading) -> bool:
        """Whether *reading* is kept (else it goes with the request)."""
        with self._lock:
            return any(e.reading is reading for e in self._kept.values())

    def _still_held(self, start: int) -> _Entry | None:
        """The reading from *start* trimmed while a request held it, if one
        still does and the store is as it was (records appended since are
        read from the store)."""
        found = self._held.pop(start, None)
        if found is None:
            return None
        ref, epoch, count, upto = found
        reading = ref()
        if reading is None or epoch != self.store.epoch or upto > self.store.next_seq:
            return None
        e = _Entry(epoch, upto, self.store.chunk_size, reading, count)
        return e

    def opened(self, start: int) -> None:
        """A layer was opened at *start* (now): its reading is empty."""
        with self._lock:
            if start == self.store.next_seq:
                self._kept.pop(start, None)
                self._held.pop(start, None)
                self._kept[start] = _Entry(self.store.epoch, start, self.store.chunk_size)
                self._trim()

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._held.clear()

    def _appended(self, first: int, records: list[tuple[int, schema.Record]]) -> None:
        with self._lock:
            epoch = self.store.epoch
            trim = False
            for start, e in list(self._kept.items()):
                if e.epoch != epoch or e.upto != first:
                    continue
                e.waiting += records
                e.upto = records[-1][0] + 1
                e.count += len(records)
                if len(e.waiting) >= self.WAIT:
                    try:
                        e.catch_up()
                    except Exception:  # (never fail a write that committed)
                        log.exception("journal: dropped the kept reading from %d", start)
                        del self._kept[start]
                    trim = True
            if trim:
                self._trim()

    def _trim(self) -> None:
        kept = self._kept
        while kept and (len(kept) > self.KEEP or sum(e.count for e in kept.values()) > self.LIMIT):
            start = next(iter(kept))
            e = kept.pop(start)
            fed = e.waiting[0][0] if e.waiting else e.upto
            self._held[start] = (weakref.ref(e.reading), e.epoch, e.count - len(e.waiting), fed)
        for start in [s for s, held in self._held.items() if held[0]() is None]:
            del self._held[start]
