"""Redo: undoing the last rollback.

While a rollback applies the undo records of the layers it drops, it keeps
what a redo needs in the ``redo`` database (layout in ``schema``):

* before each undo step, the step's *inverse*: records in the journal's own
  format that put back what the step is about to change — the bytes it
  overwrites or truncates away, the attributes and times it resets
  (including those of the directories whose entries it changes, the first
  time the rollback changes them), the xattrs it replaces; an object the
  step removes (created in a dropped layer) is moved into the grave
  instead of being deleted, so it keeps its inode and content.  They are
  taken for a batch of steps at a time, in one transaction (see RedoInverses);
* the dropped layers themselves: rows, journal records, index entries and
  attributions are moved there instead of being deleted.

``redo`` applies the inverses in the opposite order — each one exact, so the
tree returns to what it was before the rollback, with the same objects (inode
numbers), which the layers' records name — and then moves the layers back:
they can be inspected, rolled back or committed as before.

A redo is possible as long as nothing it would touch changed since the
rollback.  When the rollback ends, it takes a fingerprint of every location
the redo would act on (and notes which of them it moves); a redo compares
them first, mounted or not, and refuses — changing nothing — if any
differs.  Changes elsewhere (a new file in a directory the redo does not
touch, an ignored build cache) do not stand in its way: they are captured
into the open layer as usual, but under an index of their own, the
*segment* (a layer id with no row: ``state["segment"]``), as if a layer had
been opened at the rollback; their records are also refused when they lie
below a location the redo moves.  A redo then makes the segment part of
the top layer it brings back (the changes came after everything in it), so
every layer still rolls back exactly; anything else that ends the chance to
redo — a checkpoint, a commit, another rollback — merges the segment into
the open layer and frees what was kept.  A rollback of every layer opens a
fresh base layer, which serves as the segment itself.  A rollback that
restored provider snapshots keeps nothing: the containers' and VMs' state
before it was not taken.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import lmdb

from ..errors import NothingToDo, Refused, StoreError
from ..storage import gravesum, schema
from ..storage.journal import Names, Slot
from ..storage.schema import RedoState
from ..storage.store import Store, Writer
from ..system import backing

if TYPE_CHECKING:
    from .undo import Undoer

# whether the step of (seq, record) is skipped (a damaged record, ...)
Skip = Callable[[int, schema.Record], bool]

BUILDING, READY, REDOING, UNAVAILABLE, GONE = "building", "ready", "redoing", "unavailable", "gone"
SEGMENT = 1 << 63  # + the rollback's first seq: the segment's index id (no layer has it)

# The note the last rollback left (JSON, at K_REDO_STATE): see schema.RedoState.


def state(store: Store) -> RedoState | None:
    raw = schema.meta_json(schema.DB_REDO, schema.K_REDO_STATE, store.redo_get(schema.K_REDO_STATE))
    return RedoState.from_json(raw) if raw is not None else None


def _state_in(w: Writer) -> RedoState:
    """The note, read in a transaction that changes it (a sound store,
    amid a rollback's keeping or a redo, has it)."""
    raw = w.redo_get(schema.K_REDO_STATE)
    if raw is None:
        raise StoreError("the store is damaged: it has no note of the last rollback")
    return RedoState.from_json(schema.meta_json(schema.DB_REDO, schema.K_REDO_STATE, raw))


def _put_state(w: Writer, note: RedoState) -> None:
    w.redo_put(
        schema.K_REDO_STATE,
        schema.seal(schema.DB_REDO, schema.K_REDO_STATE, schema.to_json(note.to_json())),
    )


def summary(store: Store, resolver: backing.Resolver | None = None) -> dict | None:
    """What `status` and `log` say about redo: None when no rollback left a
    note, else {"available", "layers", "why"}.  With *resolver*, a redo
    that is still kept is checked as `redo` would check it (a stat of
    every location it touches)."""
    note = state(store)
    if note is None or note.state in (BUILDING, REDOING):
        return None
    why = note.why
    if note.state == READY and resolver is not None:
        why = why_not(store, resolver, note) or ""
    return {"available": note.state == READY and not why, "layers": note.dropped, "why": why}


def segment(store: Store) -> int | None:
    """The index id under which changes made since the last rollback are
    captured (see the module's doc), while what it kept is not dissolved."""
    note = state(store)
    return note.segment if note is not None else None


def _dissolve(w: Writer, note: RedoState, into: int) -> None:
    """The segment (or the fresh base layer a rollback of every layer
    opened) becomes part of layer *into*: its index entries and
    attributions (its records lie after *into*'s already); a fresh base's
    row goes, its notes (runs, drift) move to *into*."""
    if note.segment is not None:
        w.merge_index(note.segment, into)
    fresh = note.fresh
    if fresh is not None:
        row = w.layer_row(fresh)
        if row is not None:
            w.merge_index(fresh, into)
            for key in ("runs", "postmortems", "drift"):
                if row.get(key):
                    w.store.append_to_layer(into, key, list(row[key]), w)
            w.delete_layer_row(fresh)


def begin(w: Writer, to: int, dropping: list[int], kept: list[int], why: str | None = None) -> None:
    """In the transaction that plans a rollback: start keeping what a redo
    needs, or (*why*) record why nothing is kept.  Whatever an earlier
    rollback kept must have been discarded already."""
    _put_state(
        w,
        RedoState(
            state=BUILDING if why is None else UNAVAILABLE,
            why=why or "",
            to=to,
            dropped=dropping,
            kept=kept,
            fresh=None,
            seq=w.store.next_seq,
            time=time.time(),
        ),
    )


def mark_unavailable(store: Store, reason: str) -> None:
    """When even discarding failed (a full disk): at least never build on,
    or seal, what is kept (best effort; the next discard frees it)."""
    note = state(store)
    if note is None:
        return
    try:
        with store.write() as w:
            _put_state(w, replace(note, state=UNAVAILABLE, why=reason))
    except OSError:
        pass


def complete(store: Store) -> bool:
    """A rollback's keeping that ended (every dropped layer moved here)
    but was not sealed: a crash came in between."""
    note = state(store)
    if note is None or note.state != BUILDING:
        return False
    return all(store.redo_get(schema.redo_layer_key(i)) is not None for i in note.dropped)


def building(store: Store, to: int) -> bool:
    note = state(store)
    return note is not None and note.state == BUILDING and note.to == to


def discard(store: Store, reason: str) -> list[int]:
    """Drop what the last rollback kept (it can no longer be redone, for
    *reason*), keeping a note of why; returns the inodes of the objects
    it held in the grave (gone now)."""
    note = state(store)
    if note is None:
        return []
    if note.state in (UNAVAILABLE, GONE):
        if store.redo_count() <= 1 and note.segment is None:
            return []  # nothing but the note
        reason = note.why
    graves: list[int] = []
    freed: list[int] = []
    top = store.top()
    with store.write() as w:
        keys = []
        for key, val in w.redo_entries():
            keys.append(key)
            kind, _ = schema.split_redo_key(key)
            if kind not in (schema.REDO_RECORD, schema.REDO_INVERSE):
                continue
            rec = schema.decode_or_damaged(val)
            if isinstance(rec, schema.Chunk) and rec.digest:
                w.deref(rec.digest)
            held = held_grave(kind, rec)
            if held is not None and w.holds_grave(held[0]):
                w.drop_grave(held[0])
                graves.append(held[0])
                freed.append(held[1])
        for key in keys:
            w.redo_delete(key)
        if note.segment is not None:
            # what changed since the rollback belongs to the open layer for good
            # (a segment is opened only while a layer is open: see RedoInverses.seal)
            assert top is not None
            w.merge_index(note.segment, top.id)
        _put_state(
            w,
            RedoState(
                state=GONE if note.state in (READY, GONE) else UNAVAILABLE,
                why=reason,
                to=note.to,
                dropped=note.dropped,
                kept=note.kept,
                fresh=note.fresh,
                seq=note.seq,
                time=note.time,
                segment=None,
                segment_written=True,
            ),
        )
    for gid in graves:
        backing.remove_tree_at(store.grave_fd, str(gid).encode())
    return freed


# -- keeping, during a rollback ---------------------------------------------------------


def batch_size(default: int = 512) -> int:
    """How many undo steps a rollback takes as one batch at most (see
    `RedoInverses`): *default*, or $COWFS_UNDO_BATCH (2 or more; for tests that
    want many batches of a small layer)."""
    raw = os.environ.get("COWFS_UNDO_BATCH", "")
    return int(raw) if raw.isdigit() and int(raw) >= 2 else default


class ToSeal(NamedTuple):
    """Where a redo would act, once the rollback's steps are all taken (see
    ``RedoInverses.sealed``)."""

    known: list[tuple[bytes, bytes]]  # fingerprints known without looking
    locs: list[bytes]  # the locations whose fingerprints are still to take
    moved: list[bytes]  # where the redo moves what is there


class RedoInverses:
    """Keeps what a redo of the rollback under way needs, a batch of steps
    at a time.

    For the records the rollback takes next: `batch` (or `before`, for one)
    keeps the inverses of their undo steps, all taken before any of them
    runs; `hold` after each step.  Held records leave the journal in the
    transaction that keeps the next batch's inverses; `flush` writes the
    last.  Until then they are still in the journal, and a resumed rollback
    applies them again, in order, without taking their inverses again: a
    batch holds only steps that act on different objects at different
    places (none below another), each checking the object it acts on, so
    applying the batch again from any point changes nothing it did."""

    BATCH = batch_size()

    def __init__(self, store: Store, resolver: backing.Resolver):
        self.store = store
        self.r = resolver
        self.C = store.chunk_size
        self.held: list[tuple[int, schema.Record, bool]] = []
        # (a resumed rollback)
        self.kept = {schema.redo_inverse_seq(k) for k, _ in store.redo_entries(schema.REDO_INVERSE)}
        # seq -> inverses, in the rollback's order, while this process took them all
        self.groups: dict[int, list[schema.Change]] | None = {} if not self.kept else None
        # directories whose times are kept already (valid while no directory moves)
        self.dir_times: set[bytes] = set()
        # seq -> what the CREATE or LINK step of that record will find at its path,
        # as the plan of the batch under way has it (acting on nothing else)
        self.planned: dict[int, os.stat_result] = {}
        # location -> the seq of the step that left nothing there (see `emptied_by`)
        self.emptied: dict[bytes, int] = {}
        self.last: _BatchPlan | None = None  # the plan of the batch kept last
        self.generation = self.began = resolver.generation

    def before(self, seq: int, rec: schema.Record) -> tuple[int, int] | None:
        """Keep the inverse of *rec*'s undo step, unless it is kept already.
        Returns (grave id, inode): where the step must move the object it
        removes (CREATE, LINK), and which object that is, if any."""
        if seq not in self.kept:
            if isinstance(rec, schema.Rename) and not self._holds(rec.dst, rec.ino):
                # its step moves nothing: nothing to keep (a resumed rollback
                # meets such a step where it took it already, with nothing
                # kept of it when it went with the CREATE after it: see
                # `_inverses`)
                self.kept.add(seq)
                return None
            return self._keep([(seq, rec, None)])[0]
        first = self.store.redo_get(schema.redo_inverse_key(seq, 0))
        return _keep_of(rec, [schema.decode_record(first)] if first is not None else [])

    def _holds(self, loc: bytes, ino: int) -> bool:
        st = self.r.lstat(loc)
        return st is not None and st.st_ino == ino

    def batch(
        self, records: Sequence[tuple[int, schema.Record]], i: int, skip: Skip
    ) -> list[tuple[int, int] | None]:
        """Keep the inverses of the undo steps of records[i:i+n], for the
        longest run (n >= 1) that makes a batch (see the class); *skip*:
        (seq, record) -> whether the rollback leaves that record unapplied.
        Returns what `before` returns, for each."""
        chosen = self._plan(records, i, skip, None)
        if len(chosen) <= 1:
            seq, rec = records[i]
            self.last = None
            return [self.before(seq, rec)]
        return self._keep(chosen)

    def batch_ahead(
        self, records: Sequence[tuple[int, schema.Record]], i: int, skip: Skip
    ) -> list[tuple[int, int] | None] | None:
        """`batch`, taken while the steps of the batch kept last are being
        applied: only steps that act nowhere near that batch's places and
        objects join it, so that what it keeps is what its steps will find
        whenever the other batch's steps run, and none of the directories
        whose times it keeps are touched by them.  None, having looked at
        nothing but those places, when fewer than two steps make it (the
        caller takes it once the other batch is done).  Its transaction
        moves the records held so far out of the journal: those of steps
        already taken."""
        if self.last is None:
            return None
        chosen = self._plan(records, i, skip, self.last)
        if len(chosen) <= 1:
            return None
        return self._keep(chosen)

    def _plan(
        self,
        records: Sequence[tuple[int, schema.Record]],
        i: int,
        skip: Skip,
        outer: _BatchPlan | None,
    ) -> list[tuple[int, schema.Record, os.stat_result | None]]:
        """The longest run from records[i] that makes a batch (see
        `_BatchPlan`; *outer*: the batch whose steps run meanwhile)."""
        plan = _BatchPlan(self.r, outer)
        chosen: list[tuple[int, schema.Record, os.stat_result | None]] = []
        for seq, rec in records[i : i + self.BATCH + 1]:
            if seq in self.kept or skip(seq, rec):
                break
            if len(chosen) == self.BATCH and not removes_source(chosen[-1][1], rec):
                break  # (a RENAME goes with the CREATE of its source: see `_inverses`)
            took = plan.admit(rec)
            if took is None:
                break
            chosen.append((seq, rec, took[1]))
        self.last = plan
        return chosen

    def _keep(
        self, chosen: list[tuple[int, schema.Record, os.stat_result | None]]
    ) -> list[tuple[int, int] | None]:
        """One transaction: the held records leave the journal, the inverses
        of *chosen* ((seq, record, what a CREATE or LINK step removes, as
        the plan found it)) are kept."""
        out = []
        # (what a CREATE or LINK step will find, for the step itself: see `planned`)
        self.planned = {seq: st for seq, _, st in chosen if st is not None}
        with self.store.write() as w:
            self._keep_held(w)
            groups = self._inverses(w, chosen)
            for seq, group in groups:
                for k, inv in enumerate(group):
                    w.redo_put(schema.redo_inverse_key(seq, k), schema.encode_record(inv))
        self.held = []
        for (seq, group), (_, rec, _) in zip(groups, chosen, strict=True):
            self.kept.add(seq)
            if self.groups is not None and group:
                self.groups[seq] = group
            out.append(_keep_of(rec, group))
        return out

    def _inverses(
        self, w: Writer, chosen: list[tuple[int, schema.Record, os.stat_result | None]]
    ) -> list[tuple[int, list[schema.Change]]]:
        """(seq, the inverses of its step) for each of *chosen*.  A RENAME
        followed by the CREATE of its source (a file written under a
        temporary name and renamed into place, which the batch plan saw at
        its new name with nothing at the old one) is one move into the
        grave, whether its steps are taken as one (``Undoer.put_back_and_remove``)
        or one by one: its inverse, kept with the CREATE, moves the file
        from the grave straight back to its new name, and the RENAME keeps
        the times of the directories alone."""
        out: list[tuple[int, list[schema.Change]]] = []
        for j, (seq, rec, st) in enumerate(chosen):
            prev = chosen[j - 1][1] if j else None
            nxt = chosen[j + 1] if j + 1 < len(chosen) else None
            if isinstance(rec, schema.Rename) and nxt is not None and _made_before(rec, *nxt[1:]):
                out.append((seq, self._parents(rec.src, rec.dst)))
            elif isinstance(prev, schema.Rename) and st is not None and _made_before(prev, rec, st):
                gid = w.new_grave(st.st_ino, st)
                out.append((seq, [schema.Rename(prev.dst, schema.grave_loc(gid), st.st_ino)]))
            else:
                out.append((seq, self._inverse(w, rec, st)))
        return out

    def emptied_by(self, seq: int, *locs: bytes) -> None:
        """The step of record *seq* left nothing at *locs* (it moved what
        was there away, and the batch plan saw nothing at the others): the
        seal need not look there, if no later step acts there and no
        directory moves (which would change what the names refer to)."""
        for loc in locs:
            self.emptied[loc] = seq

    def hold(self, steps: list[tuple[int, schema.Record, bool]]) -> None:
        """After these undo steps ((seq, record, moved): applied, failed
        or skipped); *moved*: the step moved its object into the grave or
        out of it (so that need not be looked at again; out of it, it left
        nothing there)."""
        self.held += steps
        for seq, rec, moved in steps:
            if moved and isinstance(rec, schema.Grave):
                self.emptied[schema.grave_loc(rec.grave)] = seq
        # (a batch's records leave the journal when the batch after the next is kept)
        if len(self.held) > 2 * self.BATCH:
            self.flush()

    def flush(self) -> None:
        if self.held:
            with self.store.write() as w:
                self._keep_held(w)
            self.held = []

    def _keep_held(self, w: Writer) -> None:
        """Move the held records out of the journal into the redo database."""
        grave_fd = self.store.grave_fd
        for seq, rec, moved in self.held:
            if not w.park_record(seq):
                continue
            if moved:
                if isinstance(rec, schema.Grave):
                    w.drop_grave(rec.grave)  # put back
            elif isinstance(rec, schema.Create | schema.Link):
                first = schema.redo_inverse_key(seq, 0)
                raw_inv = w.redo_get(first)
                if raw_inv is None:
                    continue
                inv = schema.decode_record(raw_inv)
                # (the inverse of a CREATE or LINK moves the object into the grave)
                gid = schema.grave_id(inv.dst) if isinstance(inv, schema.Rename) else None
                assert gid is not None
                if backing.lstat_at(grave_fd, str(gid).encode()) is None:
                    # the step failed: nothing was moved, nothing to put back
                    # (the directories' times stay: they may be the first kept)
                    w.redo_delete(first)
                    w.drop_grave(gid)
                    if self.groups is not None and seq in self.groups:
                        self.groups[seq] = self.groups[seq][1:]
                        if not self.groups[seq]:
                            del self.groups[seq]
            elif (
                isinstance(rec, schema.Grave)
                and backing.lstat_at(grave_fd, str(rec.grave).encode()) is None
            ):
                w.drop_grave(rec.grave)  # put back

    def sealed(self) -> ToSeal:
        """The steps are all taken: where a redo would act.  Returns the
        fingerprints known without looking, the other locations (whose
        fingerprints `seal` takes: see ``fingerprints``) and those where
        the redo moves what is there."""
        prints: list[tuple[bytes, bytes]] = []
        if self.groups is not None and self.r.generation == self.began:
            # no directory moved: each location names the same place throughout
            locs, moved, last = _locations(self.groups.items())
            # where a step left nothing and no step after it acted, nothing is
            # (what a step moved into the grave is looked at: a program that
            # held it open may still write to it)
            known = {loc for loc, seq in self.emptied.items() if last.get(loc, -1) >= seq}
            prints = [(loc, b"null") for loc in sorted(known)]
            locs = [loc for loc in locs if loc not in known]
        else:
            locs, moved = touched_locations(
                list(self.groups.values())
                if self.groups is not None
                else [
                    [rec for _, rec in group]
                    for _, group in _inverse_groups(self.store, reverse=True)
                ]
            )
        return ToSeal(prints, locs, moved)

    def seal(
        self, top: int, looked: tuple[list[tuple[bytes, bytes]], list[bytes]] | None = None
    ) -> None:
        """The rollback is done (*top*: the layer open now): note the
        fingerprint of every location a redo would touch, and those where
        it moves what is there, and open the segment that captures what
        changes from now on (unless *top* is a fresh base layer: that
        serves).  *looked*: those fingerprints (the ones `sealed` knew and
        those of the locations it named, taken after the last step) and
        locations; else they are taken here."""
        if looked is None:
            known, locs, moved = self.sealed()
            with self.r.reading():
                looked = known + fingerprints(self.r, locs), moved
        prints, moved = looked
        note = state(self.store)
        assert note is not None  # (written when the rollback was planned: redo.begin)
        with self.store.write() as w:
            for loc, value in prints:
                w.redo_put(schema.redo_kept_key(schema.REDO_PRINT, loc), value)
            for loc in moved:
                w.redo_put(schema.redo_kept_key(schema.REDO_MOVED, loc), b"")
            fresh = None if top in note.kept else top
            sealed = replace(
                note,
                state=READY,
                fresh=fresh,
                moves=True,  # (a rollback by an older cowfs did not note them)
                segment=SEGMENT + note.seq if fresh is None else None,
                segment_written=True,
            )
            _put_state(w, sealed)

    # -- inverses -------------------------------------------------------------------

    def _parents(self, *paths: bytes) -> list[schema.Change]:
        """The attributes (times) of the directories holding *paths*, which
        a change of their entries touches: the first time the rollback
        touches each.  A redo applies the inverses in the reverse order, so
        that one is applied last, and leaves the times the rollback found
        (the others would be overwritten).  A directory moved meanwhile
        starts over: the names may hold other directories now."""
        out: list[schema.Change] = []
        if self.generation != self.r.generation:
            self.generation = self.r.generation
            self.dir_times.clear()
        seen = self.dir_times
        for p in paths:
            if schema.grave_id(p) is not None or not p:
                continue
            parent = backing.split(p)[0]
            if parent in seen:
                continue
            st = self.r.lstat(parent)
            if st is not None:
                seen.add(parent)
                out.append(schema.meta_record(parent, st))
        return out

    def _bytes(
        self,
        w: Writer,
        d: int,
        name: bytes,
        loc: bytes,
        ino: int,
        index: int,
        end: int,
        length: int | None = None,
    ) -> schema.Chunk:
        """A CHUNK record holding chunk *index* of the object as it is now
        (up to *length* bytes of it, never past *end*, its size)."""
        off = index * self.C
        n = max(0, min(self.C if length is None else length, end - off))
        data = b""
        if n:
            fd = backing.open_noatime(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d
            )
            try:
                data = os.pread(fd, n, off)
            finally:
                os.close(fd)
        h = b"" if data == bytes(len(data)) else w.put_chunk(data)
        return schema.Chunk(loc, ino, index, len(data), h)

    def _data_chunks(self, d: int, name: bytes, start: int, end: int) -> list[int]:
        """The chunks of the file *name* that hold data within [start, end)."""
        fd = backing.open_noatime(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d
        )
        try:
            out: list[int] = []
            pos = start
            while (found := backing.next_data(fd, pos, end)) is not None:
                lo, hi = found
                for i in range(lo // self.C, (hi - 1) // self.C + 1):
                    if not out or out[-1] < i:
                        out.append(i)
                pos = hi
            return out
        finally:
            os.close(fd)

    @staticmethod
    def _xattrs(d: int, n: bytes, loc: bytes, ino: int, always: bool = True) -> list[schema.Change]:
        pairs = backing.list_xattrs(*backing.xattr_target(d, n))
        return [schema.Xattrs(loc, ino, schema.encode_xattrs(pairs))] if pairs or always else []

    def _inverse(
        self, w: Writer, rec: schema.Record, st: os.stat_result | None = None
    ) -> list[schema.Change]:
        """Records that undo *rec*'s undo step, in the order a redo applies
        them; taken before the step (*st*: for a CREATE or LINK in a batch,
        what the step will find at its path, as the plan knows it)."""
        if isinstance(rec, schema.Create | schema.Link):
            if st is None:
                st = self.r.lstat(rec.path)
            if st is None:
                return []
            gid = w.new_grave(st.st_ino, st)
            return [
                schema.Rename(rec.path, schema.grave_loc(gid), st.st_ino),
                *self._parents(rec.path),
            ]
        if isinstance(rec, schema.Grave):
            return [
                schema.Rename(schema.grave_loc(rec.grave), rec.path, rec.ino),
                *self._parents(rec.path),
            ]
        if isinstance(rec, schema.Rename):
            return [schema.Rename(rec.dst, rec.src, rec.ino), *self._parents(rec.src, rec.dst)]
        if isinstance(rec, schema.Exchange):
            return [
                schema.Exchange(rec.a, rec.b, rec.ino_b, rec.ino_a),
                *self._parents(rec.a, rec.b),
            ]
        if not isinstance(rec, schema.Meta | schema.Xattrs | schema.Chunk):
            return []
        loc, ino = rec.loc, rec.ino
        try:
            with self.r.at(loc) as (d, n):
                st = backing.lstat_at(d, n)
                if st is None or st.st_ino != ino:
                    return []  # the step cannot apply either; it is reported
                if isinstance(rec, schema.Xattrs):
                    return self._xattrs(d, n, loc, ino)
                if isinstance(rec, schema.Chunk) and not rec.digest and rec.length > self.C:
                    # a range of zeros: the step punches out what holds data
                    # there, which is all it needs to put back (the rest
                    # reads as zeros already: a range of TiBs costs what it holds)
                    lo = rec.chunk * self.C
                    hi = min(lo + rec.length, st.st_size)
                    kept = [
                        self._bytes(w, d, n, loc, ino, i, st.st_size, min(self.C, hi - i * self.C))
                        for i in (self._data_chunks(d, n, lo, hi) if lo < hi else [])
                    ]
                    return [*kept, schema.meta_record(loc, st)]
                if isinstance(rec, schema.Chunk):
                    return [
                        self._bytes(w, d, n, loc, ino, rec.chunk, st.st_size, rec.length),
                        schema.meta_record(loc, st),
                    ]
                out: list[schema.Change] = []
                if stat.S_ISREG(st.st_mode) and st.st_size > rec.size:
                    # the step truncates: keep what it cuts off that holds
                    # data (the rest reads as the zeros that putting the
                    # size back gives: a sparse file of TiBs costs what it holds)
                    out += [
                        self._bytes(w, d, n, loc, ino, i, st.st_size)
                        for i in self._data_chunks(d, n, rec.size, st.st_size)
                    ]
                out.append(schema.meta_record(loc, st))
                if (st.st_uid, st.st_gid) != (rec.uid, rec.gid):
                    # a change of owner drops capabilities
                    out += self._xattrs(d, n, loc, ino, always=False)
                return out
        except FileNotFoundError:
            return []  # (a path component is gone: likewise)


def _made_before(ren: schema.Rename, rec: schema.Record, st: os.stat_result | None) -> bool:
    """Whether *rec*, the record before RENAME *ren*, is the CREATE of its
    source, and the batch plan has the file at its new name (*st*: what
    the CREATE's step will find)."""
    return removes_source(ren, rec) and st is not None and st.st_ino == ren.ino


def removes_source(ren: schema.Record, rec: schema.Record) -> bool:
    """Whether *rec*, the record before *ren*, is the CREATE of the
    source of *ren*, a RENAME."""
    return isinstance(ren, schema.Rename) and isinstance(rec, schema.Create) and rec.path == ren.src


def _keep_of(rec: schema.Record, inverses: list[schema.Change]) -> tuple[int, int] | None:
    """(grave id, inode) a CREATE or LINK step moves its object to, from
    its inverse (which moves it into the grave)."""
    if (
        isinstance(rec, schema.Create | schema.Link)
        and inverses
        and isinstance(inverses[0], schema.Rename)
    ):
        gid = schema.grave_id(inverses[0].dst)
        if gid is not None:
            return gid, inverses[0].ino
    return None


class _BatchPlan:
    """Which undo steps make a batch (see RedoInverses): no two act on the same
    object or place, or one below the other's; none moves or removes a
    directory.  The exceptions: a step may act where a RENAME step before
    it in the batch moved an object to or from -- a CREATE or LINK step may
    remove what it moved there (``sed -i``'s temporary file, renamed back
    and then removed) -- as the plan follows what RENAME steps move, so
    that the inverse of each step is what it would be just before it, and
    each step, applied again after those that follow it, finds that what
    it acted on is gone and does nothing; and a META step may set the
    attributes of a directory that steps before it act in (in the batch,
    or in the one before it), with nothing after it acting there or below:
    those steps leave the directory's mode and owner as the inverse has
    them, and its times are set over by the step, applied again or not, and
    by a redo, which sets last the times the rollback found there before
    its first step in it (see `RedoInverses._parents`)."""

    def __init__(self, resolver: backing.Resolver, outer: _BatchPlan | None = None):
        self.r = resolver
        self.places: set[bytes] = set()  # where the batch acts
        self.above: set[bytes] = set()  # directories holding those
        self.objects: set[int] = set()  # what it acts on
        self.changed: set[int] = set()  # ... changing more than its name
        self.holds: dict[bytes, int | None] = {}  # place -> what will be there
        self.stats: dict[int, os.stat_result] = {}
        # the batch whose steps run meanwhile (see `RedoInverses.batch_ahead`):
        # its places, the directories above them and its objects are out of bounds
        self.outer = outer

    def _free(self, loc: bytes, above: bool = False) -> bool:
        """Whether the batch (and the one running meanwhile) acts neither
        at *loc*, nor above it, nor (unless *above*) below it."""
        return _free_of(self, loc, above) and (
            self.outer is None or _free_of(self.outer, loc, above)
        )

    def _taken(self, ino: int) -> bool:
        """Whether object *ino* is one the batch running meanwhile acts on."""
        return self.outer is not None and ino in self.outer.objects

    def _claim(self, loc: bytes) -> None:
        self.places.add(loc)
        if schema.grave_id(loc) is None:
            while loc:
                loc = loc.rpartition(b"/")[0]
                self.above.add(loc)

    def _there(self, loc: bytes) -> tuple[bool, os.stat_result | None]:
        """(whether *loc* can be looked at -- the batch does not act there
        or below it, and its directory is there -- what will be there when
        the batch gets to it)."""
        if loc in self.holds:
            ino = self.holds[loc]
            return True, None if ino is None else self.stats[ino]
        if not self._free(loc):
            return False, None
        try:
            return True, self.r.lstat_strict(loc)
        except OSError:
            return False, None

    def admit(self, rec: schema.Record) -> tuple[schema.Record, os.stat_result | None] | None:
        """Add *rec*'s step to the batch, or None when it cannot join it;
        with, for a CREATE or LINK, what its step will remove."""
        if isinstance(rec, schema.Create | schema.Link):
            ok, st = self._there(rec.path)
            if (
                not ok
                or st is None
                or stat.S_ISDIR(st.st_mode)
                or st.st_ino in self.changed
                or (rec.path not in self.holds and st.st_ino in self.objects)
                or self._taken(st.st_ino)
            ):
                return None
            self._claim(rec.path)
            # nothing may come there later in the batch: applied again, the
            # step would find it, not the object it removed
            self.holds.pop(rec.path, None)
            self.objects.add(st.st_ino)
            return rec, st
        if isinstance(rec, schema.Rename):  # the step moves rec.ino from dst to src
            ok, st = self._there(rec.dst)
            ok_src, st_src = self._there(rec.src)
            if (
                not ok
                or not ok_src
                or st is None
                or st.st_ino != rec.ino
                or st_src is not None
                or stat.S_ISDIR(st.st_mode)
                or rec.ino in self.changed
                or (rec.dst not in self.holds and rec.ino in self.objects)
                or self._taken(rec.ino)
            ):
                return None
            self._claim(rec.dst)
            self._claim(rec.src)
            self.holds[rec.dst] = None
            self.holds[rec.src] = rec.ino
            self.stats[rec.ino] = st
            self.objects.add(rec.ino)
            return rec, None
        if isinstance(rec, schema.Grave):  # the step moves it out of the grave
            gloc = schema.grave_loc(rec.grave)
            ok, st = self._there(gloc)
            ok_at, st_at = self._there(rec.path)
            if (
                not ok
                or not ok_at
                or st is None
                or st.st_ino != rec.ino
                or st_at is not None
                or stat.S_ISDIR(st.st_mode)
                or rec.ino in self.objects
                or self._taken(rec.ino)
            ):
                return None
            self._claim(gloc)
            self._claim(rec.path)  # (and no later step there: applied again, the
            self.objects.add(rec.ino)  # step would miss the object in the grave)
            return rec, None
        if isinstance(rec, schema.Meta | schema.Xattrs | schema.Chunk):
            # the attributes of a directory the batch acts in: the times its
            # steps leave there are set over (and a redo sets the times the
            # rollback found there last: see `RedoInverses._parents`)
            above = isinstance(rec, schema.Meta) and stat.S_ISDIR(rec.mode)
            if (
                rec.loc in self.holds
                or not self._free(rec.loc, above)
                or rec.ino in self.objects
                or self._taken(rec.ino)
            ):
                return None
            self._claim(rec.loc)
            self.objects.add(rec.ino)
            self.changed.add(rec.ino)
            return rec, None
        return None  # (an EXCHANGE: a step of its own)


def _free_of(plan: _BatchPlan, loc: bytes, above: bool = False) -> bool:
    if not above and loc in plan.above:
        return False
    if schema.grave_id(loc) is not None:
        return loc not in plan.places
    while True:
        if loc in plan.places:
            return False
        if not loc:
            return True
        loc = loc.rpartition(b"/")[0]


# -- where a redo acts, and whether anything changed there --------------------------------


InverseGroup = tuple[int, list[tuple[bytes, schema.Record]]]  # seq, [(key, record)...]


def _inverse_groups(store: Store, reverse: bool = False) -> Sequence[InverseGroup]:
    """(seq, [(key, record)...]) of the kept inverses, in seq order."""
    groups: list[InverseGroup] = []
    for key, val in store.redo_entries(schema.REDO_INVERSE):
        seq = schema.redo_inverse_seq(key)
        if not groups or groups[-1][0] != seq:
            groups.append((seq, []))
        groups[-1][1].append((key, schema.decode_or_damaged(val)))
    return groups[::-1] if reverse else groups


def _locs(rec: schema.Record) -> list[bytes]:
    if isinstance(rec, schema.Rename):
        return [rec.src, rec.dst]
    if isinstance(rec, schema.Exchange):
        return [rec.a, rec.b]
    if isinstance(rec, schema.Meta | schema.Xattrs | schema.Chunk):
        return [rec.loc]
    return []


def _locations(
    groups: Iterable[tuple[int, Sequence[schema.Record]]],
) -> tuple[list[bytes], list[bytes], dict[bytes, int]]:
    """What `touched_locations` finds when no undo step moved a directory:
    every location the inverses name, and those of the moves.  (The places
    an object moved by one step takes are named by the steps that move it,
    and a name it leaves is noted again by the step that leaves it.)  Also,
    for each location, the last step that named it (the seq of its record;
    *groups*: (seq, inverses) in the rollback's order, highest seq first)."""
    last: dict[bytes, int] = {}
    moved: set[bytes] = set()
    for seq, group in groups:
        for rec in group:
            here = _locs(rec)
            for loc in here:
                last[loc] = seq
            if isinstance(rec, schema.Rename | schema.Exchange):
                moved.update(here)
    return sorted(last), sorted(moved), last


def touched_locations(groups: Sequence[Sequence[schema.Record]]) -> tuple[list[bytes], list[bytes]]:
    """Every location a redo would act on, as it is named at the end of the
    rollback, and those of them where it moves what is there (renames,
    exchanges, moves into and out of the grave).  *groups*: the inverses,
    in the rollback's order; they name locations as they were when each was
    taken, so those are followed through the moves of the later undo steps
    (a directory moved moves what is below it; what lies inside a directory
    moved into the grave is not followed: the redo brings the directory
    back first)."""
    names = Names()
    followed: dict[Slot, bool] = {}  # slot -> whether the redo moves what is there

    def note(group: Sequence[schema.Record]) -> None:
        for rec in group:
            moves = isinstance(rec, schema.Rename | schema.Exchange)
            for loc in _locs(rec):
                s = names.slot(loc)
                if moves:
                    followed[s] = True
                else:
                    followed.setdefault(s, False)

    for group in groups:
        note(group)
        first = group[0]
        if isinstance(first, schema.Rename):  # the undo step moved src to dst
            names.move(first.src, first.dst)
            if schema.grave_id(first.dst) is not None:
                names.prune(first.dst)
            note(group)  # what it left
        elif isinstance(first, schema.Exchange):
            names.exchange(first.a, first.b)
            note(group)
    now = [(names.where(slot), moves) for slot, moves in followed.items()]
    return (
        sorted({loc for loc, _ in now if loc is not None}),
        sorted({loc for loc, moves in now if loc is not None and moves}),
    )


def fingerprints(resolver: backing.Resolver, locs: list[bytes]) -> list[tuple[bytes, bytes]]:
    """(location, its fingerprint as ``print_json`` writes it) for each of
    *locs* (within ``resolver.reading()``; see ``backing.fingerprints``)."""
    return [(loc, print_json(fp)) for loc, fp in backing.fingerprints(resolver, locs)]


def print_json(fp: list | None) -> bytes:
    """A fingerprint as JSON (the text ``to_json`` makes of it: this runs
    for every location a rollback touched)."""
    if fp is None:
        return b"null"
    if all(type(x) is int for x in fp):
        return ("[" + ", ".join(map(str, fp)) + "]").encode()
    return schema.to_json(fp)


def layers_text(ids: list[int]) -> str:
    return ("layers " if len(ids) > 1 else "layer ") + ", ".join(map(str, ids))


def check(store: Store, resolver: backing.Resolver) -> RedoState:
    """The kept rollback, if a redo can undo it now; else raise NothingToDo
    (there was none) or Refused (saying why not)."""
    note = state(store)
    if note is None or note.state in (BUILDING, REDOING):
        raise NothingToDo("nothing to redo: no rollback since the store was created")
    if note.state != READY:
        raise Refused(f"cannot redo the rollback of {layers_text(note.dropped)}: {note.why}")
    why = why_not(store, resolver, note)
    if why:
        raise Refused(
            f"cannot redo the rollback of {layers_text(note.dropped)}: {why}; nothing was changed"
        )
    return note


def _shown(paths: list[str]) -> str:
    return ", ".join(paths[:10]) + (f" and {len(paths) - 10} more" if len(paths) > 10 else "")


def why_not(store: Store, resolver: backing.Resolver, note: RedoState) -> str | None:
    """Why the kept rollback *st* (ready) cannot be redone now, or None:
    the layers changed, a location the redo touches is not as the rollback
    left it, or a change recorded since lies at one of them or below a
    location the redo moves."""
    expect = note.kept + ([note.fresh] if note.fresh is not None else [])
    if [x.id for x in store.layers()] != expect:
        return "the layers changed since"
    if store.next_seq != note.seq and not note.moves:
        # (kept by an older cowfs: changes since were captured into the open layer)
        return "the workspace changed after it"
    prints = {schema.split_redo_key(k)[1]: v for k, v in store.redo_entries(schema.REDO_PRINT)}
    moved = {schema.split_redo_key(k)[1] for k, _ in store.redo_entries(schema.REDO_MOVED)}
    changed = []
    with resolver.reading():
        for loc, val in prints.items():
            try:
                same = backing.fingerprint(resolver, loc) == schema.from_json(val)
            except ValueError:  # (damaged: nothing can be proved the same)
                same = False
            if not same:
                changed.append(schema.show_loc(loc))
    if changed:
        return f"{_shown(changed)} changed since the rollback"
    inside: dict[str, str] = {}
    for _, rec in store.records(note.seq, store.next_seq):
        if isinstance(rec, schema.Damaged):
            return "a record of a change made since the rollback is damaged"
        for loc in record_locs(rec):
            if loc in prints:
                inside.setdefault(schema.show_loc(loc), "")
                continue
            above = _moved_above(loc, moved)
            if above is not None:
                inside.setdefault(schema.show_loc(loc), schema.show_loc(above))
    if inside:
        where = sorted({d for d in inside.values() if d})
        return f"{_shown(sorted(inside))} changed since the rollback" + (
            f", inside {_shown(where)}, which the redo moves" if where else ""
        )
    return None


def record_locs(rec: schema.Change) -> list[bytes]:
    """The locations a journal record names."""
    if isinstance(rec, schema.Rename):
        return [rec.src, rec.dst]
    if isinstance(rec, schema.Exchange):
        return [rec.a, rec.b]
    return [schema.record_loc(rec)]


def _moved_above(loc: bytes, moved: set[bytes]) -> bytes | None:
    """The location in *moved* that *loc* lies below, if any."""
    if not moved or schema.grave_id(loc) is not None:
        return None
    i = loc.find(b"/")
    while i > 0:
        if loc[:i] in moved:
            return loc[:i]
        i = loc.find(b"/", i + 1)
    return None


def start(w: Writer) -> None:
    """In the transaction that plans the redo: mark it under way."""
    _put_state(w, replace(_state_in(w), state=REDOING))


def _objects(rec: schema.Record) -> tuple[int, ...]:
    """The objects (inodes) an inverse record moves or changes."""
    if isinstance(rec, schema.Rename):
        return (rec.ino,)
    if isinstance(rec, schema.Exchange):
        return rec.ino_a, rec.ino_b
    return (rec.ino,) if isinstance(rec, schema.Meta | schema.Xattrs | schema.Chunk) else ()


def _corrupt(store: Store, groups: Sequence[InverseGroup]) -> dict[int, str]:
    """Objects the redo would take out of the grave whose bytes no longer
    hash as they did when the rollback put them there: inode -> report
    (the redo leaves such an object in the store, as a rollback does)."""
    out: dict[int, str] = {}
    for _, group in groups:
        for _, rec in group:
            if not isinstance(rec, schema.Rename):
                continue
            gid = schema.grave_id(rec.dst)
            why = gravesum.verify(store, gid) if gid is not None else None
            if why is not None:
                out[rec.ino] = (
                    f"{schema.show_loc(rec.src)}: not redone: the file "
                    f"kept in the store is corrupt: {why}; it stays removed"
                )
    return out


class _Claims:
    """The locations a batch of inverse groups names (see `apply`), and the
    directories above them."""

    def __init__(self) -> None:
        self.locs: set[bytes] = set()
        self.above: set[bytes] = set()

    def meets(self, group: Sequence[schema.Record]) -> bool:
        """Whether *group* moves an object at a location the batch names, or
        what holds one of them."""
        for rec in group:
            if isinstance(rec, schema.Rename | schema.Exchange):
                for loc in _locs(rec):
                    if loc in self.locs or loc in self.above:
                        return True
        return False

    def add(self, group: Sequence[schema.Record]) -> None:
        for rec in group:
            for loc in _locs(rec):
                self.locs.add(loc)
                if schema.grave_id(loc) is None:
                    while loc:
                        loc = loc.rpartition(b"/")[0]
                        self.above.add(loc)


def apply(
    store: Store, undo: Undoer, failures: list[str], describe: Callable[[schema.Record], str]
) -> int:
    """Apply the kept inverses, last kept first; returns how many records
    were applied.  Resumable: applied groups are deleted a batch at a time,
    and a resumed redo applies those of the last batch again, in order.
    A batch holds no group that moves an object at a location an earlier
    group of it names, or what holds one (`_Claims`): applied again after
    those that follow it, each finds the object it set the bytes or
    attributes of where it left it (and sets them once more, as the groups
    after it do theirs again, in order), and the object it moved gone from
    where it was (and does nothing) -- no step fails or acts twice.  An
    object whose file kept in the grave is corrupt is skipped as a whole."""
    applied = 0
    groups = _inverse_groups(store)
    corrupt = _corrupt(store, groups)
    done: list[tuple[bytes, schema.Record]] = []
    claims = _Claims()

    def forget() -> None:
        nonlocal claims
        with store.write() as w:
            for key, rec in done:
                if isinstance(rec, schema.Chunk) and rec.digest:
                    w.deref(rec.digest)
                elif (
                    isinstance(rec, schema.Rename) and (gid := schema.grave_id(rec.dst)) is not None
                ):
                    if backing.lstat_at(store.grave_fd, str(gid).encode()) is None:
                        w.drop_grave(gid)  # out of the grave
                w.redo_delete(key)
        done.clear()
        claims = _Claims()

    for _, group in groups:
        records = [rec for _, rec in group]
        if done and claims.meets(records):
            forget()
        claims.add(records)
        for rec in records:
            bad = [ino for ino in _objects(rec) if ino in corrupt]
            if bad:
                for ino in bad:
                    if corrupt[ino] not in failures:
                        failures.append(corrupt[ino])
                continue
            try:
                undo.apply(rec)
                applied += 1
            except Exception as e:  # report by name, keep going
                failures.append(f"{describe(rec)}: {e}")
        done += group
        if len(done) >= RedoInverses.BATCH:
            forget()
    forget()
    return applied


def restore(w: Writer) -> list[int]:
    """In the transaction that ends a redo: the dropped layers come back
    (and the base a rollback of every layer opened goes); returns their ids."""
    note = _state_in(w)
    restored = []
    for kind, original, val in w.unpark():
        if kind == schema.REDO_LAYER:
            restored.append(schema.from_u64(original))
        elif kind == schema.REDO_RECORD:
            rec = schema.decode_or_damaged(val)
            if (
                isinstance(rec, schema.Grave)
                and backing.lstat_at(w.store.grave_fd, str(rec.grave).encode()) is not None
            ):
                w.regrave(rec.grave, rec.ino)
    # what changed since the rollback came after all of it: the top layer's now
    _dissolve(w, note, max(restored))
    return sorted(restored)


# -- for `cowfs check` -------------------------------------------------------------------


def references(store: Store, txn: lmdb.Transaction[bytes]) -> Iterator[tuple[bytes, schema.Record]]:
    """(kind, record) of every record the redo database holds: "r" a dropped
    layer's record, "v" an inverse (their chunks are referenced, and the
    grave entries they hold are in use)."""
    for key, val in store.redo_entries(txn=txn):
        kind, _ = schema.split_redo_key(key)
        if kind in (schema.REDO_RECORD, schema.REDO_INVERSE):
            yield kind, schema.decode_or_damaged(val)


def held_grave(kind: bytes, rec: schema.Record) -> tuple[int, int] | None:
    """(grave id, inode) a record of the redo database holds in the grave."""
    if kind == schema.REDO_RECORD and isinstance(rec, schema.Grave):
        return rec.grave, rec.ino
    if (
        kind == schema.REDO_INVERSE
        and isinstance(rec, schema.Rename)
        and (gid := schema.grave_id(rec.dst)) is not None
    ):
        return gid, rec.ino
    return None
