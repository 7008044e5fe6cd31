"""Capture: writing reverse diffs into the open (top) layer before a change
reaches the backing directory.

Objects are identified by their backing inode number.  Within one layer that
identity is stable: an object that existed when the layer was opened is never
freed while the layer exists (removing it moves it into the grave), so its
inode number cannot be reused.

The ``Recorder`` keeps, for the open layer, what each object has already had
captured (metadata, xattrs, which chunks), so a later change of the same
chunk or attribute costs one dictionary lookup and records nothing.  It keeps
that for the objects changed last (``Recorder.KEEP``); the others' state is
read back from the layer's index when they change again.

A file captured whole (opened for writing through passthrough, whose writes
the daemon never sees) is walked with SEEK_DATA/SEEK_HOLE: each chunk that
holds data is recorded, each run of holes is one CHUNK record of zeros
spanning it (indexed ``IDX_ZEROS``), so what it costs, and what is kept of
it in memory, follows what the file holds, not the size it claims.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import os
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from ..storage import schema
from ..storage.store import Store, Writer, scan
from ..storage.zeros import Zeros
from . import redo
from .ignore import IgnoreRules

Loc = Callable[[], bytes]


class Obj:
    """What the open layer holds for one object."""

    __slots__ = (
        "created",
        "meta",
        "s0",
        "xattrs",
        "chunks",
        "zeros",
        "attributed",
        "pinned",
        "older",
    )

    def __init__(self) -> None:
        self.attributed = False
        self.pinned = False
        self.created = False
        self.meta = False
        self.s0 = 0
        self.xattrs = False
        self.chunks: set[int] | None = None  # (made on the first chunk)
        self.zeros: Zeros | None = None  # ranges of zeros captured (bytes; made on the first)
        # whether a layer below the open one knows it (see ``Recorder.known``;
        # None: not asked yet -- they do not change while it is open)
        self.older: bool | None = None


class Saved(NamedTuple):
    """An object's capture state before the transaction under way changed
    it: put back if the transaction fails (``Recorder.txn``)."""

    created: bool
    meta: bool
    s0: int
    xattrs: bool
    chunks: set[int] | None
    zeros: Zeros | None
    attributed: bool
    pinned: bool

    @classmethod
    def of(cls, o: Obj) -> Saved:
        return cls(
            o.created,
            o.meta,
            o.s0,
            o.xattrs,
            set(o.chunks) if o.chunks is not None else None,
            o.zeros.copy() if o.zeros is not None else None,
            o.attributed,
            o.pinned,
        )

    def put_back(self, o: Obj) -> None:
        o.created, o.meta, o.s0, o.xattrs = self.created, self.meta, self.s0, self.xattrs
        o.chunks, o.zeros = self.chunks, self.zeros
        o.attributed, o.pinned = self.attributed, self.pinned


class Process(NamedTuple):
    """A process that changed something: (pid, start time), which tells it
    from a later one given its pid, and what the store keeps of it."""

    key: tuple[int, int]
    info: dict[str, Any]  # {"pid": int, "uid": int, "cmd": [str, ...]}


class Recorder:
    # Objects whose state is kept in memory (some 170 bytes each): past
    # that, the half changed first is forgotten after a transaction, when
    # the store holds all of it (the objects of a layer of 200,000 new files
    # took 70 MB).  $COWFS_CAPTURE_KEEP (2 or more) for tests that want it
    # forgotten in a small layer.
    _keep = os.environ.get("COWFS_CAPTURE_KEEP", "")
    KEEP = int(_keep) if _keep.isdigit() and int(_keep) >= 2 else 32_768

    def __init__(self, store: Store, follow: bool = True):
        """*follow*: follow the store's top layer now (else at ``reset``)."""
        self.store = store
        self.C = store.chunk_size
        self._zero = bytes(self.C)
        self.layer = 0
        self.below: int | None = None  # the open layer, under a segment
        self.objs: dict[int, Obj] = {}
        self.fresh = False
        # objects treated as new because first changed at an ignored path
        # (memory only: kept apart from ``objs``, which forgets)
        self.skipped: set[int] = set()
        self._pending_created: list[tuple[int, Process | None, bool]] = []
        self._saved: dict[int, Saved] = {}
        self.who: tuple[int, int] | None = None  # (pid, uid) of the request
        self.ignore: IgnoreRules | None = None  # when there are any
        self.matched = False  # whether the path the last ``ignored`` asked of matched
        self._writers: dict[tuple[int, int], int] = {}  # (pid, start time) -> writer id
        self._procs: dict[tuple[int, int], dict[str, Any]] = {}  # Process.key -> its info
        # pid -> (until when it is taken as it is, its ``_process`` answer)
        self._recent: dict[int, tuple[float, Process]] = {}
        if follow:
            self.reset(fresh=False)

    def reset(self, fresh: bool) -> None:
        """Follow the store's top layer.  *fresh*: the layer was opened by
        this process, so memory knows everything it holds.  While the last
        rollback can be redone, changes are captured under the index of its
        segment (see ``redo``) as if a layer had been opened then; an
        object the open layer saw at a captured path stays captured."""
        top = self.store.top()
        seg = redo.segment(self.store)
        self.layer = seg if seg is not None else top.id if top else 0
        self.below = top.id if seg is not None and top else None
        self.objs = {}
        self.skipped = set()
        self.fresh = fresh
        self._pending_created = []

    # -- object state -------------------------------------------------------

    def obj(self, ino: int) -> Obj:
        o = self.objs.get(ino)
        if o is None:
            o = Obj()
            if not self.fresh:
                self._load(ino, o)
            if self.below is not None and not o.pinned:
                o.pinned = self._pinned_in(self.below, ino)
            self.objs[ino] = o
        return o

    def _pinned_in(self, layer: int, ino: int) -> bool:
        """Whether layer *layer* pinned object *ino* (``schema.pins``)."""
        with self.store.read() as txn:
            for kind in (schema.IDX_PINNED, schema.IDX_CREATED):
                key = schema.index_key(layer, ino, kind)
                raw = txn.get(key, db=self.store.db_index)
                if raw is not None and schema.pins(kind, schema.index_seq(key, raw)):
                    return True
        return False

    def _load(self, ino: int, o: Obj) -> None:
        if ino in self.skipped:
            o.created = True
            return
        with self.store.read() as txn:
            for key, value in scan(txn, self.store.db_index, schema.index_prefix(self.layer, ino)):
                _, _, kind, chunk = schema.split_index_key(key)
                seq = schema.index_seq(key, value)
                if seq is None:
                    continue  # (damaged: not trusted, the object is captured again)
                if kind == schema.IDX_CREATED:
                    o.created = o.attributed = True  # (as note_created left it)
                    o.pinned = o.pinned or seq == schema.CREATED_NAMED
                elif kind == schema.IDX_PINNED:
                    o.pinned = True
                elif kind == schema.IDX_META:
                    raw = txn.get(schema.u64(seq), db=self.store.db_journal)
                    rec = schema.decode_or_damaged(raw or b"")
                    o.meta = True
                    # a damaged record: the object cannot be restored anyway
                    o.s0 = rec.size if isinstance(rec, schema.Meta) else 0
                elif kind == schema.IDX_XATTRS:
                    o.xattrs = True
                elif kind == schema.IDX_CHUNK and chunk is not None:
                    if o.chunks is None:
                        o.chunks = set()
                    o.chunks.add(chunk)
                elif kind == schema.IDX_ZEROS:
                    raw = txn.get(schema.u64(seq), db=self.store.db_journal)
                    rec = schema.decode_or_damaged(raw or b"")
                    if isinstance(rec, schema.Chunk) and not rec.digest:
                        if o.zeros is None:
                            o.zeros = Zeros()
                        o.zeros.add(rec.chunk * self.C, rec.chunk * self.C + rec.length)
                    # (else: not trusted, what it covers is captured again)

    def write_is_captured(self, ino: int, off: int, size: int) -> bool:
        """Fast path: True when a write of [off, off+size) needs no capture."""
        o = self.objs.get(ino)
        if o is None:
            return False
        if o.created:
            return True
        if not o.meta:
            return False
        if off >= o.s0:
            return True
        chunks, zeros = o.chunks, o.zeros
        if chunks is None and zeros is None:
            return False
        C = self.C
        end = min(off + size, o.s0)
        for k in range(off // C, (end - 1) // C + 1):
            if (chunks is None or k not in chunks) and (zeros is None or not zeros.covers(k * C)):
                return False
        return True

    # -- transactions -----------------------------------------------------------

    @contextmanager
    def txn(self) -> Iterator[Writer]:
        """A store transaction for captures.  If it fails, what memory says
        was captured in it is forgotten again, so nothing is believed
        captured that the store does not hold."""
        self._saved = {}
        try:
            with self.store.write() as w:
                if self._pending_created:
                    for ino, who, named in self._pending_created:
                        made = schema.CREATED_NAMED if named else 0
                        w.index_put(self.layer, ino, schema.IDX_CREATED, made)
                        if who is not None:
                            w.who_put(self.layer, ino, self._writer(w, who))
                yield w
        except BaseException:
            for ino, saved in self._saved.items():
                saved.put_back(self.objs[ino])
            raise
        finally:
            self._saved = {}
        self._pending_created = []
        if len(self.objs) > self.KEEP:
            self._forget()

    def _forget(self) -> None:
        """Forget the half of ``objs`` changed first (after a transaction:
        the store holds everything memory says of them)."""
        objs = self.objs
        old = list(itertools.islice(objs, len(objs) - self.KEEP // 2))
        for ino in old:
            del objs[ino]
        self.fresh = False  # (what memory lacks is read from the index)

    def _changing(self, ino: int, o: Obj) -> None:
        if ino not in self._saved:
            self._saved[ino] = Saved.of(o)

    def flush(self) -> None:
        """Write index entries still held in memory (before a layer switch).
        Best effort: without them (a full store), later changes of those new
        objects are merely captured needlessly, and they are not attributed."""
        if self._pending_created:
            try:
                with self.txn():
                    pass
            except OSError:
                self._pending_created = []

    def note_created(self, ino: int, named: bool = False) -> None:
        """*ino* was created in this layer: nothing of it needs capturing.
        *named*: a CREATE record names it (made at a captured path): with
        ignore rules, it is pinned too, so that its name changes are
        recorded wherever it goes (the CREATE step must find it where the
        record says).  (The index entries are written with the next
        transaction; if they are lost in a crash, later changes are merely
        captured needlessly.)"""
        o = self.objs.get(ino)
        if o is None or not o.pinned and named:
            # (new: whatever memory or the store says of an earlier object
            # given this number is moot -- one made at an ignored path and
            # removed there uncaptured, say, which would leave a file made
            # at a captured path unpinned)
            o = self.objs[ino] = Obj()
            o.older = False  # (nor what older layers say of it)
            self.skipped.discard(ino)
        if not o.created:
            o.created = True
            o.attributed = True
            named = named and self.ignore is not None
            o.pinned = o.pinned or named
            self._pending_created.append(
                (ino, self._process(self.who) if self.who is not None else None, named)
            )

    # -- capture filters (cowfs/layers/ignore.py) -------------------------------------------

    def ignored(
        self, path: bytes | Loc, is_dir: bool, ino: int | None = None, parent: int | None = None
    ) -> bool:
        """Whether a change of *path* (or of the path a function gives; of
        object *ino*, a name in directory *parent*) goes uncaptured: the
        path matches, and neither the object nor the directory is known to
        a layer (``known``) -- what records name is never changed behind
        their back: a name step would act on whatever took its place, and
        an object freed uncaptured could have its inode number given to
        another, which the steps would take for it."""
        self.matched = self.ignore is not None and self.ignore.matches(path, is_dir)
        if not self.matched:
            return False
        if ino is not None and self.known(ino):
            return False
        if parent is None or not self.known_below(parent):
            return True
        # A name in a directory a layer below knows: captured if that
        # directory is itself at an ignored path (moved there by a recorded
        # change, or made in a directory moved there: records name paths
        # in it); a name a pattern matches in a directory at a captured
        # path (node_modules in the project) is not.  (The open layer's
        # own records are as before: a directory made in it and ignored
        # since, say, is not.)
        head = (path() if callable(path) else path).rpartition(b"/")[0]
        assert self.ignore is not None
        return not (head and self.ignore.matches(head, True))

    def known(self, ino: int) -> bool:
        """Whether a layer holding records knows object *ino*: the open
        layer captured or pinned it, or a layer below holds any index
        entry of it but the mark of one made at an ignored path (a lookup
        per layer, once per object while the layer is open: asked only
        at ignored paths)."""
        o = self.obj(ino)
        if o.pinned or o.meta or o.xattrs or o.chunks or o.zeros is not None:
            return True
        return self.known_below(ino)

    def known_below(self, ino: int) -> bool:
        """Whether a layer below the open one knows object *ino* (see ``known``)."""
        o = self.obj(ino)
        if o.older is None:
            o.older = self._known_below(ino)
        return o.older

    def _known_below(self, ino: int) -> bool:
        return self.store.knows(
            ino, [layer.id for layer in self.store.layers() if layer.id != self.layer]
        )

    def _skip(self, ino: int, o: Obj, loc: Loc, is_dir: bool) -> bool:
        """An object first changed at an ignored path is treated as new in
        this layer: nothing of it is captured -- unless a layer knows it
        (``known``)."""
        if (
            self.ignore is not None
            and not o.pinned
            and self.ignore.matches(loc(), is_dir)
            and not self.known(ino)
        ):
            o.created = True
            self.skipped.add(ino)
            return True
        return False

    def pin(self, w: Writer, ino: int) -> None:
        o = self.obj(ino)
        if not o.pinned and self.ignore is not None:
            self._changing(ino, o)
            w.index_put(self.layer, ino, schema.IDX_PINNED, 0)
            o.pinned = True

    # -- attribution ----------------------------------------------------------------

    def attribute(self, w: Writer, ino: int) -> None:
        """The process making the current request is the first to change
        *ino* in this layer, unless one was recorded already."""
        o = self.obj(ino)
        if o.attributed or self.who is None:
            return
        self._changing(ino, o)
        w.who_put(self.layer, ino, self._writer(w, self._process(self.who)))
        o.attributed = True

    def _process(self, who: tuple[int, int]) -> Process:
        """(pid, start time) and {pid, uid, cmd} of the requesting process,
        read from /proc while its request is being served (once per
        process: a short-lived one is gone soon after)."""
        pid, uid = who
        now = time.monotonic()
        recent = self._recent.get(pid)
        if recent is not None and recent[0] > now:  # (no pid is reused within a second)
            return recent[1]
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                key = (pid, int(f.read().rsplit(b")", 1)[1].split()[19]))
        except (OSError, IndexError, ValueError):
            key = (pid, 0)
        info = self._procs.get(key)
        if info is None:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = [os.fsdecode(a) for a in f.read().split(b"\0") if a]
            except OSError:
                cmd = []
            info = self._procs[key] = {"pid": pid, "uid": uid, "cmd": cmd}
        found = Process(key, info)
        self._recent[pid] = (now + 1.0, found)
        return found

    def _writer(self, w: Writer, process: Process) -> int:
        """The writer id of a process, registered in the store on first use."""
        wid = self._writers.get(process.key)
        if wid is None:
            wid = self._writers[process.key] = w.new_writer(process.info)
        return wid

    # -- name records -------------------------------------------------------------

    # (each with the backing inode of the directory of each name it records,
    # where the undo step must act)

    def create(self, w: Writer, path: bytes, dir: int) -> None:
        w.record(schema.Create(path, dir))

    def link(self, w: Writer, path: bytes, dir: int) -> None:
        w.record(schema.Link(path, dir))

    def grave(self, w: Writer, path: bytes, st: os.stat_result, dir: int) -> int:
        """*path* (the object *st* describes) goes to the grave: record it."""
        ino = st.st_ino
        self.attribute(w, ino)
        gid = w.new_grave(ino, st)
        w.record(schema.Grave(path, gid, ino, dir))
        return gid

    def rename(
        self, w: Writer, src: bytes, dst: bytes, ino: int, src_dir: int, dst_dir: int
    ) -> None:
        self.attribute(w, ino)
        # named here: wherever it goes now, its changes are captured (and its
        # names: a step of a record made before, if it was made here, must
        # find it where the records say)
        self.pin(w, ino)
        w.record(schema.Rename(src, dst, ino, src_dir, dst_dir))

    def exchange(
        self, w: Writer, a: bytes, b: bytes, ino_a: int, ino_b: int, a_dir: int, b_dir: int
    ) -> None:
        self.attribute(w, ino_a)
        self.attribute(w, ino_b)
        self.pin(w, ino_a)
        self.pin(w, ino_b)
        w.record(schema.Exchange(a, b, ino_a, ino_b, a_dir, b_dir))

    # -- object records -------------------------------------------------------------

    def meta(self, w: Writer, ino: int, loc: Loc, st: os.stat_result) -> Obj:
        """Capture mode, owner, size and times before the first change."""
        o = self.obj(ino)
        if o.created or o.meta:
            return o
        if self._skip(ino, o, loc, stat.S_ISDIR(st.st_mode)):
            return o
        self._changing(ino, o)
        self.attribute(w, ino)
        seq = w.record(schema.meta_record(loc(), st))
        w.index_put(self.layer, ino, schema.IDX_META, seq)
        o.meta = True
        o.s0 = st.st_size
        return o

    def xattrs(
        self,
        w: Writer,
        ino: int,
        loc: Loc,
        pairs: Callable[[], list[tuple[bytes, bytes]]],
        is_dir: bool = False,
    ) -> None:
        o = self.obj(ino)
        if o.created or o.xattrs or self._skip(ino, o, loc, is_dir):
            return
        self._changing(ino, o)
        self.attribute(w, ino)
        seq = w.record(schema.Xattrs(loc(), ino, schema.encode_xattrs(pairs())))
        w.index_put(self.layer, ino, schema.IDX_XATTRS, seq)
        o.xattrs = True

    def data(
        self,
        w: Writer,
        ino: int,
        loc: Loc,
        fd: int,
        st: os.stat_result,
        start: int,
        end: int,
        zeroing: bool = False,
    ) -> None:
        """Capture the old bytes of [start, end) (as whole chunks, within the
        size the object had when the layer was opened) before they change.
        *fd* must be readable.  *zeroing*: the change can only make them
        zeros (a truncation, a punched hole): a chunk that is all hole now
        reads the same after it, and a later write there is captured first,
        so it is not recorded -- what truncating a sparse file of TiBs costs
        follows what it holds, not its size.  Otherwise a run of chunks that
        are all hole is one record of zeros spanning them (what capturing a
        sparse file whole costs follows what it holds too)."""
        o = self.meta(w, ino, loc, st)
        if o.created:
            return
        end = min(end, o.s0)
        if start >= end:
            return
        C = self.C
        where = None
        holes = Holes(fd)
        self._changing(ino, o)
        if o.chunks is None:
            o.chunks = set()
        chunks, s0 = o.chunks, o.s0
        after: list[int] | None = None  # the chunks captured, sorted (for long runs of holes)
        k, last = start // C, (end - 1) // C
        while k <= last:
            if o.zeros is not None:
                z = o.zeros.until(k * C)
                if z > k * C:
                    k = -(-z // C)  # (captured as zeros up to there)
                    continue
            length = min(C, s0 - k * C)
            if zeroing:
                data_at = holes.next_data(k * C)
                if data_at >= k * C + length:
                    k = max(k + 1, data_at // C)  # (the next chunk that holds data)
                    continue
            if k in chunks:
                k += 1
                continue
            if where is None:
                where = loc()
            if holes.covers(k * C, k * C + length):
                # chunks [k, stop) are all hole, up to the next data, the
                # end, or the next chunk or range captured already
                stop = min(holes.next_data(k * C) // C, last + 1)
                if stop - k > 64:
                    if after is None:
                        after = sorted(chunks)
                    i = bisect.bisect_right(after, k)
                    if i < len(after):
                        stop = min(stop, after[i])
                else:
                    stop = next((j for j in range(k + 1, stop) if j in chunks), stop)
                if o.zeros is not None:
                    nxt = o.zeros.next_start(k * C)
                    if nxt is not None:
                        stop = min(stop, nxt // C)
                if stop - k > 1:
                    hi = min(stop * C, s0)
                    seq = w.record(schema.Chunk(where, ino, k, hi - k * C, b""))
                    w.index_put(self.layer, ino, schema.IDX_ZEROS, seq, k)
                    if o.zeros is None:
                        o.zeros = Zeros()
                    o.zeros.add(k * C, hi)
                    k = stop
                    continue
                zero = True  # not even read: sparse files cost nothing per hole
            else:
                data = os.pread(fd, length, k * C)
                if len(data) < length:
                    # The object is shorter than its layer-start size only if
                    # it was truncated, which captured these chunks already.
                    data += bytes(length - len(data))
                zero = data == self._zero if length == C else data == bytes(length)
            h = b"" if zero else w.put_chunk(data)
            seq = w.record(schema.Chunk(where, ino, k, length, h))
            w.index_put(self.layer, ino, schema.IDX_CHUNK, seq, k)
            chunks.add(k)
            k += 1


class Holes:
    """Which ranges of a file are holes, from SEEK_DATA/SEEK_HOLE, asked
    lazily while a capture walks forward through the file."""

    def __init__(self, fd: int):
        self.fd = fd
        self.data_at = -1  # the next data at or after the last position asked
        self.asked = -1

    def next_data(self, start: int) -> int:
        """Where the next data at or after *start* begins (1 << 63: none)."""
        if start < self.asked or self.data_at < start:
            try:
                self.data_at = os.lseek(self.fd, start, os.SEEK_DATA)
            except OSError as e:
                # ENXIO: no data at or after start; otherwise no support: read it
                self.data_at = 1 << 63 if e.errno == errno.ENXIO else start
            self.asked = start
        return self.data_at

    def covers(self, start: int, end: int) -> bool:
        """True when [start, end) is all hole (reads as zeros)."""
        return self.next_data(start) >= end
