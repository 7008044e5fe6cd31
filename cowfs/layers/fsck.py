"""Integrity of the layer store: `cowfs check [--repair]`.

The check reads everything and writes nothing:

* every chunk hashes (xxh3-128) to its name;
* every chunk's reference count equals the records that use it, and no
  chunk is kept that nothing uses;
* every journal record decodes and lies inside a layer; a CHUNK record
  holds at most a chunk's bytes, or a range of zeros that ends within the
  largest file offset (``schema.chunk_problem``); the chunk of a
  CHUNK record and the grave entry of a GRAVE record exist, and a graved
  object is still the object that was removed (same inode) and, for a
  regular file hashed since it was removed (``gravesum``), still hashes
  (xxh3-128) to what was recorded;
* layer boundaries are in order and the journal agrees with its counter;
* every index entry points at a record of its own layer, and nothing lies
  in the grave that no record holds.

Each problem names the layers and workspace paths it affects.  ``repair``
fixes what can be fixed without inventing data: reference counts, unused
chunks, grave entries and files nothing refers to, stale index entries,
records outside every layer, hash entries of grave objects no grave entry
holds.  A corrupt or missing pre-image cannot be repaired; a rollback skips
the object it belongs to and reports it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import lmdb

from ..errors import StoreError
from ..storage import gravesum, schema
from ..storage.store import Layer, Store, digest
from ..system import backing
from ..text import count
from . import pending, redo


@dataclass
class Problem:
    what: str
    layers: list[int] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    repairable: bool = False

    def __str__(self) -> str:
        where = []
        if self.layers:
            where.append(
                "layer"
                + ("s " if len(self.layers) > 1 else " ")
                + ", ".join(map(str, sorted(set(self.layers))))
            )
        if self.paths:
            shown = sorted(set(self.paths))
            where.append(
                ", ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")
            )
        return (
            self.what
            + (f" ({'; '.join(where)})" if where else "")
            + ("" if self.repairable else " [cannot be repaired]")
        )

    def to_dict(self) -> dict:
        return {
            "problem": self.what,
            "layers": sorted(set(self.layers)),
            "paths": sorted(set(self.paths)),
            "repairable": self.repairable,
            "text": str(self),
        }


show = schema.show_loc


def owners_of(store: Store, txn: lmdb.Transaction[bytes], seqs: set[int]) -> dict[int, int]:
    """Journal seq -> the object (inode) whose index entry points at it:
    how a damaged record's object is still known."""
    found: dict[int, int] = {}
    if not seqs:
        return found
    cur = txn.cursor(db=store.db_index)
    ok = cur.first()
    while ok:
        key = bytes(cur.key())
        _, ino, kind, _ = schema.split_index_key(key)
        seq = schema.index_seq(key, cur.value())
        if kind != schema.IDX_CREATED and seq in seqs:
            found[seq] = ino
        ok = cur.next()
    return found


def unrestorable(
    store: Store, records: list[tuple[int, schema.Record]]
) -> tuple[dict[int, str], set[int]]:
    """Objects among *records* whose pre-image is missing or corrupt, or
    whose undo record is damaged: inode -> what to report (a rollback
    leaves such an object as it is); and the damaged records whose object
    is known that way."""
    out: dict[int, str] = {}
    with store.read() as txn:
        damaged = {seq for seq, rec in records if isinstance(rec, schema.Damaged)}
        names = {
            rec.ino: rec.loc
            for _, rec in records
            if isinstance(rec, schema.Meta | schema.Xattrs | schema.Chunk)
        }
        owners = owners_of(store, txn, damaged)
        for seq, ino in owners.items():
            out[ino] = (
                f"{show(names.get(ino, b'?'))}: not restored: its undo record {seq} "
                "is damaged; the object is left as it is now"
            )
        for _, rec in records:
            if not isinstance(rec, schema.Chunk) or rec.ino in out:
                continue
            problem = schema.chunk_problem(rec, store.chunk_size)
            if problem is not None:
                out[rec.ino] = (
                    f"{show(rec.loc)}: not restored: its pre-image record is invalid "
                    f"({problem}); the object is left as it is now"
                )
                continue
            if not rec.digest:
                continue
            loc, ino, index, length, h = rec
            data = txn.get(h, db=store.db_chunks)
            if data is None:
                why = "is missing"
            elif len(data) != length or digest(data) != h:
                why = "is corrupt"
            else:
                continue
            out[ino] = (
                f"{show(loc)}: not restored: its pre-image (chunk {index}) {why}; "
                "the file is left as it is now"
            )
        for _, rec in records:
            if not isinstance(rec, schema.Grave) or rec.ino in out:
                continue
            bad = gravesum.verify(store, rec.grave, txn)
            if bad is not None:
                out[rec.ino] = (
                    f"{show(rec.path)}: not restored: the removed file "
                    f"kept in the store is corrupt: {bad}; it stays removed"
                )
    return out, set(owners)


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)
    chunks: int = 0
    records: int = 0
    graves: int = 0
    graves_hashed: int = 0  # regular files in the grave verified by their hash
    graves_pending: int = 0  # not hashed yet (identity only until they are)
    graves_changed: int = 0  # changed since they were removed (identity only)
    unsealed: int = 0  # records and entries an older cowfs wrote without a checksum
    bytes_checked: int = 0  # of chunks
    grave_bytes_checked: int = 0
    corrupt_chunks: set[bytes] = field(default_factory=set)
    # what repair would do
    fix_refs: dict[bytes, int | None] = field(default_factory=dict)  # digest -> count/None
    drop_chunks: set[bytes] = field(default_factory=set)
    drop_records: list[int] = field(default_factory=list)
    drop_index: list[bytes] = field(default_factory=list)
    drop_who: list[bytes] = field(default_factory=list)
    drop_graves: list[int] = field(default_factory=list)
    drop_grave_files: list[str] = field(default_factory=list)
    drop_sums: list[int] = field(default_factory=list)
    drop_redo: bool = False

    def to_dict(self) -> dict:
        return {
            "ok": not self.problems,
            "chunks": self.chunks,
            "records": self.records,
            "graves": self.graves,
            "graves_hashed": self.graves_hashed,
            "graves_pending": self.graves_pending,
            "graves_changed": self.graves_changed,
            "bytes_checked": self.bytes_checked,
            "grave_bytes_checked": self.grave_bytes_checked,
            "unsealed": self.unsealed,
            "problems": [p.to_dict() for p in self.problems],
        }


def layer_of(starts: list[tuple[int, int]], seq: int) -> int | None:
    """The layer owning journal record *seq* (starts: (start, id) ascending)."""
    owner = None
    for start, lid in starts:
        if seq >= start:
            owner = lid
        else:
            break
    return owner


def check(store: Store, hashes: bool = True) -> Report:
    """Read the whole store and report every inconsistency (writes nothing).
    Without *hashes*, chunk contents are not verified (a quick check)."""
    return Fsck(store, hashes).run()


Users = list[tuple[int | None, str]]  # (the layer, what it is) of each record using a thing


class Fsck:
    """One reading of the whole store: a method per table or kind of record,
    in the order the report lists what they find; what one learns for the
    next (who uses each chunk, which records hold which grave entry) is kept
    in the fields.

    A rollback or redo a crash interrupted (resumed by the next session)
    leaves objects on their way into or out of the grave: what its steps
    move may or may not have moved yet.  Those are not problems; the
    resumed steps check each object they move and report one that is
    truly missing."""

    def __init__(self, store: Store, hashes: bool):
        self.store = store
        self.hashes = hashes
        self.rep = Report()
        self.layers: list[Layer] = []
        self.starts: list[tuple[int, int]] = []  # (start, id) of each layer
        self.segment: tuple[int | None, int] = (None, 0)  # see redo_segment
        # what the interrupted rollback or redo is doing, if one is
        self.under_way = self.redoing = False
        self.dropping: int | None = None  # the rollback's last layer
        self.seqs: set[int] = set()  # of the journal's records
        self.uses: dict[bytes, Users] = {}  # chunk -> who uses it
        self.damaged: dict[int, int | None] = {}  # seq -> layer
        self.names: dict[int, str] = {}  # inode -> a path it had
        self.graved: dict[int, tuple[int | None, str]] = {}  # grave entry -> who holds it
        # grave entries the interrupted rollback or redo moves (see above)
        self.moving: set[int] = set()
        self.present: set[bytes] = set()  # chunks in the store

    def run(self) -> Report:
        try:
            # (the store's own entries first: a damaged one names itself)
            self.check_sealed()
            self.layers = self.store.layers()
            self.segment = redo_segment(self.store)
        except StoreError as e:
            self.rep.problems.append(Problem(str(e)))
            return self.rep
        self.check_layer_order()
        with self.store.read() as txn:
            self.read_pending(txn)
            self.check_journal(txn)
            self.check_redo_references(txn)
            self.report_damaged(txn)
            self.check_chunks(txn)
            self.check_refcounts(txn)
            self.check_graves(txn)
            self.check_index(txn)
            self.check_attributions(txn)
        return self.rep

    def problem(
        self,
        what: str,
        layers: list[int | None] | None = None,
        paths: list[str] | None = None,
        repairable: bool = False,
    ) -> None:
        """Report a problem (of those of *layers* that are known: a record
        outside every layer has none)."""
        self.rep.problems.append(
            Problem(what, [lid for lid in layers or [] if lid], paths or [], repairable)
        )

    def check_sealed(self) -> None:
        """The store's settings, counters and layer rows: each intact (a
        damaged one raises StoreError naming it); those an older cowfs wrote
        without a checksum are counted."""
        store = self.store
        with store.read() as txn:
            for db, handle in (
                (schema.DB_META, store.db_meta),
                (schema.DB_LAYERS, store.db_layers),
            ):
                cur = txn.cursor(db=handle)
                for key, raw in cur:
                    schema.open_sealed(db, bytes(key), bytes(raw))
                    self.rep.unsealed += not schema.is_sealed(raw)

    def check_layer_order(self) -> None:
        """The layers begin in the order of their ids."""
        self.starts = [(layer.start, layer.id) for layer in self.layers]
        if [s for s, _ in self.starts] != sorted(s for s, _ in self.starts):
            self.rep.problems.append(
                Problem("layer boundaries are out of order", [layer.id for layer in self.layers])
            )

    def read_pending(self, txn: lmdb.Transaction[bytes]) -> None:
        """The rollback or redo under way, if one is."""
        store = self.store
        raw = schema.meta_json(
            schema.DB_META, schema.K_PENDING, txn.get(schema.K_PENDING, db=store.db_meta)
        )
        intent = schema.PendingRecord.from_json(raw) if raw is not None else None
        op = intent.op if intent is not None and pending.files_left(intent) else None
        self.under_way, self.redoing = op is not None, op == "redo"
        self.dropping = intent.to if intent is not None and op == "rollback" else None

    # -- the journal ---------------------------------------------------------------------

    def check_journal(self, txn: lmdb.Transaction[bytes]) -> None:
        """Every journal record, in order."""
        first = self.starts[0][0] if self.starts else self.store.next_seq
        cur = txn.cursor(db=self.store.db_journal)
        ok = cur.first()
        while ok:
            self.check_record(schema.from_u64(cur.key()), cur.value(), first)
            ok = cur.next()

    def check_record(self, seq: int, raw: bytes, first: int) -> None:
        """Journal record *seq* (*first*: the first seq of the lowest layer)."""
        rep = self.rep
        self.seqs.add(seq)
        rep.records += 1
        owner = layer_of(self.starts, seq)
        if seq >= self.store.next_seq:
            self.problem(f"record {seq} is beyond the journal's counter", [owner])
        rec = schema.decode_or_damaged(raw)
        if isinstance(rec, schema.Damaged):
            self.damaged[seq] = owner
            return
        if not schema.is_sealed(raw):
            rep.unsealed += 1
        loc = schema.record_loc(rec)
        if isinstance(rec, schema.Meta | schema.Xattrs | schema.Chunk):
            self.names[rec.ino] = show(loc)
        if seq < first:
            self.problem(
                f"record {seq} ({schema.record_name(rec)} of {show(loc)}) belongs to no layer",
                repairable=True,
            )
            rep.drop_records.append(seq)
        elif isinstance(rec, schema.Chunk):
            self.check_chunk_record(seq, rec, show(loc), owner)
        elif isinstance(rec, schema.Grave):
            self.graved[rec.grave] = (owner, show(loc))
            if self.dropping is not None and owner is not None and owner >= self.dropping:
                self.moving.add(rec.grave)  # (put back by the rollback, maybe)

    def check_chunk_record(self, seq: int, rec: schema.Chunk, loc: str, owner: int | None) -> None:
        """CHUNK record *seq*: valid, and a user of its chunk."""
        why = schema.chunk_problem(rec, self.store.chunk_size)
        if why is not None:
            self.problem(
                f"record {seq} (chunk of {loc}) is invalid: {why}; what it would undo is lost",
                [owner],
                [loc],
            )
        if rec.digest:
            self.uses.setdefault(rec.digest, []).append((owner, f"{loc} (chunk {rec.chunk})"))

    def check_redo_references(self, txn: lmdb.Transaction[bytes]) -> None:
        """What the last rollback kept for a redo uses chunks and grave
        entries too."""
        redo_damaged = 0
        for kind, rec in redo.references(self.store, txn):
            if isinstance(rec, schema.Damaged):
                if kind == schema.REDO_INVERSE:
                    redo_damaged += 1
                else:  # as it was in its layer: a redo brings it back as it is
                    self.problem("a record of a rolled-back layer (kept for a redo) is damaged")
                continue
            what = f"{show(schema.record_loc(rec))} (kept for a redo)"
            if isinstance(rec, schema.Chunk) and rec.digest:
                self.uses.setdefault(rec.digest, []).append((None, what))
            held = redo.held_grave(kind, rec)
            if held is not None:
                self.hold_for_redo(txn, kind, held[0], what)
        if redo_damaged:
            self.problem(
                f"{count(redo_damaged, 'record')} kept for a redo "
                f"{'is' if redo_damaged == 1 else 'are'} damaged "
                "(repair discards what was kept: no redo)",
                repairable=True,
            )
            self.rep.drop_redo = True

    def hold_for_redo(self, txn: lmdb.Transaction[bytes], kind: bytes, gid: int, what: str) -> None:
        """Grave entry *gid*, which a record of *kind* kept for a redo holds."""
        if kind == schema.REDO_INVERSE:
            self.graved[gid] = (None, what)
            if self.under_way:  # (moved in by the rollback, or out by the redo, maybe)
                self.moving.add(gid)
        elif txn.get(schema.u64(gid), db=self.store.db_graves) is not None:
            self.graved[gid] = (None, what)
        elif self.redoing:
            # moved back into the grave by the redo, maybe: its end
            # enters it again (redo.restore)
            self.moving.add(gid)

    def report_damaged(self, txn: lmdb.Transaction[bytes]) -> None:
        """The damaged journal records, each with the path of its object
        where an index entry still names it."""
        owners = owners_of(self.store, txn, set(self.damaged))
        for seq, owner in self.damaged.items():
            ino = owners.get(seq)
            raw = txn.get(schema.u64(seq), db=self.store.db_journal) or b""
            why = schema.damage_of(schema.Damaged(raw))
            self.problem(
                f"record {seq} is damaged: it {why}; what it would undo is lost",
                [owner],
                [self.names.get(ino, "?")] if ino is not None else [],
            )

    # -- chunks: hashes, reference counts, unused ones --------------------------------

    def check_chunks(self, txn: lmdb.Transaction[bytes]) -> None:
        """Every chunk in the store; then the chunks records use that are
        missing."""
        cur = txn.cursor(db=self.store.db_chunks)
        ok = cur.first()
        while ok:
            self.check_chunk(txn, bytes(cur.key()), cur.value())
            ok = cur.next()
        for h, users in self.uses.items():
            if h not in self.present:
                self.problem(
                    f"chunk {h.hex()} is missing", [u for u, _ in users], [p for _, p in users]
                )

    def check_chunk(self, txn: lmdb.Transaction[bytes], h: bytes, data: bytes) -> None:
        """Chunk *h*: its hash (with *hashes*), its users, its reference count."""
        rep = self.rep
        self.present.add(h)
        rep.chunks += 1
        rep.bytes_checked += len(data)
        users = self.uses.get(h, [])
        if users and self.hashes and digest(data) != h:
            rep.corrupt_chunks.add(h)
            self.problem(
                f"chunk {h.hex()} is corrupt: its bytes do not hash to its name",
                [u for u, _ in users],
                [p for _, p in users],
            )
        refs = txn.get(h, db=self.store.db_refs)
        refcount = schema.from_u64(refs) if refs is not None else 0
        if not users:
            self.problem(f"chunk {h.hex()} is used by no record", repairable=True)
            rep.drop_chunks.add(h)
        elif refcount != len(users):
            self.problem(
                f"chunk {h.hex()} has reference count {refcount}, but {len(users)} records use it",
                [u for u, _ in users],
                repairable=True,
            )
            rep.fix_refs[h] = len(users)

    def check_refcounts(self, txn: lmdb.Transaction[bytes]) -> None:
        """Reference counts of chunks that are neither there nor used."""
        cur = txn.cursor(db=self.store.db_refs)
        ok = cur.first()
        while ok:
            h = bytes(cur.key())
            if h not in self.present and h not in self.uses:
                self.problem(f"reference count of absent chunk {h.hex()}", repairable=True)
                self.rep.fix_refs[h] = None
            ok = cur.next()

    # -- graves: entries, files, identity ---------------------------------------------

    def check_graves(self, txn: lmdb.Transaction[bytes]) -> None:
        """Grave entries and the files they name; entries records hold that
        are missing; files no entry or record holds."""
        grave_files = set(grave_names(self.store))
        cur = txn.cursor(db=self.store.db_graves)
        ok = cur.first()
        while ok:
            gid = schema.from_u64(cur.key())
            self.check_grave(txn, gid, schema.from_u64(cur.value()))
            grave_files.discard(str(gid))
            ok = cur.next()
        self.check_grave_sums(txn)
        for gid, (owner, path) in self.graved.items():
            if txn.get(schema.u64(gid), db=self.store.db_graves) is None:
                self.problem(
                    f"the grave entry of removed object {path} (grave {gid}) is missing",
                    [owner],
                    [path],
                )
                grave_files.discard(str(gid))
        grave_files -= {str(gid) for gid in self.moving}
        for name in sorted(grave_files):
            self.problem(f"grave file {name} is held by no record", repairable=True)
            self.rep.drop_grave_files.append(name)

    def check_grave(self, txn: lmdb.Transaction[bytes], gid: int, ino: int) -> None:
        """Grave entry *gid* of object *ino*: held, there, the same object."""
        self.rep.graves += 1
        owner, path = self.graved.get(gid, (None, None))
        st = backing.lstat_at(self.store.grave_fd, str(gid).encode())
        if path is None:
            self.problem(f"grave entry {gid} is held by no record", repairable=True)
            self.rep.drop_graves.append(gid)
        elif st is None:
            if gid not in self.moving:
                self.problem(
                    f"the removed object {path} (grave {gid}) is missing from the store",
                    [owner],
                    [path],
                )
        elif st.st_ino != ino:
            self.problem(
                f"the removed object {path} (grave {gid}) was "
                f"replaced (inode {st.st_ino}, recorded {ino})",
                [owner],
                [path],
            )
        else:
            self.check_grave_sum(txn, gid, ino, owner, path)

    def check_grave_sum(
        self, txn: lmdb.Transaction[bytes], gid: int, ino: int, owner: int | None, path: str
    ) -> None:
        """Grave object *gid* (object *ino*, which is there): its bytes against
        the hash recorded of them, if any (with *hashes*)."""
        rep = self.rep
        s = gravesum.read_sum(self.store, gid, txn)
        if s is None or s.ino != ino:
            return  # (an entry of no use is reported with the others)
        if s.state == schema.SUM_PENDING:
            rep.graves_pending += 1
        elif s.state == schema.SUM_CHANGED:
            rep.graves_changed += 1
        elif s.state == schema.SUM_HASHED:
            rep.graves_hashed += 1
            if not self.hashes:
                return
            rep.grave_bytes_checked += s.size
            why = gravesum.verify(self.store, gid, txn)
            if why is not None:
                self.problem(
                    f"the removed file {path} is corrupt in the store: {why}", [owner], [path]
                )

    def check_grave_sums(self, txn: lmdb.Transaction[bytes]) -> None:
        """Hash entries of grave objects that no grave entry holds."""
        store, rep = self.store, self.rep
        if store.db_sums is None:
            return
        cur = txn.cursor(db=store.db_sums)
        ok = cur.first()
        while ok:
            gid = schema.from_u64(cur.key())
            held_ino = txn.get(cur.key(), db=store.db_graves)
            s = schema.decode_sum(cur.value())
            if held_ino is None or s is None or s.ino != schema.from_u64(held_ino):
                rep.drop_sums.append(gid)
            ok = cur.next()
        if rep.drop_sums:
            self.problem(
                f"{len(rep.drop_sums)} hash entries of removed "
                "files belong to no grave entry or do not fit it",
                repairable=True,
            )

    # -- the index and the attributions -----------------------------------------------

    def layer_ids(self) -> dict[int, int]:
        """The layer each layer id of an index entry stands for: its own, and
        for the segment of the last rollback (see redo) the open layer,
        whose records since the rollback it holds."""
        ids = {layer.id: layer.id for layer in self.layers}
        seg = self.segment[0]
        if seg is not None and self.layers:
            ids[seg] = self.layers[-1].id
        return ids

    def check_index(self, txn: lmdb.Transaction[bytes]) -> None:
        """Index entries: intact, and each pointing at a record of its layer."""
        rep = self.rep
        ids = self.layer_ids()
        cur = txn.cursor(db=self.store.db_index)
        ok = cur.first()
        stale = bad = 0
        while ok:
            key = bytes(cur.key())
            lid, _, kind, _ = schema.split_index_key(key)
            found = schema.index_seq(key, cur.value())
            if not schema.is_sealed(cur.value()):
                rep.unsealed += 1
            if found is None:
                rep.drop_index.append(key)
                bad += 1
            elif self.stale_index_entry(ids, lid, kind, found):
                rep.drop_index.append(key)
                stale += 1
            ok = cur.next()
        if stale:
            self.problem(
                f"{stale} index entries point at no record of their layer", repairable=True
            )
        if bad:
            self.problem(
                f"{count(bad, 'index entry', 'index entries')} fail their checksum (repair "
                "drops them: what they said was captured is captured again when it changes)",
                repairable=True,
            )

    def stale_index_entry(self, ids: dict[int, int], lid: int, kind: bytes, seq: int) -> bool:
        """Whether an index entry of layer *lid* that points at record *seq*
        points at no record of its layer."""
        seg, since = self.segment
        if lid not in ids:
            return True
        if kind in schema.INDEX_FLAGS:
            return False
        if seq not in self.seqs:
            # (the interrupted rollback deleted or kept the record: the
            # layer's entries go when it ends)
            return self.dropping is None or lid < self.dropping
        return layer_of(self.starts, seq) != ids[lid] or lid == seg and seq < since

    def check_attributions(self, txn: lmdb.Transaction[bytes]) -> None:
        """Attributions (who wrote what) of layers that are gone."""
        store, rep = self.store, self.rep
        if store.db_who is None:
            return
        ids = self.layer_ids()
        cur = txn.cursor(db=store.db_who)
        ok = cur.first()
        while ok:
            if schema.key_layer(cur.key()) not in ids:
                rep.drop_who.append(bytes(cur.key()))
            ok = cur.next()
        if rep.drop_who:
            self.problem(f"{len(rep.drop_who)} attributions belong to no layer", repairable=True)


def redo_segment(store: Store) -> tuple[int | None, int]:
    """The segment of the last rollback (see redo), if any, and the first
    seq recorded since that rollback."""
    note = redo.state(store)
    if note is None or note.segment is None:
        return None, 0
    return note.segment, note.seq


def grave_names(store: Store) -> list[str]:
    fd = os.open(backing.proc(store.grave_fd), os.O_RDONLY | os.O_DIRECTORY)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def repair(
    store: Store, rep: Report, discard_redo: Callable[[str], None] | None = None
) -> list[str]:
    """Carry out what *rep* found repairable, in one transaction (grave
    files are removed after it commits); return what was done.
    *discard_redo*: how to drop a damaged redo (LayerFiles.discard_redo, which
    tells the mount; default: directly)."""
    done = []
    if rep.drop_redo:
        (discard_redo or functools.partial(redo.discard, store))(
            "its records were damaged (discarded by cowfs check --repair)"
        )
        done.append("discarded what was kept for a redo")
        rep = check(store, hashes=False)  # (reference counts without it)
    with store.write() as w:
        for h, n in rep.fix_refs.items():
            w.set_refcount(h, n)
        for h in rep.drop_chunks:
            w.drop_chunk(h)
        for seq in rep.drop_records:
            w.delete_record(seq)
        for key in rep.drop_index:
            w.drop_index_entry(key)
        for key in rep.drop_who:
            w.drop_attribution(key)
        for gid in rep.drop_graves:
            w.drop_grave(gid)
        for gid in rep.drop_sums:
            w.drop_sum(gid)
    if rep.fix_refs:
        done.append(f"set {len(rep.fix_refs)} reference counts to the records that use them")
    if rep.drop_chunks:
        done.append(f"removed {count(len(rep.drop_chunks), 'chunk')} no record uses")
    if rep.drop_records:
        done.append(f"removed {count(len(rep.drop_records), 'record')} outside every layer")
    if rep.drop_index or rep.drop_who:
        done.append(f"removed {len(rep.drop_index) + len(rep.drop_who)} stale index entries")
    for gid in rep.drop_graves:
        rep.drop_grave_files.append(str(gid))
    for name in rep.drop_grave_files:
        try:
            backing.remove_tree_at(store.grave_fd, os.fsencode(name))
        except FileNotFoundError:
            pass
    if rep.drop_graves or rep.drop_grave_files:
        done.append(f"removed {len(set(rep.drop_grave_files))} grave entries no record holds")
    if rep.drop_sums:
        done.append(
            f"removed {len(rep.drop_sums)} hash entries of removed files that belonged to nothing"
        )
    store.forget_layer_cache()
    return done
