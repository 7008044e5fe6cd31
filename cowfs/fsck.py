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
from dataclasses import dataclass, field

from . import backing as B
from . import gravesum, redo
from . import pending as P
from . import schema as S
from .errors import StoreError
from .store import Store, digest
from .text import count


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


show = S.show_loc


def owners_of(store: Store, txn, seqs: set[int]) -> dict[int, int]:
    """Journal seq -> the object (inode) whose index entry points at it:
    how a damaged record's object is still known."""
    found: dict[int, int] = {}
    if not seqs:
        return found
    cur = txn.cursor(db=store.db_index)
    ok = cur.first()
    while ok:
        key = bytes(cur.key())
        _, ino, kind, _ = S.split_index_key(key)
        seq = S.index_seq(key, cur.value())
        if kind != S.IDX_CREATED and seq in seqs:
            found[seq] = ino
        ok = cur.next()
    return found


def unrestorable(
    store: Store, records: list[tuple[int, S.Record]]
) -> tuple[dict[int, str], set[int]]:
    """Objects among *records* whose pre-image is missing or corrupt, or
    whose undo record is damaged: inode -> what to report (a rollback
    leaves such an object as it is); and the damaged records whose object
    is known that way."""
    out: dict[int, str] = {}
    with store.read() as txn:
        damaged = {seq for seq, rec in records if isinstance(rec, S.Damaged)}
        names = {
            rec.ino: rec.loc for _, rec in records if isinstance(rec, S.Meta | S.Xattrs | S.Chunk)
        }
        owners = owners_of(store, txn, damaged)
        for seq, ino in owners.items():
            out[ino] = (
                f"{show(names.get(ino, b'?'))}: not restored: its undo record {seq} "
                "is damaged; the object is left as it is now"
            )
        for _, rec in records:
            if not isinstance(rec, S.Chunk) or rec.ino in out:
                continue
            problem = S.chunk_problem(rec, store.chunk_size)
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
            if not isinstance(rec, S.Grave) or rec.ino in out:
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
    Without *hashes*, chunk contents are not verified (a quick check).

    A rollback or redo a crash interrupted (resumed by the next session)
    leaves objects on their way into or out of the grave: what its steps
    move may or may not have moved yet.  Those are not problems; the
    resumed steps check each object they move and report one that is
    truly missing."""
    rep = Report()
    try:
        # (the store's own entries first: a damaged one names itself)
        _check_sealed(store, rep)
        layers = store.layers()
        redo_segment(store)
    except StoreError as e:
        rep.problems.append(Problem(str(e)))
        return rep
    starts = [(layer.start, layer.id) for layer in layers]
    if [s for s, _ in starts] != sorted(s for s, _ in starts):
        rep.problems.append(
            Problem("layer boundaries are out of order", [layer.id for layer in layers])
        )
    first = starts[0][0] if starts else store.next_seq
    uses: dict[bytes, list[tuple[int | None, str]]] = {}
    damaged: dict[int, int | None] = {}  # seq -> layer
    names: dict[int, str] = {}  # inode -> a path it had
    graved: dict[int, tuple[int | None, str]] = {}
    seqs: set[int] = set()
    # grave entries the interrupted rollback or redo moves (see above)
    moving: set[int] = set()
    with store.read() as txn:
        raw = S.meta_json(S.DB_META, S.K_PENDING, txn.get(S.K_PENDING, db=store.db_meta))
        pending = S.PendingRecord.from_json(raw) if raw is not None else None
        op = pending.op if pending is not None and P.files_left(pending) else None
        under_way, redoing = op is not None, op == "redo"
        dropping = pending.to if pending is not None and op == "rollback" else None
        cur = txn.cursor(db=store.db_journal)
        ok = cur.first()
        while ok:
            seq = S.from_u64(cur.key())
            seqs.add(seq)
            rep.records += 1
            owner = layer_of(starts, seq)
            if seq >= store.next_seq:
                rep.problems.append(
                    Problem(
                        f"record {seq} is beyond the journal's counter", [owner] if owner else []
                    )
                )
            rec = S.decode_or_damaged(cur.value())
            if isinstance(rec, S.Damaged):
                damaged[seq] = owner
                ok = cur.next()
                continue
            if not S.is_sealed(cur.value()):
                rep.unsealed += 1
            loc = S.record_loc(rec)
            if isinstance(rec, S.Meta | S.Xattrs | S.Chunk):
                names[rec.ino] = show(loc)
            if seq < first:
                rep.problems.append(
                    Problem(
                        f"record {seq} ({S.record_name(rec)} of {show(loc)}) belongs to no layer",
                        repairable=True,
                    )
                )
                rep.drop_records.append(seq)
            elif isinstance(rec, S.Chunk):
                problem = S.chunk_problem(rec, store.chunk_size)
                if problem is not None:
                    rep.problems.append(
                        Problem(
                            f"record {seq} (chunk of {show(loc)}) is invalid: {problem}; "
                            "what it would undo is lost",
                            [owner] if owner else [],
                            [show(loc)],
                        )
                    )
                if rec.digest:
                    uses.setdefault(rec.digest, []).append(
                        (owner, f"{show(loc)} (chunk {rec.chunk})")
                    )
            elif isinstance(rec, S.Grave):
                graved[rec.grave] = (owner, show(loc))
                if dropping is not None and owner is not None and owner >= dropping:
                    moving.add(rec.grave)  # (put back by the rollback, maybe)
            ok = cur.next()

        # what the last rollback kept for a redo uses chunks and grave entries too
        redo_damaged = 0
        for kind, rec in redo.references(store, txn):
            if isinstance(rec, S.Damaged):
                if kind == S.REDO_INVERSE:
                    redo_damaged += 1
                else:  # as it was in its layer: a redo brings it back as it is
                    rep.problems.append(
                        Problem("a record of a rolled-back layer (kept for a redo) is damaged")
                    )
                continue
            what = f"{show(S.record_loc(rec))} (kept for a redo)"
            if isinstance(rec, S.Chunk) and rec.digest:
                uses.setdefault(rec.digest, []).append((None, what))
            held = redo.held_grave(kind, rec)
            if held is None:
                continue
            if kind == S.REDO_INVERSE:
                graved[held[0]] = (None, what)
                if under_way:  # (moved in by the rollback, or out by the redo, maybe)
                    moving.add(held[0])
            elif txn.get(S.u64(held[0]), db=store.db_graves) is not None:
                graved[held[0]] = (None, what)
            elif redoing:
                # moved back into the grave by the redo, maybe: its end
                # enters it again (redo.restore)
                moving.add(held[0])
        if redo_damaged:
            rep.problems.append(
                Problem(
                    f"{count(redo_damaged, 'record')} kept for a redo "
                    f"{'is' if redo_damaged == 1 else 'are'} damaged "
                    "(repair discards what was kept: no redo)",
                    repairable=True,
                )
            )
            rep.drop_redo = True

        owners = owners_of(store, txn, set(damaged))
        for seq, owner in damaged.items():
            ino = owners.get(seq)
            why = S.damage_of(S.Damaged(txn.get(S.u64(seq), db=store.db_journal) or b""))
            rep.problems.append(
                Problem(
                    f"record {seq} is damaged: it {why}; what it would undo is lost",
                    [owner] if owner else [],
                    [names.get(ino, "?")] if ino is not None else [],
                )
            )

        # chunks: hashes, reference counts, unused ones
        cur = txn.cursor(db=store.db_chunks)
        ok = cur.first()
        present: set[bytes] = set()
        while ok:
            h, data = bytes(cur.key()), cur.value()
            present.add(h)
            rep.chunks += 1
            rep.bytes_checked += len(data)
            users = uses.get(h, [])
            if users and hashes and digest(data) != h:
                rep.corrupt_chunks.add(h)
                rep.problems.append(
                    Problem(
                        f"chunk {h.hex()} is corrupt: its bytes do not hash to its name",
                        [u for u, _ in users if u],
                        [p for _, p in users],
                    )
                )
            refs = txn.get(h, db=store.db_refs)
            refcount = S.from_u64(refs) if refs is not None else 0
            if not users:
                rep.problems.append(
                    Problem(f"chunk {h.hex()} is used by no record", repairable=True)
                )
                rep.drop_chunks.add(h)
            elif refcount != len(users):
                rep.problems.append(
                    Problem(
                        f"chunk {h.hex()} has reference count {refcount}, but {len(users)} "
                        "records use it",
                        [u for u, _ in users if u],
                        repairable=True,
                    )
                )
                rep.fix_refs[h] = len(users)
            ok = cur.next()
        for h, users in uses.items():
            if h not in present:
                rep.problems.append(
                    Problem(
                        f"chunk {h.hex()} is missing",
                        [u for u, _ in users if u],
                        [p for _, p in users],
                    )
                )
        cur = txn.cursor(db=store.db_refs)
        ok = cur.first()
        while ok:
            h = bytes(cur.key())
            if h not in present and h not in uses:
                rep.problems.append(
                    Problem(f"reference count of absent chunk {h.hex()}", repairable=True)
                )
                rep.fix_refs[h] = None
            ok = cur.next()

        # graves: entries, files, identity
        grave_files = set(grave_names(store))
        cur = txn.cursor(db=store.db_graves)
        ok = cur.first()
        while ok:
            gid, ino = S.from_u64(cur.key()), S.from_u64(cur.value())
            rep.graves += 1
            owner, path = graved.get(gid, (None, None))
            st = B.lstat_at(store.grave_fd, str(gid).encode())
            if path is None:
                rep.problems.append(
                    Problem(f"grave entry {gid} is held by no record", repairable=True)
                )
                rep.drop_graves.append(gid)
            elif st is None:
                if gid not in moving:
                    rep.problems.append(
                        Problem(
                            f"the removed object {path} (grave {gid}) is missing from the store",
                            [owner] if owner else [],
                            [path],
                        )
                    )
            elif st.st_ino != ino:
                rep.problems.append(
                    Problem(
                        f"the removed object {path} (grave {gid}) was "
                        f"replaced (inode {st.st_ino}, recorded {ino})",
                        [owner] if owner else [],
                        [path],
                    )
                )
            else:
                check_sum(store, txn, rep, gid, ino, owner, path, hashes)
            grave_files.discard(str(gid))
            ok = cur.next()
        if store.db_sums is not None:
            cur = txn.cursor(db=store.db_sums)
            ok = cur.first()
            while ok:
                gid = S.from_u64(cur.key())
                held_ino = txn.get(cur.key(), db=store.db_graves)
                s = S.decode_sum(cur.value())
                if held_ino is None or s is None or s.ino != S.from_u64(held_ino):
                    rep.drop_sums.append(gid)
                ok = cur.next()
            if rep.drop_sums:
                rep.problems.append(
                    Problem(
                        f"{len(rep.drop_sums)} hash entries of removed "
                        "files belong to no grave entry or do not fit it",
                        repairable=True,
                    )
                )
        for gid, (owner, path) in graved.items():
            if txn.get(S.u64(gid), db=store.db_graves) is None:
                rep.problems.append(
                    Problem(
                        f"the grave entry of removed object {path} (grave {gid}) is missing",
                        [owner] if owner else [],
                        [path],
                    )
                )
                grave_files.discard(str(gid))
        grave_files -= {str(gid) for gid in moving}
        for name in sorted(grave_files):
            rep.problems.append(Problem(f"grave file {name} is held by no record", repairable=True))
            rep.drop_grave_files.append(name)

        # index entries (a segment's, see redo, are the open layer's records
        # since the rollback)
        ids = {layer.id: layer.id for layer in layers}
        seg, since = redo_segment(store)
        if seg is not None and layers:
            ids[seg] = layers[-1].id
        cur = txn.cursor(db=store.db_index)
        ok = cur.first()
        stale = bad = 0
        while ok:
            key = bytes(cur.key())
            lid, _, kind, _ = S.split_index_key(key)
            found = S.index_seq(key, cur.value())
            if not S.is_sealed(cur.value()):
                rep.unsealed += 1
            if found is None:
                rep.drop_index.append(key)
                bad += 1
                ok = cur.next()
                continue
            seq = found
            if lid not in ids:
                stale_entry = True
            elif kind in S.INDEX_FLAGS:
                stale_entry = False
            elif seq not in seqs:
                # (the interrupted rollback deleted or kept the record: the
                # layer's entries go when it ends)
                stale_entry = dropping is None or lid < dropping
            else:
                stale_entry = layer_of(starts, seq) != ids[lid] or lid == seg and seq < since
            if stale_entry:
                rep.drop_index.append(key)
                stale += 1
            ok = cur.next()
        if stale:
            rep.problems.append(
                Problem(f"{stale} index entries point at no record of their layer", repairable=True)
            )
        if bad:
            rep.problems.append(
                Problem(
                    f"{count(bad, 'index entry', 'index entries')} fail their checksum (repair "
                    "drops them: what they said was captured is captured again when it changes)",
                    repairable=True,
                )
            )
        if store.db_who is not None:
            cur = txn.cursor(db=store.db_who)
            ok = cur.first()
            while ok:
                if S.key_layer(cur.key()) not in ids:
                    rep.drop_who.append(bytes(cur.key()))
                ok = cur.next()
            if rep.drop_who:
                rep.problems.append(
                    Problem(f"{len(rep.drop_who)} attributions belong to no layer", repairable=True)
                )
    return rep


def _check_sealed(store: Store, rep: Report) -> None:
    """The store's settings, counters and layer rows: each intact (a
    damaged one raises StoreError naming it); those an older cowfs wrote
    without a checksum are counted."""
    with store.read() as txn:
        for db, handle in ((S.DB_META, store.db_meta), (S.DB_LAYERS, store.db_layers)):
            cur = txn.cursor(db=handle)
            for key, raw in cur:
                S.open_sealed(db, bytes(key), bytes(raw))
                rep.unsealed += not S.is_sealed(raw)


def redo_segment(store: Store) -> tuple[int | None, int]:
    """The segment of the last rollback (see redo), if any, and the first
    seq recorded since that rollback."""
    note = redo.state(store)
    if note is None or note.segment is None:
        return None, 0
    return note.segment, note.seq


def check_sum(
    store: Store, txn, rep: Report, gid: int, ino: int, owner: int | None, path: str, hashes: bool
) -> None:
    """Grave object *gid* (object *ino*, which is there): its bytes against
    the hash recorded of them, if any (with *hashes*)."""
    s = gravesum.read_sum(store, gid, txn)
    if s is None or s.ino != ino:
        return  # (an entry of no use is reported with the others)
    if s.state == S.SUM_PENDING:
        rep.graves_pending += 1
    elif s.state == S.SUM_CHANGED:
        rep.graves_changed += 1
    elif s.state == S.SUM_HASHED:
        rep.graves_hashed += 1
        if not hashes:
            return
        rep.grave_bytes_checked += s.size
        why = gravesum.verify(store, gid, txn)
        if why is not None:
            rep.problems.append(
                Problem(
                    f"the removed file {path} is corrupt in the store: {why}",
                    [owner] if owner else [],
                    [path],
                )
            )


def grave_names(store: Store) -> list[str]:
    fd = os.open(B.proc(store.grave_fd), os.O_RDONLY | os.O_DIRECTORY)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def repair(store: Store, rep: Report, discard_redo=None) -> list[str]:
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
            B.remove_tree_at(store.grave_fd, os.fsencode(name))
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
