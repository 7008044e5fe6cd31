"""The read-only views of the layer stack: the log, a layer's status,
net changes since a layer was opened (with who made them), the
fingerprint of what the layers changed and the drift from it, the redo
note, the store's usage.  Beside ``past.py`` (what a path was): these say
what changed.  Nothing here writes to the store.
"""

from __future__ import annotations

import gc
import os
import stat
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

from ..errors import CowfsError
from ..storage import schema
from ..storage.journal import MetaAt, Reading, Readings
from ..storage.store import Store, digest
from ..storage.zeros import ChunkMap
from ..system import backing
from . import fsck, redo
from .listing import Changes, Row
from .past import History, Past, filter_paths


class Stat(Protocol):
    """What net changes read of an object's status (``os.stat_result``, or
    ``PastStat`` for the tree when a layer was opened)."""

    @property
    def st_ino(self) -> int: ...
    @property
    def st_mode(self) -> int: ...
    @property
    def st_uid(self) -> int: ...
    @property
    def st_gid(self) -> int: ...
    @property
    def st_size(self) -> int: ...
    @property
    def st_mtime_ns(self) -> int: ...
    @property
    def st_ctime_ns(self) -> int: ...
    @property
    def st_rdev(self) -> int: ...


class PastStat(NamedTuple):
    """An object's status as it was when a layer was opened."""

    st_ino: int
    st_mode: int
    st_uid: int
    st_gid: int
    st_size: int
    st_mtime_ns: int
    st_ctime_ns: int  # (now: what a cache of comparisons keys on)
    st_rdev: int


class Ahead(NamedTuple):
    """The records the audit of a planned rollback read (see
    ``StackView.undone``), for its steps, with the journal's state then."""

    epoch: int
    start: int
    next_seq: int
    records: list[tuple[int, schema.Record]]


class StackView:
    """The views of the layers of one store (see the module's docstring).
    It keeps the journal's readings up to now (``journal.Readings``), which
    the group operations clear when they move or delete records."""

    WHO_BATCH = 4096  # changes attributed at a time

    def __init__(self, store: Store, resolver: backing.Resolver):
        self.store = store
        self.resolver = resolver
        self.same = Sameness(store, resolver)
        self.readings = Readings(store)  # readings of the journal up to now
        # the records the audit of the rollback planned now read (see `undone`)
        self._ahead: Ahead | None = None

    def check(self) -> list[str]:
        """Quick consistency check of the stack (run when recovering a mount
        whose daemon died): everything `cowfs check` verifies except the
        chunk hashes."""
        return [str(p) for p in fsck.check(self.store, hashes=False).problems]

    def fingerprint(self) -> dict:
        """What every path the layers changed looks like now (taken at
        unmount): {"seq", "layers": the store's state it belongs to,
        "paths": path -> its ``backing.fingerprint``}."""
        layers = self.store.layers()
        out: dict[str, list | None] = {}
        if layers:
            j = self.readings.get(layers[0].start)
            with self.resolver.reading():
                for path, fp in backing.fingerprints(self.resolver, sorted(j.touched())):
                    out[os.fsdecode(path)] = fp
        return {"seq": self.store.next_seq, "layers": [x.id for x in layers], "paths": out}

    def drift(self, recorded: dict) -> list[str]:
        """The recorded paths that are not as they were at unmount.  A
        record the store has moved on from (a mount since then that did
        not end cleanly) describes nothing any more."""
        if recorded.get("seq") != self.store.next_seq or recorded.get("layers") != [
            x.id for x in self.store.layers()
        ]:
            return []
        was = recorded.get("paths", {})
        paths = sorted(was)
        with self.resolver.reading():
            now = backing.fingerprints(self.resolver, [os.fsencode(p) for p in paths])
        return [
            p for p, (_, fp) in zip(paths, now, strict=True) if _as_recorded(fp, was[p]) != was[p]
        ]

    def redo_note(self) -> dict | None:
        """What `status` and `log` say about the last rollback (see
        ``redo.summary``), with "current": whether the layers are still
        those it left (no checkpoint, commit or other rollback since).  That
        it cannot be redone is worth saying only while it is current."""
        note = redo.summary(self.store, self.resolver)
        if note is None:
            return None
        state = redo.state(self.store)
        assert state is not None  # (summary found it)
        layers = self.store.layers()
        ids = [x.id for x in layers]
        if state.fresh is not None:  # it rolled back the base too
            current = ids == state.kept + [state.fresh]
        elif state.kept:
            current = ids == state.kept
        else:  # the base, unsealed: the fresh base it opened
            current = len(layers) == 1 and layers[0].start == state.seq
        return note | {"current": current}

    def usage(self) -> dict:
        data, grave = self.store.data_bytes(), self.store.grave_bytes()
        limits = self.store.limits()
        return {
            "bytes": data + grave,
            "data": data,
            "grave": grave,
            "max_store": limits.get("max_store"),
            "layers": len(self.store.layers()),
            "max_layers": limits.get("max_layers"),
        }

    def attribute(self, changes: Changes, since: int) -> Changes:
        """Each change with who first made it ("who": pid, uid, cmd), from
        the layers since *since* (looked up a batch at a time)."""
        layers = [layer.id for layer in self.store.layers() if layer.id >= since]
        seg = redo.segment(self.store)  # (changes since the last rollback)
        if seg is not None:
            layers.append(seg)
        inos = changes.inos
        for i in range(0, len(inos), self.WHO_BATCH):
            found = self.store.who(layers, [n for n in inos[i : i + self.WHO_BATCH] if n])
            for j in range(i, min(i + self.WHO_BATCH, len(inos))):
                who = found.get(inos[j]) if inos[j] else None
                if who is not None:  # (one dict per writer, shared: read, never changed)
                    changes.set_who(j, who)
        return changes

    def log(self, limit: int | None = None) -> list[dict]:
        """The layers, oldest first (with *limit*, only that many of the
        newest: each costs the count of its net changes)."""
        out = []
        layers = self.store.layers()
        for layer in layers[-limit:] if limit else layers:
            d = layer.to_dict()
            d["records"] = self.store.count_records(layer.start, self.store.layer_end(layer.id))
            d["changes"], d["times_only"] = self._count(layer.id, d["records"])
            d["bytes"] = self.store.layer_bytes(layer.id)
            out.append(d)
        return out

    def _count(self, layer_id: int, records: int) -> tuple[int, int]:
        """How many net changes layer *layer_id* made (it holds *records*),
        and how many paths whose time alone it changed.  That of a layer
        below the open one is kept on its row once counted (while its end
        and records are as they were then): what it changed stays what it
        changed, whatever happens above it, and it is counted once --
        usually while the layer above it is still small."""
        store = self.store
        layer = store.get_layer(layer_id)
        end = store.layer_end(layer_id)
        sealed = layer_id != store.open_layer().id
        if sealed and tuple(layer.counted[:2]) == (end, records):
            return layer.counted[2], layer.counted[3]
        changes = self._changes(layer_id).without_times()  # (counted, not attributed)
        found = (len(changes), changes.times_only)
        if sealed and not store.readonly:
            store.set_counted(layer_id, [end, records, *found])
        return found

    def status(
        self, layer_id: int | None = None, paths: Iterable[str] = (), times: bool = False
    ) -> dict:
        """The open layer's net changes (under *paths*, if given; with
        *times*, also the paths whose modification time alone differs,
        else their number: "times_only")."""
        layer_id = self.store.open_layer().id if layer_id is None else layer_id
        changes = self.changes_since(layer_id, paths, times, since=False)
        return {"id": layer_id, "changes": changes, "times_only": changes.times_only}

    def changes_since(
        self, layer_id: int, paths: Iterable[str] = (), times: bool = False, since: bool = True
    ) -> Changes:
        """Net changes since layer *layer_id* was opened (what a rollback
        --to it would undo), under *paths* if given; those of a path whose
        modification time alone differs only with *times* (else counted in
        the result's ``times_only``)."""
        changes = filter_paths(self._changes(layer_id, since=since), list(paths))
        return self.attribute(changes if times else changes.without_times(), layer_id)

    def changes_from(self, start: int) -> Changes:
        """Net changes since the record at journal position *start* was
        written (a fork point), every kind (t too)."""
        j = self.readings.get(start)
        with self.resolver.reading():
            changes = self._net(j, self.same)
        changes.sort()
        return changes

    def undone(self, to: int) -> Changes:
        """What the rollback planned now undoes (``changes_since`` layer
        *to*), for its audit.  The records read for it, when they were
        read afresh, serve the rollback's steps too (one reading of a large
        layer after a mount instead of two)."""
        collect: list[tuple[int, schema.Record]] = []
        changes = self.attribute(self._changes(to, since=True, collect=collect), to)
        if len(collect) > self.WHO_BATCH:
            # (the reading is garbage in cycles -- a tree of slots -- that the
            # rollback about to run would otherwise carry through its peak)
            gc.collect()
        store = self.store
        self._ahead = (
            Ahead(store.epoch, store.get_layer(to).start, store.next_seq, collect)
            if collect
            else None
        )
        return changes

    def records_from(self, start: int) -> list[tuple[int, schema.Record]]:
        """The records from *start* on, last first: those `undone` read, if
        the journal is still as it was then."""
        store = self.store
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (ahead.epoch, ahead.start, ahead.next_seq) == (
            store.epoch,
            start,
            store.next_seq,
        ):
            return ahead.records[::-1]
        return list(store.records(start, store.next_seq, reverse=True))

    def forget_ahead(self) -> None:
        """The rollback is over: what `undone` read serves nothing more."""
        self._ahead = None

    def reading(self, layer_id: int, since: bool = False, collect: list | None = None) -> Reading:
        """What the records of layer *layer_id* (with *since*: those
        since it was opened) say; kept while they are read up to now.
        *collect*: see ``Readings.get``."""
        layer = self.store.get_layer(layer_id)
        end = self.store.next_seq if since else self.store.layer_end(layer_id)
        if end == self.store.next_seq:
            return self.readings.get(layer.start, collect)
        return Reading(self.store.records(layer.start, end), self.store.chunk_size)

    def _changes(self, layer_id: int, since: bool = False, collect: list | None = None) -> Changes:
        """Net changes of a layer (with *since*: since it was opened),
        like ``git status --short``: A added, D deleted, M modified, T type
        changed, R renamed, m attributes only, t the modification time only.

        Records name paths as they were when written; ``journal.Reading``
        maps them to the layer's start and to its end, in one pass.  The
        tree at the end of a layer below the open one is the tree when the
        layer above it was opened (``SamenessAt``): a layer's changes are
        what it changed, whatever the layers above it did since."""
        j = self.reading(layer_id, since, collect)
        same = self.same
        if not since:
            layers = self.store.layers()
            above = [x.id for x in layers if x.id > layer_id]
            if above:  # (a reading of its own: the kept ones serve the open layer)
                start = self.store.get_layer(above[0]).start
                reading = Reading(
                    self.store.records(start, self.store.next_seq), self.store.chunk_size
                )
                h = History(self.store, self.resolver, above[0], reading=reading)
                same = SamenessAt(self.store, self.resolver, h)
        with self.resolver.reading():
            changes = self._net(j, same)
        if len(changes) > self.WHO_BATCH and not self.readings.holds(j):
            # (a reading not kept is garbage in cycles -- a tree of slots --
            # now: collected before the changes are sorted and sent, not
            # after, at the peak of the request)
            del j
            gc.collect()
        changes.sort()  # (stable: a deletion before what stands there now)
        return changes

    def _net(self, j: Reading, same: Sameness) -> Changes:
        """The net changes *j* describes (unsorted), compared with the tree now.  An
        object counts as renamed (R) when its own name or directory changed,
        not when it moved only with a directory above it; one that is gone
        is deleted (D, at its path then) unless another object stands where
        it would be now (M, T, m or nothing, as they compare); other new
        objects are added (A)."""
        names = j.names

        def now(path: bytes | None) -> Stat | None:
            return same.lstat(path) if path is not None else None

        def was_dir(ino: int) -> bool:
            """Whether the object *ino* the layer removed was a directory."""
            m = j.meta.get(ino)
            if m is not None:
                return stat.S_ISDIR(m.rec.mode)
            gids = j.graves.get(ino)
            st = backing.lstat_at(self.store.grave_fd, str(gids[0]).encode()) if gids else None
            return st is not None and stat.S_ISDIR(st.st_mode)

        places: dict[bytes, bytes] = {}  # directory at T -> where it is now

        def place(sp: bytes) -> bytes:
            """Where path *sp* (at T) is now: in its directory, wherever
            that went -- or, where the directory itself was removed, at
            the path the directory had (what stands there now is compared
            with what was at *sp*, whatever object it is)."""
            head, _, name = sp.rpartition(b"/")
            if not head:
                return sp
            # (up to the nearest directory whose place is known or found,
            # then down: no recursion, whatever the depth)
            todo = []
            here = places.get(head)
            while here is None:
                found = names.now(head)
                if found is not None:
                    here = places[head] = found
                    break
                todo.append(head)
                up, _, _ = head.rpartition(b"/")
                if not up:
                    here = b""
                    break
                head = up
                here = places.get(head)
            for d in reversed(todo):
                tail = d.rpartition(b"/")[2]
                here = places[d] = here + b"/" + tail if here else tail
            return here + b"/" + name if here else name

        # path -> its change
        out: dict[bytes, Row] = {}
        deleted: dict[bytes, Row] = {}  # (at their paths then: kept apart)
        present: set[int] = set()
        gone: list[tuple[bytes, int]] = []
        for sp, was in j.start.items():
            if was is None:
                continue
            cur = names.now(sp)
            st = now(cur)
            if cur is None or st is None or st.st_ino != was:  # (no path, no object)
                gone.append((sp, was))
                continue
            present.add(was)
            if cur != place(sp):
                out[cur] = Row(cur, "R", sp, stat.S_ISDIR(st.st_mode), was)
            elif cur:
                kind = same.modified(cur, st, j.meta.get(was), j.chunks.get(was), j.xattrs.get(was))
                if kind:
                    out[cur] = Row(cur, kind, None, stat.S_ISDIR(st.st_mode), was)
        stands_in: set[bytes] = set()  # where a new object replaced the one there at T
        for sp, was in gone:
            at = place(sp)
            st = now(at)
            if st is None or at in out:  # (no object)
                if st is None or st.st_ino not in present:
                    if sp not in deleted:
                        deleted[sp] = Row(sp, "D", None, was_dir(was), was)
                continue  # (else: a renamed object took its place)
            m = j.meta.get(was)
            gids = j.graves.get(was)
            kind = same.replaced(
                at,
                st,
                gids[0] if gids else None,
                m.rec if m is not None else None,
                j.xattrs.get(was),
            )
            stands_in.add(at)
            if kind:
                out[at] = Row(at, kind, None, stat.S_ISDIR(st.st_mode), st.st_ino)
        # (no two slots are at one path: what was made is listed, not looked up)
        rows = Changes([*deleted.values(), *out.values()])
        del deleted
        # (a new file's row holds the reading's name, in its directory's)
        last: bytes | None = None
        head = -1
        for where, name in names.made_in():
            cur = name if where is None else where + b"/" + name if where else name
            if cur in out or cur in stands_in:
                continue
            st = now(cur)
            if st is not None and st.st_ino not in present:
                if where is None:
                    rows.append(cur, "A", None, stat.S_ISDIR(st.st_mode), st.st_ino)
                    continue
                if where is not last:
                    head, last = rows.parent(where), where
                rows.append_in(head, name, "A", None, stat.S_ISDIR(st.st_mode), st.st_ino)
        return rows


def _as_recorded(fp: list | None, was: list | None) -> list | None:
    """*fp* in the form of *was*: a drift record of an older cowfs kept
    [size, mtime_ns, ctime_ns, ino] of each path."""
    if (
        fp is not None
        and was is not None
        and len(was) == 4
        and len(fp) == len(schema.Fingerprint._fields)
    ):
        return schema.Fingerprint(*fp).older_form()
    return fp


class Sameness:
    """Whether an object is as it was when a layer was opened: its bytes
    (compared with the captured pre-images, or with the whole object the
    layer removed), mode, owner, xattrs and mtime.  A path whose whole state
    is back as it was is no change; equal bytes with other attributes is an
    attribute change.  What was read is remembered while the object's ctime,
    size and mtime stay (every change of its bytes moves its ctime)."""

    CACHE = 100_000

    def __init__(self, store: Store, resolver: backing.Resolver):
        self.store = store
        self.resolver = resolver
        self.cache: dict[tuple, bool] = {}

    def lstat(self, path: bytes) -> Stat | None:
        """The status of what is at workspace path *path* (None: nothing)."""
        return self.resolver.lstat(path)

    def modified(
        self,
        path: bytes,
        st: Stat,
        meta: MetaAt | None,
        chunks: ChunkMap | None,
        xattrs: bytes | None,
    ) -> str | None:
        """M, m, t or None for the object at *path* (*st*), which was there at
        the start: *meta* (and its seq), *chunks* and *xattrs* are the
        oldest records the range holds of it."""
        m = meta.rec if meta is not None else None
        if stat.S_ISREG(st.st_mode) and (chunks or (m is not None and m.size != st.st_size)):
            if (
                meta is None
                or m is None
                or m.size != st.st_size
                or not self._cached(
                    ("c", meta.seq, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns),
                    lambda: self._chunks_back(path, chunks or ChunkMap(self.store.chunk_size)),
                )
            ):
                return "M"
        if xattrs is not None and self._xattrs_now(path) != schema.decode_xattrs(xattrs):
            return "m"
        if m is None:
            return None
        return self._attrs_differ(st, m.mode, m.uid, m.gid, m.mtime_ns)

    def replaced(
        self,
        path: bytes,
        st: Stat,
        gid: int | None,
        meta: schema.Meta | None,
        xattrs: bytes | None,
    ) -> str | None:
        """T, M, m, t or None for *path*, where another object (*st*) now stands
        in for the one the layer removed into grave *gid*."""
        old = backing.lstat_at(self.store.grave_fd, str(gid).encode()) if gid is not None else None
        if gid is None or old is None:
            return "M"
        mode = meta.mode if meta is not None else old.st_mode
        if stat.S_IFMT(mode) != stat.S_IFMT(st.st_mode):
            return "T"
        gloc = schema.grave_loc(gid)
        if stat.S_ISREG(mode):
            if old.st_size != st.st_size or not self._cached(
                ("g", gid, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns),
                lambda: self._same_file(gloc, path),
            ):
                return "M"
        elif stat.S_ISLNK(mode):
            if self._readlink(gloc) != self._readlink(path):
                return "M"
        elif not stat.S_ISDIR(mode) and old.st_rdev != st.st_rdev:
            return "M"
        was = schema.decode_xattrs(xattrs) if xattrs is not None else self._xattrs_now(gloc)
        if was != self._xattrs_now(path):
            return "m"
        if meta is not None:
            return self._attrs_differ(st, meta.mode, meta.uid, meta.gid, meta.mtime_ns)
        return self._attrs_differ(st, old.st_mode, old.st_uid, old.st_gid, old.st_mtime_ns)

    @staticmethod
    def _attrs_differ(st: Stat, mode: int, uid: int, gid: int, mtime: int) -> str | None:
        """m (mode or owner), t (the modification time only) or None.  A
        directory's time is not compared (every entry made or removed in
        it moves it)."""
        if (mode, uid, gid) != (st.st_mode, st.st_uid, st.st_gid):
            return "m"
        return "t" if not stat.S_ISDIR(st.st_mode) and mtime != st.st_mtime_ns else None

    def _cached(self, key: tuple, compute: Callable[[], bool]) -> bool:
        found = self.cache.get(key)
        if found is None:
            if len(self.cache) >= self.CACHE:
                self.cache.clear()
            try:
                found = self.cache[key] = compute()
            except OSError:
                return False
        return found

    def _open(self, loc: bytes) -> int:
        with self.resolver.at(loc) as (d, n):
            return backing.open_noatime(n, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)

    @staticmethod
    def _is_pre_image(data: bytes, length: int, h: bytes) -> bool:
        """Whether *data* is the pre-image a chunk record holds: *length*
        bytes of digest *h* (empty: zeros)."""
        return len(data) == length and (digest(data) == h if h else data.count(0) == length)

    def _chunks_back(self, path: bytes, chunks: ChunkMap) -> bool:
        """Whether every captured chunk of the file holds its pre-image again."""
        fd = self._open(path)
        try:
            size = self.store.chunk_size
            for index, (length, h) in chunks.one.items():
                data = os.pread(fd, length, index * size)
                if not self._is_pre_image(data, length, h):
                    return False
            end = os.fstat(fd).st_size
            for lo, hi in chunks.zero_spans(end):  # (the size is compared apart)
                pos = lo
                while pos < hi:  # (reads only what holds data there now)
                    found = backing.next_data(fd, pos, hi)
                    if found is None:
                        break
                    for off in range(found[0], found[1], 1 << 20):
                        if os.pread(fd, min(1 << 20, found[1] - off), off).count(0) != min(
                            1 << 20, found[1] - off
                        ):
                            return False
                    pos = found[1]
            return True
        finally:
            os.close(fd)

    def _same_file(self, a: bytes, b: bytes) -> bool:
        """Whether two files hold the same bytes, compared where either
        holds data (both read as zeros elsewhere): the cost follows their
        data, not their sizes."""
        fa, fb = self._open(a), self._open(b)
        try:
            size = os.fstat(fa).st_size
            if os.fstat(fb).st_size != size:
                return False
            spans = sorted(backing.data_ranges(fa, size) + backing.data_ranges(fb, size))
            off = 0
            for lo, hi in spans:
                for pos in range(max(lo, off), hi, 1 << 20):
                    n = min(1 << 20, hi - pos)
                    if os.pread(fa, n, pos) != os.pread(fb, n, pos):
                        return False
                off = max(off, hi)
            return True
        finally:
            os.close(fa)
            os.close(fb)

    def _readlink(self, loc: bytes) -> bytes | None:
        try:
            with self.resolver.at(loc) as (d, n):
                return os.readlink(n, dir_fd=d)
        except OSError:
            return None

    def _xattrs_now(self, loc: bytes) -> list[tuple[bytes, bytes]] | None:
        try:
            with self.resolver.at(loc) as (d, n):
                return sorted(backing.list_xattrs(*backing.xattr_target(d, n)))
        except OSError:
            return None


class SamenessAt(Sameness):
    """``Sameness`` with the tree as it was when a layer was opened (the
    end of the layer below it) for the tree now: each path's object, status,
    bytes, symlink target and xattrs as ``past.History`` reads them.  What
    the layer below removed is in the grave, as it was then."""

    def __init__(self, store: Store, resolver: backing.Resolver, history: History):
        super().__init__(store, resolver)
        self.h = history
        self.objects: dict[bytes, Past] = {}

    def lstat(self, path: bytes) -> Stat | None:
        try:
            obj = self.h.object_at(path)
        except CowfsError:  # (not where the records say: a change nothing captured)
            obj = None
        if obj is None:
            return None
        self.objects[path] = obj
        return PastStat(
            obj.ino,
            obj.mode,
            obj.uid,
            obj.gid,
            obj.size,
            obj.mtime_ns,
            obj.now.st_ctime_ns,
            obj.now.st_rdev,
        )

    def _cached(self, key: tuple, compute: Callable[[], bool]) -> bool:
        try:
            return compute()
        except (OSError, CowfsError):
            return False

    def _spans(self, obj: Past, fd: int, size: int) -> list[tuple[int, int]]:
        """Where *obj*'s bytes then may be other than zeros, within *size*:
        where its live object holds data, and its recorded pre-images
        (sorted, overlapping ones merged)."""
        C = self.store.chunk_size
        held = [(k * C, k * C + n) for k, (n, h) in obj.chunks.one.items() if h]
        out: list[tuple[int, int]] = []
        for lo, hi in sorted(backing.data_ranges(fd, size) + held):
            if out and lo <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], hi))
            else:
                out.append((lo, hi))
        return out

    def _chunks_back(self, path: bytes, chunks: ChunkMap) -> bool:
        obj = self.objects[path]
        with self.h.opened(obj) as fd:
            size = self.store.chunk_size
            for index, (length, h) in chunks.one.items():
                data = self.h.read(obj, index * size, length, fd)
                if not self._is_pre_image(data, length, h):
                    return False
            spans = self._spans(obj, fd, obj.size)
            zeros = chunks.zero_spans(obj.size)
            i = 0  # (both sorted: one walk along the two)
            for lo, hi in zeros:
                while i < len(spans) and spans[i][1] <= lo:
                    i += 1
                k = i
                while k < len(spans) and spans[k][0] < hi:
                    a, b = max(spans[k][0], lo), min(spans[k][1], hi)
                    for off in range(a, b, 1 << 20):
                        n = min(1 << 20, b - off)
                        if self.h.read(obj, off, n, fd).count(0) != n:
                            return False
                    k += 1
        return True

    def _same_file(self, a: bytes, b: bytes) -> bool:
        """*a*: a grave entry (as it was then: nothing changes it), *b*: a
        workspace path; compared where either may hold data."""
        obj = self.objects[b]
        size = obj.size
        fa = self._open(a)
        try:
            if os.fstat(fa).st_size != size:
                return False
            with self.h.opened(obj) as fb:
                spans = sorted(backing.data_ranges(fa, size) + self._spans(obj, fb, size))
                done = 0
                for lo, hi in spans:
                    for off in range(max(lo, done), hi, 1 << 20):
                        n = min(1 << 20, hi - off)
                        if os.pread(fa, n, off) != self.h.read(obj, off, n, fb):
                            return False
                    done = max(done, hi)
            return True
        finally:
            os.close(fa)

    def _readlink(self, loc: bytes) -> bytes | None:
        if loc.startswith(backing.GRAVE_PREFIX):
            return super()._readlink(loc)
        try:
            return self.h.readlink(self.objects[loc])
        except (OSError, CowfsError):
            return None

    def _xattrs_now(self, loc: bytes) -> list[tuple[bytes, bytes]] | None:
        if loc.startswith(backing.GRAVE_PREFIX):
            return super()._xattrs_now(loc)
        try:
            return sorted(self.h.xattrs_of(self.objects[loc]))
        except (OSError, CowfsError):
            return None
