"""The layer store: an LMDB environment (see ``schema``) plus a grave
directory holding whole objects that were unlinked or replaced.

The store is used by exactly one process at a time (the mount daemon, or a
control command working on an unmounted workspace); an exclusive ``flock`` on
``STORE/lock`` enforces that.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import stat
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import lmdb
import xxhash

from ..errors import AlreadyMounted, NoStore, StoreError
from ..system import backing, trust
from ..system.mounts import not_owner
from . import schema
from .schema import PendingRecord

MAP_SIZE = 64 << 30
RECORD_OVERHEAD = 64  # LMDB node and index entry per record, roughly
AUDIT_RESERVE = 64 << 20  # free space below which audit events are not written
FULL_MARGIN = 4 << 20  # a failed write with less room than this: the disk is full
DEFAULT_CHUNK_SIZE = 64 << 10

# The pending record: schema.PendingRecord (see cowfs/layers/pending.py), kept as JSON
# {"op": "rollback", "redo", "commit" or "checkpoint", "files": whether the
# file part is done, "steps": [{"do", "provider", "layer", "data", "state",
# ...}], and the op's own fields}.


@dataclass(frozen=True)
class Layer:
    id: int
    start: int
    created: float
    message: str
    runs: tuple = ()  # records of `cowfs run` steps (dicts), oldest first
    snapshots: tuple = ()  # provider snapshots taken with the layer, in order
    postmortems: tuple = ()  # diagnostics captured before reverting layers above
    drift: tuple = ()  # accepted drift: paths changed while not mounted
    agent: dict | None = None  # the agent event (prompt, tool call) that opened the layer
    turns: tuple = ()  # agent events of layers merged into this one, oldest first
    # its net changes, counted once it was below the open layer: (its end,
    # its records, changes, paths whose times alone differ)
    counted: tuple = ()

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "start": self.start,
            "created": self.created,
            "message": self.message,
            "runs": list(self.runs),
            "snapshots": list(self.snapshots),
            "postmortems": list(self.postmortems),
            "drift": list(self.drift),
            "agent": self.agent,
            "turns": list(self.turns),
        }


def digest(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def need(txn: lmdb.Transaction[bytes], key: bytes, db: lmdb._Database | None = None) -> bytes:
    """The value at *key*, which a sound store has (StoreError if it lacks it)."""
    raw = txn.get(key, db=db)
    if raw is None:
        raise StoreError(f"the store is damaged: it has no entry {key!r}")
    return raw


def meta_int(txn: lmdb.Transaction[bytes], key: bytes) -> int:
    """A counter or setting of the meta database (*txn* opened on it),
    which a sound store has, intact."""
    return schema.meta_int(key, need(txn, key))


_LAYER_INO = struct.Struct(">QQ")  # (the prefix of an object's index keys in a layer)


def scan(
    txn: lmdb.Transaction[bytes], db: lmdb._Database | None, prefix: bytes
) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of every entry of *db* whose key starts with *prefix*.
    Collect them (list()) before writing to *db* in the same transaction."""
    cur = txn.cursor(db=db)
    ok = cur.set_range(prefix)
    while ok and cur.key().startswith(prefix):
        yield bytes(cur.key()), bytes(cur.value())
        ok = cur.next()


# -- the store's identity ---------------------------------------------------------
# STORE/identity (JSON {"store": a random id, "generation": n}, written by
# replacing it, fsynced) says which database belongs to the store and how
# recent it must be; the meta entry ``identity`` in LMDB says the same of
# the database.  Each writable opening moves the generation on (the
# database first, then the file: a crash between leaves the database one
# ahead, never behind), so a database that is missing, emptied, from
# another store or put back from an older copy is an error, never a fresh
# start over the grave.

IDENTITY = "identity"


def read_identity(dirfd: int) -> dict | None:
    try:
        fd = os.open(IDENTITY, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    except FileNotFoundError:
        return None
    try:
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        ident = schema.from_json(raw)
        if isinstance(ident["store"], str) and isinstance(ident["generation"], int):
            return {"store": ident["store"], "generation": ident["generation"]}
    except (ValueError, KeyError, TypeError):
        pass
    raise StoreError(
        "the store's identity file is damaged; if its database is the right one, remove "
        f"the file ({IDENTITY}) and it is made again from the database"
    )


def write_identity(dirfd: int, ident: dict) -> None:
    """Replace STORE/identity, durably."""
    tmp = IDENTITY + ".new"
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dirfd,
    )
    try:
        os.write(fd, schema.to_json(ident) + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, IDENTITY, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    d = os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=dirfd)
    try:
        os.fsync(d)
    finally:
        os.close(d)


def check_identity(shown: str, file: dict | None, db: dict | None) -> None:
    """The database is the store's, and no older than it: StoreError (saying
    what is wrong and what to do) otherwise.  (Either may be absent: a store
    from before identities, or a file removed to accept the database.)"""
    if file is None:
        return
    if db is None:
        raise StoreError(
            f"store {shown}: its database (db/) is not the one the store was using (it has "
            "no identity): put the store's own db/ back; to use this one anyway, remove "
            f"{IDENTITY}"
        )
    if db["store"] != file["store"]:
        raise StoreError(
            f"store {shown}: its database (db/) belongs to another store: put the store's own "
            f"db/ back; to use this one anyway, remove {IDENTITY}"
        )
    if db["generation"] not in (file["generation"], file["generation"] + 1):
        raise StoreError(
            f"store {shown}: its database (db/) is an older copy (generation {db['generation']}, "
            f"the store is at {file['generation']}): what was recorded since that copy is not "
            f"in it; put the current db/ back; to use this one anyway, remove {IDENTITY}"
        )


def check_map(env: lmdb.Environment, path: str, shown: str) -> None:
    """A database file shorter than the pages LMDB says are in use would
    kill the process (SIGBUS) when one of them is read: an error instead."""
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = os.stat(os.path.join(path, "db", "data.mdb")).st_size
    if size < need:
        raise StoreError(
            f"store {shown}: its database is truncated (db/data.mdb has {size} bytes, its "
            f"pages end at {need}): put db/ back from a backup"
        )


# Filesystems that number their devices anew at each mount (an overlay, a
# btrfs subvolume): a workspace root there is known again by its inode
# number and its file handle, which name the same directory whatever
# device number the mount got.
REMOUNTED_DEV = frozenset((backing.OVERLAYFS_MAGIC, 0x9123683E))  # (overlay, btrfs)


@dataclass(frozen=True)
class WorkspaceRoot:
    """What a store knows its workspace's root directory by."""

    st: os.stat_result
    fs: int  # the filesystem's type (statfs f_type)
    handle: bytes  # its file handle, without the mount's id (b"": none)

    @classmethod
    def of(cls, workspace: str) -> WorkspaceRoot:
        fd = os.open(workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return cls(os.fstat(fd), backing.fs_type(fd), backing.stable_handle(fd) or b"")
        finally:
            os.close(fd)

    def is_owner(self, owner: dict) -> bool:
        """Whether a store's record of its workspace (``owner``) names this
        directory."""
        if (owner["dev"], owner["ino"]) == (self.st.st_dev, self.st.st_ino):
            return True
        return (
            self.fs in REMOUNTED_DEV
            and owner.get("fs") == self.fs
            and owner["ino"] == self.st.st_ino
            and bool(self.handle)
            and owner.get("handle") == self.handle.hex()
        )


class LimitReached(OSError):
    """ENOSPC because a capture would take the store past --max-store
    (not because the disk is full)."""


class Writer:
    """One write transaction; records, chunks and index entries written
    through it become durable (against a process crash) together."""

    def __init__(self, store: Store, txn: lmdb.Transaction[bytes]):
        self.store = store
        self.txn = txn
        self.seq = store._next_seq
        self.used: int | None = None  # store bytes in use, once --max-store asks
        # what was appended (for Store.on_append); None once a record already
        # written is deleted or put back (the journal's epoch moves on)
        self.written: list[tuple[int, schema.Record]] | None = []

    def record(self, rec: schema.Change) -> int:
        """Append *rec* to the journal; return its sequence number."""
        data = schema.encode_record(rec)
        self.reserve(len(data) + RECORD_OVERHEAD)
        seq = self.seq
        self.txn.put(schema.u64(seq), data, db=self.store.db_journal)
        self.seq += 1
        if self.written is not None:
            self.written.append((seq, rec))
        return seq

    def rewrites(self) -> None:
        """This transaction deletes or puts back journal records."""
        self.written = None

    def delete_record(self, seq: int) -> None:
        """Delete one journal record and release what it references."""
        self.rewrites()
        key = schema.u64(seq)
        data = self.txn.get(key, db=self.store.db_journal)
        if data is None:
            return
        rec = schema.decode_or_damaged(data)
        if isinstance(rec, schema.Chunk) and rec.digest:
            self.deref(rec.digest)
        elif isinstance(rec, schema.Grave):
            self.drop_grave(rec.grave)
        self.txn.delete(key, db=self.store.db_journal)

    def reserve(self, n: int) -> None:
        """--max-store: fail (ENOSPC, before the change is made) when *n* more
        bytes of undo data would take the store past its limit."""
        limit = self.store.max_store
        if not limit:
            return
        if self.used is None:
            self.used = self.store.data_bytes(self.txn)
        self.used += n
        if self.used > limit:
            raise LimitReached(
                errno.ENOSPC,
                f"cowfs store limit reached ({limit} bytes; "
                "commit, roll back or raise --max-store)",
            )

    def put_chunk(self, data: bytes) -> bytes:
        h = digest(data)
        refs = self.txn.get(h, db=self.store.db_refs)
        if refs is None:
            self.reserve(len(data) + RECORD_OVERHEAD)
            self.txn.put(h, data, db=self.store.db_chunks)
        self.set_refcount(h, 1 if refs is None else schema.from_u64(refs) + 1)
        return h

    def deref(self, h: bytes) -> None:
        refs = self.txn.get(h, db=self.store.db_refs)
        if refs is None:
            return
        n = schema.from_u64(refs) - 1
        if n <= 0:
            self.drop_chunk(h)
        else:
            self.set_refcount(h, n)

    def set_refcount(self, h: bytes, n: int | None) -> None:
        """Chunk *h*'s reference count is *n* (None: it has none)."""
        if n is None:
            self.txn.delete(h, db=self.store.db_refs)
        else:
            self.txn.put(h, schema.u64(n), db=self.store.db_refs)

    def drop_chunk(self, h: bytes) -> None:
        """Chunk *h* goes, whatever its reference count says."""
        self.txn.delete(h, db=self.store.db_chunks)
        self.txn.delete(h, db=self.store.db_refs)

    def drop_index(self, layer_id: int, keep: set[int]) -> None:
        """Forget what layer *layer_id* captured but for the entries of the
        records *keep* (seqs): later changes of those objects are captured
        again, unless a record kept holds their state already."""
        for key, val in list(scan(self.txn, self.store.db_index, schema.index_prefix(layer_id))):
            if (
                schema.split_index_key(key).kind in schema.INDEX_FLAGS
                or schema.index_seq(key, val) not in keep
            ):
                self.txn.delete(key, db=self.store.db_index)

    def drop_index_entry(self, key: bytes) -> None:
        self.txn.delete(key, db=self.store.db_index)

    def drop_attribution(self, key: bytes) -> None:
        if self.store.db_who is not None:
            self.txn.delete(key, db=self.store.db_who)

    def index_put(
        self, layer: int, ino: int, kind: bytes, seq: int, chunk: int | None = None
    ) -> None:
        key = schema.index_key(layer, ino, kind, chunk)
        self.txn.put(key, schema.index_value(key, seq), db=self.store.db_index)

    def new_grave(self, ino: int, st: os.stat_result | None = None) -> int:
        """A grave entry for object *ino*, which the caller moves into the
        grave after this transaction; *st*: its stat before the move (a
        regular file's bytes are then hashed later, see ``gravesum``)."""
        gid = self.store._next_grave
        self.store._next_grave += 1  # (written when the transaction ends)
        self.txn.put(schema.u64(gid), schema.u64(ino), db=self.store.db_graves)
        if st is not None:
            self._pending_sum(gid, st)
        return gid

    def regrave(self, gid: int, ino: int) -> None:
        """Grave entry *gid* holds object *ino* again (a redo moved it back
        there).  A hash taken before is kept (it was never removed if the
        object never left); otherwise the object is hashed again."""
        self.txn.put(schema.u64(gid), schema.u64(ino), db=self.store.db_graves)
        if self.store.db_sums is not None and self.grave_sum(gid) is None:
            st = os.stat(str(gid), dir_fd=self.store.grave_fd, follow_symlinks=False)
            if st.st_ino == ino:
                self._pending_sum(gid, st)

    def _pending_sum(self, gid: int, st: os.stat_result) -> None:
        if stat.S_ISREG(st.st_mode):
            self.put_grave_sum(
                gid,
                schema.encode_sum(
                    schema.GraveSum(
                        schema.SUM_PENDING, st.st_ino, st.st_size, st.st_mtime_ns, time.time_ns()
                    )
                ),
            )

    def drop_grave(self, gid: int) -> None:
        """Grave entry *gid* no longer holds anything (and its hash goes)."""
        self.txn.delete(schema.u64(gid), db=self.store.db_graves)
        self.drop_sum(gid)

    # (the hash entries of grave files: see gravesum)

    def grave_sum(self, gid: int) -> bytes | None:
        """The hash entry of grave file *gid*, as stored (see ``schema.decode_sum``)."""
        if self.store.db_sums is None:
            return None
        return self.txn.get(schema.u64(gid), db=self.store.db_sums)

    def put_grave_sum(self, gid: int, raw: bytes) -> None:
        if self.store.db_sums is not None:
            self.txn.put(schema.u64(gid), raw, db=self.store.db_sums)

    def drop_sum(self, gid: int) -> None:
        if self.store.db_sums is not None:
            self.txn.delete(schema.u64(gid), db=self.store.db_sums)

    def drop_layer(self, layer_id: int) -> None:
        """Delete a layer's row, what it captured (index) and who did it."""
        self._take_layer(layer_id, park=False)

    def _take_layer(self, layer_id: int, park: bool) -> None:
        """Delete a layer's row, index entries and attributions; with
        *park*, into the redo database."""
        st = self.store
        for db, kind in ((st.db_index, schema.REDO_INDEX), (st.db_who, schema.REDO_WHO)):
            for key, val in list(scan(self.txn, db, schema.index_prefix(layer_id))):
                if park:
                    self.redo_put(schema.redo_kept_key(kind, key), val)
                self.txn.delete(key, db=db)
        row = self.txn.get(schema.u64(layer_id), db=st.db_layers)
        if row is not None:
            if park:
                self.redo_put(schema.redo_layer_key(layer_id), row)
            self.txn.delete(schema.u64(layer_id), db=st.db_layers)

    # -- the redo database (what the last rollback kept: see redo.py) ----------

    def _redo_db(self) -> lmdb._Database:
        assert self.store.db_redo is not None  # (opened writable: it is created)
        return self.store.db_redo

    def redo_get(self, key: bytes) -> bytes | None:
        return self.txn.get(key, db=self._redo_db())

    def redo_put(self, key: bytes, value: bytes) -> None:
        self.txn.put(key, value, db=self._redo_db())

    def redo_delete(self, key: bytes) -> None:
        self.txn.delete(key, db=self._redo_db())

    def redo_entries(self, prefix: bytes = b"") -> list[tuple[bytes, bytes]]:
        """(key, value) of the redo database's entries under *prefix*."""
        return list(scan(self.txn, self._redo_db(), prefix))

    def park_record(self, seq: int) -> bool:
        """Move journal record *seq* into the redo database (kept for a
        redo); False when it is not in the journal (moved already)."""
        raw = self.txn.get(schema.u64(seq), db=self.store.db_journal)
        if raw is None:
            return False
        self.rewrites()
        self.redo_put(schema.redo_record_key(seq), raw)
        self.txn.delete(schema.u64(seq), db=self.store.db_journal)
        return True

    def park_layer(self, layer_id: int) -> None:
        """Move a dropped layer's row, index entries and attributions into
        the redo database."""
        self._take_layer(layer_id, park=True)

    def unpark(self) -> list[tuple[bytes, bytes, bytes]]:
        """Empty the redo database: what ``park_record`` and ``park_layer``
        moved there goes back where it came from.  Returns (kind, original
        key, value) of what went back."""
        st = self.store
        self.rewrites()
        targets = {
            schema.REDO_LAYER: st.db_layers,
            schema.REDO_RECORD: st.db_journal,
            schema.REDO_INDEX: st.db_index,
            schema.REDO_WHO: st.db_who,
        }
        back = []
        for key, val in self.redo_entries():
            kind, original = schema.split_redo_key(key)
            if kind in targets:
                self.txn.put(original, val, db=targets[kind])
                back.append((kind, original, val))
            self.redo_delete(key)
        return back

    def holds_grave(self, gid: int) -> bool:
        """Whether grave entry *gid* is in use."""
        return self.txn.get(schema.u64(gid), db=self.store.db_graves) is not None

    def layer_row(self, layer_id: int) -> dict | None:
        key = schema.u64(layer_id)
        return schema.meta_json(schema.DB_LAYERS, key, self.txn.get(key, db=self.store.db_layers))

    def put_layer_row(self, layer_id: int, row: dict) -> None:
        key = schema.u64(layer_id)
        self.txn.put(
            key, schema.seal(schema.DB_LAYERS, key, schema.to_json(row)), db=self.store.db_layers
        )

    def delete_layer_row(self, layer_id: int) -> None:
        self.txn.delete(schema.u64(layer_id), db=self.store.db_layers)

    def merge_index(self, upper: int, lower: int) -> None:
        """What layer *upper* captured (index entries, attributions) becomes
        layer *lower*'s, whose records lie before *upper*'s: an entry the
        lower layer already has wins (it is older), and the record of the
        upper one is deleted, as is the record of a change of an object the
        lower layer created (nothing to restore of it there).

        Except the upper layer's META record of a regular file that was
        smaller when the upper layer was opened than when the lower one
        was: it stays (unindexed), so that a rollback still cuts the file
        to that size before the lower layer's META record sets the older
        size again.  A truncation in the lower layer records only the cut
        chunks that held data (``Recorder.data``, *zeroing*): the holes it
        cut read as zeros again only if what the upper layer wrote past its
        own size (uncaptured) is cut off first."""
        txn, st = self.txn, self.store
        created_below: dict[int, bool] = {}
        for key, val in list(scan(txn, st.db_index, schema.index_prefix(upper))):
            _, ino, kind, chunk = schema.split_index_key(key)
            txn.delete(key, db=st.db_index)
            seq = schema.index_seq(key, val)
            if seq is None:  # (damaged: its record, if any, stays where it is)
                continue
            if ino not in created_below:
                created_below[ino] = (
                    txn.get(schema.index_key(lower, ino, schema.IDX_CREATED), db=st.db_index)
                    is not None
                )
            if kind == schema.IDX_ZEROS and chunk is not None and not created_below[ino]:
                self._merge_zeros(lower, ino, chunk, seq)
                continue
            below = schema.index_key(lower, ino, kind, chunk)
            lower_val = txn.get(below, db=st.db_index)
            if kind not in schema.INDEX_FLAGS and (created_below[ino] or lower_val is not None):
                if not (
                    kind == schema.IDX_META
                    and lower_val is not None
                    and not created_below[ino]
                    and self._cuts_first(seq, schema.index_seq(below, lower_val))
                ):
                    self.delete_record(seq)
            elif lower_val is None or (
                kind == schema.IDX_CREATED and seq and schema.index_seq(below, lower_val) == 0
            ):  # (made at a captured path above pins it below too: ``schema.pins``)
                txn.put(below, schema.index_value(below, seq), db=st.db_index)
        if st.db_who is not None:
            for key, writer in list(scan(txn, st.db_who, schema.index_prefix(upper))):
                txn.delete(key, db=st.db_who)
                lower_key = schema.with_layer(key, lower)
                if txn.get(lower_key, db=st.db_who) is None:
                    txn.put(lower_key, writer, db=st.db_who)

    def _merge_zeros(self, lower: int, ino: int, chunk: int, seq: int) -> None:
        """A range of zeros the upper layer recorded (record *seq*, from
        *chunk*) becomes layer *lower*'s.  Where it overlaps what the lower
        layer recorded, the lower record (older) holds the state at its
        start and wins: a rollback applies it after this one, a reading of
        the journal keeps it (so the range is not split).  Only a range the
        lower layer begins at the same chunk takes the index entry: this
        one is cut to begin past it (rewritten in place), or deleted when
        it covers no more -- a step for each such lower range."""
        txn, st = self.txn, self.store
        C = st.chunk_size
        raw = txn.get(schema.u64(seq), db=st.db_journal)
        rec = schema.decode_or_damaged(raw) if raw is not None else None
        if not isinstance(rec, schema.Chunk) or rec.digest:  # (not one: as any entry)
            key = schema.index_key(lower, ino, schema.IDX_ZEROS, chunk)
            if txn.get(key, db=st.db_index) is None:
                txn.put(key, schema.index_value(key, seq), db=st.db_index)
            elif raw is not None:
                self.delete_record(seq)
            return
        end = rec.chunk * C + rec.length
        k = rec.chunk
        while True:
            key = schema.index_key(lower, ino, schema.IDX_ZEROS, k)
            got = txn.get(key, db=st.db_index)
            if got is None:
                break
            lseq = schema.index_seq(key, got)
            lraw = txn.get(schema.u64(lseq), db=st.db_journal) if lseq is not None else None
            lrec = schema.decode_or_damaged(lraw) if lraw is not None else None
            if isinstance(lrec, schema.Chunk) and not lrec.digest:
                reach = lrec.chunk * C + lrec.length
            else:  # (damaged: it holds the one chunk, at least)
                reach = (k + 1) * C
            if reach >= end:
                self.delete_record(seq)
                return
            k = max(k + 1, -(-reach // C))
            if k * C >= end:
                self.delete_record(seq)
                return
        if k != rec.chunk:
            self.rewrites()
            cut = rec._replace(chunk=k, length=end - k * C)
            txn.put(schema.u64(seq), schema.encode_record(cut), db=st.db_journal)
        txn.put(key, schema.index_value(key, seq), db=st.db_index)

    def _cuts_first(self, upper_seq: int, lower_seq: int | None) -> bool:
        """Whether META record *upper_seq* (the upper layer's, of a regular
        file) says a smaller size than *lower_seq* (the lower layer's; None
        or damaged: it may)."""
        journal = self.store.db_journal
        up = schema.decode_or_damaged(self.txn.get(schema.u64(upper_seq), db=journal) or b"")
        if not isinstance(up, schema.Meta) or not stat.S_ISREG(up.mode):
            return False
        raw = self.txn.get(schema.u64(lower_seq), db=journal) if lower_seq is not None else None
        low = schema.decode_or_damaged(raw or b"")
        return not isinstance(low, schema.Meta) or up.size < low.size

    def who_put(self, layer: int, ino: int, writer: int) -> None:
        """Attribute *ino*'s changes in *layer* to *writer*, unless it is
        attributed already (the first writer wins)."""
        key = schema.who_key(layer, ino)
        if self.txn.get(key, db=self.store.db_who) is None:
            self.txn.put(key, schema.u64(writer), db=self.store.db_who)

    def new_writer(self, info: dict) -> int:
        meta = self.store.db_meta
        raw = self.txn.get(schema.K_NEXT_WRITER, db=meta)
        wid = schema.meta_int(schema.K_NEXT_WRITER, raw) if raw else 1
        self.set_meta(schema.K_NEXT_WRITER, schema.u64(wid + 1))
        self.txn.put(schema.u64(wid), schema.to_json(info), db=self.store.db_writers)
        return wid

    def set_meta(self, key: bytes, value: bytes | None) -> None:
        """Write (sealed) or delete a meta entry."""
        if value is None:
            self.txn.delete(key, db=self.store.db_meta)
        else:
            self.txn.put(key, schema.seal(schema.DB_META, key, value), db=self.store.db_meta)

    def meta_json(self, key: bytes) -> Any:
        return schema.meta_json(schema.DB_META, key, self.txn.get(key, db=self.store.db_meta))

    # -- the pending record: the group operation under way (written only
    # through cowfs/layers/pending.py, which says who changes it when) --

    def pending(self) -> PendingRecord | None:
        raw = self.meta_json(schema.K_PENDING)
        return PendingRecord.from_json(raw) if raw is not None else None

    def set_pending(self, record: PendingRecord | None) -> None:
        """Write the pending record (None: the group operation is over).
        The files are about to change by cowfs's own hand: what the last
        unmount recorded of them (drift detection) no longer holds."""
        self.set_meta(
            schema.K_PENDING, schema.to_json(record.to_json()) if record is not None else None
        )
        if record is not None:
            self.set_meta(schema.K_DRIFT, None)

    def update_pending(self, step: int | None = None, **fields: Any) -> None:
        """Update fields of the pending record, or of its step *step*."""
        record = self.pending()
        if record is None:
            raise StoreError("no group operation is pending: there is no record to update")
        if step is None:
            record = replace(record, **fields)
        else:
            steps = list(record.all_steps)
            steps[step] = replace(steps[step], **fields)
            record = replace(record, steps=tuple(steps))
        self.set_pending(record)


class Store:
    """An opened store directory."""

    def __init__(
        self, path: str, dirfd: int, lock_fd: int, env: lmdb.Environment, readonly: bool = False
    ):
        self.path = path
        self.dirfd = dirfd
        self.lock_fd = lock_fd
        self.env = env
        self.readonly = readonly
        try:
            (
                self.db_meta,
                self.db_layers,
                self.db_journal,
                self.db_index,
                self.db_chunks,
                self.db_refs,
                self.db_graves,
            ) = [env.open_db(name, create=not readonly) for name in schema.ALL_DBS[:7]]
        except lmdb.Error as e:
            env.close()
            raise StoreError(f"store {path} is damaged or incomplete: {e}") from None
        self.db_who: lmdb._Database | None
        self.db_writers: lmdb._Database | None
        self.db_audit: lmdb._Database | None
        self.db_redo: lmdb._Database | None
        self.db_sums: lmdb._Database | None
        try:  # attribution, audit (newer: absent from older stores opened read-only)
            self.db_who, self.db_writers, self.db_audit = [
                env.open_db(name, create=not readonly)
                for name in (schema.DB_WHO, schema.DB_WRITERS, schema.DB_AUDIT)
            ]
        except lmdb.Error:
            self.db_who = self.db_writers = self.db_audit = None
        try:  # what the last rollback kept for redo (newer, likewise)
            self.db_redo = env.open_db(schema.DB_REDO, create=not readonly)
        except lmdb.Error:
            self.db_redo = None
        try:  # hashes of the files kept in the grave (newer, likewise)
            self.db_sums = env.open_db(schema.DB_GRAVESUMS, create=not readonly)
        except lmdb.Error:
            self.db_sums = None
        self.grave_fd = os.open("grave", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dirfd)
        with env.begin(db=self.db_meta) as txn:
            self.chunk_size = meta_int(txn, schema.K_CHUNK_SIZE)
            self._next_seq = meta_int(txn, schema.K_NEXT_SEQ)
            self._next_layer = meta_int(txn, schema.K_NEXT_LAYER)
            self._next_grave = meta_int(txn, schema.K_NEXT_GRAVE)
        self._layers: list[Layer] | None = None
        self.max_store = self.limits().get("max_store") or 0
        # The journal's epoch: it moves on when a record already written is
        # deleted or put back, so that what was read of it is read again
        # (kept in meta for processes that read the store beside this one).
        # Records appended in a transaction are passed to on_append (first
        # sequence number, records) once it commits.
        self.epoch = self.journal_epoch()
        self.on_append: Callable[[int, list[tuple[int, schema.Record]]], None] | None = None

    # -- opening ------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str,
        workspace: str,
        *,
        create: bool = True,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        readonly: bool = False,
        locked: bool = True,
        checked: bool = False,
    ) -> Store:
        """Open (and with *create*, initialise) the store at *path* for the
        workspace root *workspace*; lock it exclusively.  *readonly*: an
        existing store, opened so that nothing in it can be written; and
        without *locked*, beside the process that holds it (a view).

        The store must be one cowfs may trust (cowfs/system/trust.py): StoreError
        otherwise.  *checked*: *path* names a descriptor handed down by the
        process that opened (and checked) the store.  Without *create* a
        missing store is NoStore, and nothing is made."""
        create = create and not readonly
        ws = WorkspaceRoot.of(workspace)
        ws_st = ws.st
        shown, path = path, path if checked else os.path.realpath(path)
        st = cls._trusted_dir(path, shown, ws_st, create, readonly, checked)
        # (a descriptor handed down is a /proc/self/fd link: followed)
        dirfd = os.open(path, os.O_PATH | os.O_DIRECTORY | (0 if checked else os.O_NOFOLLOW))
        lock_fd = -1
        try:
            dst = os.fstat(dirfd)
            if (dst.st_dev, dst.st_ino) != (st.st_dev, st.st_ino):
                raise StoreError(f"store {shown} was replaced while it was opened")
            data = os.path.join(path, "db", "data.mdb")
            if not create and (not os.path.isfile(data) or os.path.getsize(data) == 0):
                # (an empty directory, one with an empty db/, or an emptied
                # database: nothing is made in it, nothing is written)
                cls._not_lost(dirfd, shown)
                raise StoreError(f"store {shown} is not initialised")
            lock_fd = cls._lock(dirfd, path, exclusive=locked or not readonly)
            used = False
            if create:
                used = cls._not_lost(dirfd, shown)
            env = cls._open_env(path, shown, dirfd, readonly)
            if not readonly:
                cls._prepare(env, dirfd, shown, workspace, ws, chunk_size, create, used)
            store = cls(path, dirfd, lock_fd, env, readonly=readonly)
        except BaseException:
            if lock_fd >= 0:
                os.close(lock_fd)
            os.close(dirfd)
            raise
        if readonly:
            try:
                store._check_readonly(shown, ws)
            except BaseException:
                store.close()  # (its descriptors with it)
                raise
        return store

    def _check_readonly(self, shown: str, ws: WorkspaceRoot) -> None:
        """A store opened read-only (nothing in it made or moved on): its
        settings are this workspace's and its database is the store's (see
        ``check_identity``)."""
        with self.env.begin(db=self.db_meta) as txn:
            self._validate(txn, self.path, ws)
            db = schema.meta_json(schema.DB_META, schema.K_IDENTITY, txn.get(schema.K_IDENTITY))
        check_identity(shown, read_identity(self.dirfd), db)

    @staticmethod
    def _trusted_dir(
        path: str, shown: str, ws_st: os.stat_result, create: bool, readonly: bool, checked: bool
    ) -> os.stat_result:
        """The store directory *path* (made first where *create* allows),
        once it is one cowfs may trust, on the workspace's filesystem."""
        if not os.path.isdir(path):
            if not create:
                raise NoStore(f"no cowfs store at {shown}")
            trust.check_store(path, parent_only=True)
            parent = os.path.dirname(path)
            pst = os.stat(parent)
            try:
                os.mkdir(path, 0o700)  # (owned by this user; the mode is fixed below)
            except FileExistsError:  # made meanwhile, by someone: checked as it is
                pass
            else:
                # Creating the store must not show up as a change of the
                # workspace: keep the directory's times as they were.
                os.utime(parent, ns=(pst.st_atime_ns, pst.st_mtime_ns))
        st = os.stat(path)
        if st.st_uid != os.geteuid() and os.geteuid() != 0:
            raise not_owner(f"the cowfs store {shown}", st.st_uid)
        if not checked:
            trust.check_store(path)
        if st.st_mode & 0o777 != 0o700 and not readonly:
            os.chmod(path, 0o700)
        if st.st_dev != ws_st.st_dev:
            raise StoreError(
                f"store {shown} is not on the workspace's filesystem; whole-file "
                "pre-images must move into it, so it has to be"
            )
        return st

    @staticmethod
    def _lock(dirfd: int, path: str, exclusive: bool) -> int:
        """The store's lock file, open, and with *exclusive* locked by this
        process (AlreadyMounted while another one holds it)."""
        lock_fd = os.open(
            "lock",
            os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
            0o600,
            dir_fd=dirfd,
        )
        try:
            if exclusive:
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise AlreadyMounted(
                        f"store {path} is in use by another cowfs process "
                        "(is the workspace mounted?)"
                    ) from None
        except BaseException:
            os.close(lock_fd)
            raise
        return lock_fd

    @staticmethod
    def _open_env(path: str, shown: str, dirfd: int, readonly: bool) -> lmdb.Environment:
        """The store's database (its directories made first, unless
        *readonly*)."""
        if not readonly:
            for sub in ("grave", "db"):  # (lmdb would make db with its files' 0600)
                try:
                    os.mkdir(sub, 0o700, dir_fd=dirfd)
                except FileExistsError:
                    pass
        elif not os.path.isdir(os.path.join(path, "db")):
            raise StoreError(f"no cowfs store at {path}")
        env = lmdb.open(
            os.path.join(path, "db"),
            map_size=MAP_SIZE,
            max_dbs=len(schema.ALL_DBS) + 2,
            sync=False,
            metasync=False,
            writemap=False,
            readahead=False,
            subdir=True,
            mode=0o600,
            readonly=readonly,
        )
        try:
            check_map(env, path, shown)
        except BaseException:
            env.close()
            raise
        return env

    @classmethod
    def _prepare(
        cls,
        env: lmdb.Environment,
        dirfd: int,
        shown: str,
        workspace: str,
        ws: WorkspaceRoot,
        chunk_size: int,
        create: bool,
        used: bool,
    ) -> None:
        """Before a store is written: its settings are this workspace's
        (made, for a new one), the database is the store's, and the
        generation moves on (see ``_next_generation``)."""
        env.reader_check()
        try:
            cls._init_meta(env, shown, workspace, ws, chunk_size, create, used)
            cls._next_generation(env, dirfd, shown)
        except BaseException:
            env.close()
            raise

    @staticmethod
    def _not_lost(dirfd: int, shown: str) -> bool:
        """A store whose database is missing or empty while the rest of it
        is there (removed files in its grave, LMDB's lock file) lost its
        undo data: it is an error, never a fresh start over the grave.
        Returns whether the store was used before (mounted: it has a
        daemon log, or its grave holds something), which a database
        without cowfs's records in it then also is."""

        def entries(sub: str) -> list[str]:
            try:
                fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dirfd)
            except FileNotFoundError:
                return []
            try:
                return os.listdir(fd)
            finally:
                os.close(fd)

        db = entries("db")
        graves = entries("grave")
        logged = False
        for name in ("daemon.log", IDENTITY):
            try:
                os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                logged = True
            except FileNotFoundError:
                pass
        try:
            data = os.stat("db/data.mdb", dir_fd=dirfd, follow_symlinks=False).st_size
        except FileNotFoundError:
            data = 0
        if data:
            return logged or bool(graves)
        if db or graves or logged:
            raise StoreError(
                f"store {shown} has lost its database (db/data.mdb is "
                + ("empty" if "data.mdb" in db else "missing")
                + f") but still holds {len(graves)} removed files and "
                f"{', '.join(sorted(db)) or 'no other database files'}; refusing to start a "
                "fresh store over it (the grave holds the only copies of removed files): put "
                "db/ back from a backup, or move the store away to start afresh"
            )
        return False

    @staticmethod
    def _next_generation(env: lmdb.Environment, dirfd: int, shown: str) -> None:
        """Check that the database is the store's (see ``check_identity``)
        and move the generation on: the database first, then the file, each
        durably (a crash between leaves the database one ahead, which is
        accepted)."""
        meta = env.open_db(schema.DB_META)
        file = read_identity(dirfd)
        with env.begin(db=meta) as txn:
            db = schema.meta_json(schema.DB_META, schema.K_IDENTITY, txn.get(schema.K_IDENTITY))
        check_identity(shown, file, db)

        def put(ident: dict) -> None:
            with env.begin(write=True, db=meta) as txn:
                txn.put(
                    schema.K_IDENTITY,
                    schema.seal(schema.DB_META, schema.K_IDENTITY, schema.to_json(ident)),
                )
            env.sync(True)

        try:
            if db is not None and file is not None and db["generation"] > file["generation"]:
                write_identity(dirfd, db)  # (a crash after the database moved on: catch up)
                return
            ident = db or file or {"store": uuid.uuid4().hex, "generation": 0}
            ident = {"store": ident["store"], "generation": ident["generation"] + 1}
            put(ident)
            write_identity(dirfd, ident)
        except (OSError, lmdb.Error):
            # (a full disk: the generation stays, or the database is one
            # ahead, both accepted; the identity was checked all the same)
            pass

    @staticmethod
    def _init_meta(
        env: lmdb.Environment,
        path: str,
        workspace: str,
        ws: WorkspaceRoot,
        chunk_size: int,
        create: bool = True,
        used: bool = False,
    ) -> None:
        if not create:  # an existing store: ours and this workspace's, before anything is made
            try:
                meta = env.open_db(schema.DB_META, create=False)
            except lmdb.Error:
                raise StoreError(f"store {path} is not initialised") from None
            with env.begin(db=meta) as txn:
                Store._validate(txn, path, ws)
        meta = env.open_db(schema.DB_META)
        for name in schema.ALL_DBS:
            env.open_db(name)
        with env.begin(write=True, db=meta) as txn:
            fmt = txn.get(schema.K_FORMAT)
            if fmt is None and used:
                raise StoreError(
                    f"store {path} has lost its database (db/data.mdb holds none of cowfs's "
                    "records) but was used before; refusing to start a fresh store over it "
                    "(its grave holds the only copies of removed files): put db/ back from a "
                    "backup, or move the store away to start afresh"
                )
            if fmt is None:
                owner = {
                    "path": os.path.abspath(workspace),
                    "dev": ws.st.st_dev,
                    "ino": ws.st.st_ino,
                    "fs": ws.fs,
                    "handle": ws.handle.hex(),
                }
                for key, value in (
                    (schema.K_FORMAT, schema.u64(schema.FORMAT)),
                    (schema.K_WORKSPACE, schema.to_json(owner)),
                    (schema.K_CHUNK_SIZE, schema.u64(chunk_size)),
                    (schema.K_NEXT_SEQ, schema.u64(1)),
                    (schema.K_NEXT_LAYER, schema.u64(1)),
                    (schema.K_NEXT_GRAVE, schema.u64(1)),
                ):
                    txn.put(key, schema.seal(schema.DB_META, key, value))
                return
            owner = Store._validate(txn, path, ws)
            if schema.meta_int(schema.K_FORMAT, fmt) < schema.FORMAT:
                txn.put(
                    schema.K_FORMAT,
                    schema.seal(schema.DB_META, schema.K_FORMAT, schema.u64(schema.FORMAT)),
                )
            if "handle" not in owner or (owner["dev"], owner["ino"]) != (
                ws.st.st_dev,
                ws.st.st_ino,
            ):
                # (a store made before identities had a handle gets one; one
                # whose filesystem's device number moved keeps the new one)
                owner.update(dev=ws.st.st_dev, fs=ws.fs, handle=ws.handle.hex())
                txn.put(
                    schema.K_WORKSPACE,
                    schema.seal(schema.DB_META, schema.K_WORKSPACE, schema.to_json(owner)),
                )

    @staticmethod
    def _validate(txn: lmdb.Transaction[bytes], path: str, ws: WorkspaceRoot) -> dict:
        """The store's format is ours and it belongs to this workspace."""
        raw = txn.get(schema.K_FORMAT)
        if raw is None:
            raise StoreError(f"store {path} is not initialised")
        fmt = schema.meta_int(schema.K_FORMAT, raw)
        if fmt not in schema.READABLE_FORMATS:
            raise StoreError(
                f"store {path} has format {fmt}, this cowfs reads formats "
                f"{', '.join(map(str, schema.READABLE_FORMATS))}: a newer cowfs made it"
            )
        owner = schema.meta_json(schema.DB_META, schema.K_WORKSPACE, need(txn, schema.K_WORKSPACE))
        if not ws.is_owner(owner):
            raise StoreError(f"store {path} belongs to another workspace ({owner['path']})")
        return owner

    @staticmethod
    def destroy(path: str) -> None:
        """Remove a store directory (keeping its parent's times, as creating
        it did)."""
        import shutil

        parent = os.path.dirname(os.path.abspath(path))
        pst = os.stat(parent)
        shutil.rmtree(path)
        os.utime(parent, ns=(pst.st_atime_ns, pst.st_mtime_ns))

    def close(self) -> None:
        if not self.readonly:
            self.sync()
        self.env.close()
        os.close(self.grave_fd)
        os.close(self.dirfd)
        os.close(self.lock_fd)

    def sync(self) -> None:
        """Make everything written so far durable against power loss."""
        try:
            self.env.sync(True)
        except lmdb.Error as e:
            raise OSError(self.failure_errno(), f"cowfs store error: {e}") from None
        fd = os.open("grave", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self.dirfd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- transactions ---------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[Writer]:
        """A write transaction; raises OSError(ENOSPC/EIO) when the store
        cannot take it, so callers fail the change before touching a file."""
        try:
            with self.env.begin(write=True) as txn:
                w = Writer(self, txn)
                graves = self._next_grave
                yield w
                if w.seq != self._next_seq:
                    w.set_meta(schema.K_NEXT_SEQ, schema.u64(w.seq))
                if self._next_grave != graves:
                    w.set_meta(schema.K_NEXT_GRAVE, schema.u64(self._next_grave))
                if w.written is None:
                    w.set_meta(schema.K_EPOCH, schema.u64(self.epoch + 1))
            first, self._next_seq = self._next_seq, w.seq
            if w.written is None:
                self.epoch += 1
            elif w.written and self.on_append is not None:
                self.on_append(first, w.written)
        except lmdb.MapFullError as e:
            raise OSError(errno.ENOSPC, f"cowfs store full: {e}") from None
        except lmdb.Error as e:
            raise OSError(self.failure_errno(), f"cowfs store error: {e}") from None

    def read(self) -> lmdb.Transaction[bytes]:
        return self.env.begin()

    # -- layers ----------------------------------------------------------------

    def knows(self, ino: int, layers: Iterable[int] | None = None) -> bool:
        """Whether a layer (of *layers*; default: every layer) knows object
        *ino*: holds any index entry of it but the mark of one made at an
        ignored path (an ``N`` of value 0: ``schema.pins``) -- what such a
        layer's records name must stay where they put it (a lookup per
        layer)."""
        ids = [layer.id for layer in self.layers()] if layers is None else list(layers)
        if not ids:
            return False
        pack, made = _LAYER_INO.pack, schema.IDX_CREATED[0]
        with self.read() as txn:
            cur = txn.cursor(db=self.db_index)
            for layer in reversed(ids):
                prefix = pack(layer, ino)  # (``schema.index_prefix``)
                if not cur.set_range(prefix):
                    continue
                key = cur.key()
                while key[:16] == prefix:
                    if key[16] != made or schema.index_seq(key, cur.value()) != 0:
                        return True
                    if not cur.next():
                        break
                    key = cur.key()
        return False

    def created_in(self, ino: int, layers: Iterable[int]) -> bool:
        """Whether one of *layers* made an object numbered *ino* (its ``N``
        entry, of any value)."""
        with self.read() as txn:
            return any(
                txn.get(schema.index_key(layer, ino, schema.IDX_CREATED), db=self.db_index)
                is not None
                for layer in layers
            )

    def layers(self) -> list[Layer]:
        if self._layers is None:
            out = []
            with self.env.begin(db=self.db_layers) as txn:
                for k, v in txn.cursor():
                    d = schema.meta_json(schema.DB_LAYERS, k, v)
                    out.append(
                        Layer(
                            schema.from_u64(k),
                            d["start"],
                            d["created"],
                            d["message"],
                            tuple(d.get("runs", ())),
                            tuple(d.get("snapshots", ())),
                            tuple(d.get("postmortems", ())),
                            tuple(d.get("drift", ())),
                            d.get("agent"),
                            tuple(d.get("turns", ())),
                            tuple(d.get("counted", ())),
                        )
                    )
            self._layers = out
        return list(self._layers)

    def top(self) -> Layer | None:
        layers = self.layers()
        return layers[-1] if layers else None

    def open_layer(self) -> Layer:
        """The top layer, where there must be one (an opened session's stack
        always has an open layer: see LayerFiles.ensure_base)."""
        top = self.top()
        if top is None:
            raise StoreError("the store has no open layer")
        return top

    @property
    def next_seq(self) -> int:
        """The seq the next record gets: the end of the journal."""
        return self._next_seq

    @property
    def next_grave(self) -> int:
        """The id the next grave entry gets."""
        return self._next_grave

    def journal_epoch(self) -> int:
        """The journal's epoch as the store holds it (see ``epoch``)."""
        with self.env.begin(db=self.db_meta) as txn:
            raw = txn.get(schema.K_EPOCH)
        return 0 if raw is None else schema.meta_int(schema.K_EPOCH, raw)

    def follow(self, next_seq: int) -> None:
        """Read the journal as ending before *next_seq* (a reader following
        a store another process writes: it read the number there)."""
        self._next_seq = next_seq
        self.forget_layer_cache()

    def layer_end(self, layer_id: int) -> int:
        """First seq after *layer_id*'s records."""
        for a, b in itertools.pairwise(self.layers()):
            if a.id == layer_id:
                return b.start
        return self._next_seq

    def push_layer(self, message: str = "", agent: dict | None = None) -> Layer:
        layer = Layer(self._next_layer, self._next_seq, time.time(), message, agent=agent)
        record = {"start": layer.start, "created": layer.created, "message": message}
        if agent:
            record["agent"] = agent
        with self.write() as w:
            w.put_layer_row(layer.id, record)
            self._next_layer += 1
            w.set_meta(schema.K_NEXT_LAYER, schema.u64(self._next_layer))
        self._layers = None
        return layer

    def set_snapshots(self, layer_id: int, snapshots: list[dict], w: Writer) -> None:
        """Record a layer's snapshots (in the checkpoint's transaction that
        closes its pending record)."""
        d = self._row(w, layer_id)
        d["snapshots"] = snapshots
        w.put_layer_row(layer_id, d)
        self._layers = None

    def set_counted(self, layer_id: int, counted: list[int]) -> None:
        """Keep what layer *layer_id* changed (``Layer.counted``)."""
        with self.write() as w:
            d = self._row(w, layer_id)
            d["counted"] = counted
            w.put_layer_row(layer_id, d)
        self._layers = None

    def append_to_layer(
        self, layer_id: int, key: str, items: list[dict], w: Writer | None = None
    ) -> None:
        """Append records (``runs``, ``postmortems``, ``turns``) to a layer's record."""

        def put(w: Writer) -> None:
            d = self._row(w, layer_id)
            d[key] = d.get(key, []) + items
            w.put_layer_row(layer_id, d)

        if w is not None:
            put(w)
        else:
            with self.write() as w2:
                put(w2)
        self._layers = None

    def _row(self, w: Writer, layer_id: int) -> dict:
        row = w.layer_row(layer_id)
        if row is None:
            raise StoreError(f"the store is damaged: it has no record of layer {layer_id}")
        return row

    def forget_layer_cache(self) -> None:
        self._layers = None

    # records decoded per read transaction (each some 200 bytes as objects:
    # a layer of 200,000 read in one list took 38 MB more at the peak)
    RECORDS_BATCH = 4096

    def records(
        self, start: int, end: int, reverse: bool = False
    ) -> Iterator[tuple[int, schema.Record]]:
        """Journal records with start <= seq < end (a short read txn per
        batch, so callers may write between items)."""
        decode, from_u64 = schema.decode_or_damaged, schema.from_u64
        batch = self.RECORDS_BATCH
        while start < end:
            items: list[tuple[int, schema.Record]] = []
            with self.env.begin(db=self.db_journal) as txn:
                cur = txn.cursor()
                if reverse:
                    if cur.set_range(schema.u64(end)):
                        ok = cur.prev()
                    else:
                        ok = cur.last()
                    if ok:
                        for key, value in cur.iterprev():
                            seq = from_u64(key)
                            if seq < start or len(items) == batch:
                                break
                            if seq < end:
                                items.append((seq, decode(value)))
                elif cur.set_range(schema.u64(start)):
                    for key, value in cur.iternext():
                        seq = from_u64(key)
                        if seq >= end or len(items) == batch:
                            break
                        items.append((seq, decode(value)))
            if len(items) < batch:
                yield from items
                return
            if reverse:
                end = items[-1][0]
            else:
                start = items[-1][0] + 1
            yield from items

    def count_records(self, start: int, end: int, limit: int | None = None) -> int:
        """How many journal records have start <= seq < end (counted up to
        *limit*, if given)."""
        n = 0
        with self.env.begin(db=self.db_journal) as txn:
            cur = txn.cursor()
            if cur.set_range(schema.u64(start)):
                stop = schema.u64(end)
                for key in cur.iternext(values=False):
                    if key >= stop or n == limit:
                        break
                    n += 1
        return n

    def layer_existed(self, layer_id: int) -> bool:
        """Whether *layer_id* was ever given to a layer of this store."""
        return 1 <= layer_id < self._next_layer

    def last_layer_id(self) -> int:
        return self._next_layer - 1

    def layer_records(self, layer_id: int) -> list[tuple[int, schema.Record]]:
        layer = self.get_layer(layer_id)
        return list(self.records(layer.start, self.layer_end(layer_id)))

    def get_layer(self, layer_id: int) -> Layer:
        for layer in self.layers():
            if layer.id == layer_id:
                return layer
        from ..errors import UnknownLayer

        raise UnknownLayer(f"no layer {layer_id}")

    def layer_bytes(self, layer_id: int) -> int:
        """Store bytes the layer's records occupy (records plus their chunk
        data, counting shared chunks once per layer, plus grave files)."""
        total = 0
        seen: set[bytes] = set()
        layer = self.get_layer(layer_id)
        with self.env.begin() as txn:
            for _seq, rec in self.records(layer.start, self.layer_end(layer_id)):
                total += 16
                if isinstance(rec, schema.Chunk) and rec.digest and rec.digest not in seen:
                    seen.add(rec.digest)
                    data = txn.get(rec.digest, db=self.db_chunks)
                    total += len(data) if data is not None else 0
                elif isinstance(rec, schema.Grave):
                    try:
                        st = os.stat(str(rec.grave), dir_fd=self.grave_fd, follow_symlinks=False)
                        total += st.st_blocks * 512
                    except OSError:
                        pass
        return total

    # -- space -------------------------------------------------------------------

    def limits(self) -> dict:
        return self.get_meta_json(schema.K_LIMITS) or {}

    def set_limits(self, **limits: int | str) -> None:
        """Set --max-store / --max-layers (0 removes a limit) / --audit."""
        if not limits:
            return
        current = self.limits() | limits
        self.set_meta_json(schema.K_LIMITS, {k: v for k, v in current.items() if v})
        self.max_store = self.limits().get("max_store") or 0

    def data_bytes(self, txn: lmdb.Transaction[bytes] | None = None) -> int:
        """Bytes of LMDB pages in use (pages freed by commits and rollbacks
        are reused, so this falls when data is freed)."""

        def count(txn: lmdb.Transaction[bytes]) -> int:
            pages = 0
            for db in (
                self.db_meta,
                self.db_layers,
                self.db_journal,
                self.db_index,
                self.db_chunks,
                self.db_refs,
                self.db_graves,
                self.db_redo,
                self.db_sums,
            ):
                if db is None:
                    continue
                st = txn.stat(db)
                pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
            return pages * st["psize"]

        if txn is not None:
            return count(txn)
        with self.env.begin() as t:
            return count(t)

    def grave_bytes(self) -> int:
        """Disk space of the removed objects kept whole in the grave."""
        total = 0
        fd = os.open("grave", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self.dirfd)
        try:
            for name in os.listdir(fd):
                try:
                    total += os.stat(name, dir_fd=fd, follow_symlinks=False).st_blocks * 512
                except OSError:
                    pass
        finally:
            os.close(fd)
        return total

    def get_meta_json(self, key: bytes) -> Any:
        with self.env.begin(db=self.db_meta) as txn:
            return schema.meta_json(schema.DB_META, key, txn.get(key))

    def set_meta_json(self, key: bytes, value: Any) -> None:
        with self.write() as w:
            w.set_meta(key, schema.to_json(value) if value is not None else None)

    def pending(self) -> PendingRecord | None:
        """The pending record (see cowfs/layers/pending.py), or None."""
        raw = self.get_meta_json(schema.K_PENDING)
        return PendingRecord.from_json(raw) if raw is not None else None

    def grave_counts(self) -> dict[int, int]:
        """Backing inode -> number of its names held in the grave."""
        counts: dict[int, int] = {}
        with self.env.begin(db=self.db_graves) as txn:
            for _, v in txn.cursor():
                ino = schema.from_u64(v)
                counts[ino] = counts.get(ino, 0) + 1
        return counts

    # -- the audit log ------------------------------------------------------------

    def redo_get(self, key: bytes) -> bytes | None:
        """An entry of the redo database (None: none, or no such database)."""
        if self.db_redo is None:
            return None
        with self.env.begin(db=self.db_redo) as txn:
            return txn.get(key)

    def redo_entries(
        self, prefix: bytes = b"", txn: lmdb.Transaction[bytes] | None = None
    ) -> list[tuple[bytes, bytes]]:
        """(key, value) of the redo database's entries under *prefix* (read
        in *txn*, if given)."""
        if self.db_redo is None:
            return []
        if txn is not None:
            return list(scan(txn, self.db_redo, prefix))
        with self.env.begin(db=self.db_redo) as own:
            return list(scan(own, self.db_redo, prefix))

    def redo_count(self) -> int:
        """How many entries the redo database holds."""
        if self.db_redo is None:
            return 0
        with self.env.begin() as txn:
            return txn.stat(self.db_redo)["entries"]

    def audit(self, event: str, **fields: object) -> None:
        """Append an event (best effort: a full store loses the event, not
        the operation)."""
        self.audit_many([{"event": event, **fields}])

    def audit_many(self, events: Iterable[dict]) -> None:
        """Write *events* (in one transaction)."""
        it = iter(events)
        first = next(it, None)
        if first is None or self.db_audit is None or self.low_on_space():
            return
        now = time.time()
        try:
            with self.write() as w:
                cur = w.txn.cursor(db=self.db_audit)
                n = schema.from_u64(cur.key()) + 1 if cur.last() else 1
                for e in itertools.chain([first], it):
                    w.txn.put(
                        schema.u64(n), schema.to_json({"n": n, "time": now, **e}), db=self.db_audit
                    )
                    n += 1
        except OSError:
            pass

    def audit_events(self, after: int = 0) -> Iterator[dict]:
        if self.db_audit is None:
            return
        with self.env.begin(db=self.db_audit) as txn:
            cur = txn.cursor()
            ok = cur.set_range(schema.u64(after + 1))
            while ok:
                yield schema.from_json(cur.value())
                ok = cur.next()

    def failure_errno(self) -> int:
        """Why LMDB failed to write: ENOSPC when the filesystem under the
        store has no room for FULL_MARGIN more bytes (asked of the
        filesystem itself: LMDB reports a short write as EIO, and ext4
        keeps blocks that even root cannot have), else EIO."""
        name = ".space-probe"
        try:
            fd = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600, dir_fd=self.dirfd
            )
        except OSError as e:
            return errno.ENOSPC if e.errno in (errno.ENOSPC, errno.EDQUOT) else errno.EIO
        try:
            os.posix_fallocate(fd, 0, FULL_MARGIN)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                return errno.ENOSPC
        finally:
            os.close(fd)
            try:
                os.unlink(name, dir_fd=self.dirfd)
            except OSError:
                pass
        return errno.EIO

    def space_left(self) -> int:
        """Bytes this process may still write where the store is (root:
        the filesystem's reserved blocks too)."""
        try:
            sv = os.statvfs(f"/proc/self/fd/{self.dirfd}")
        except OSError:
            return 1 << 62
        free = sv.f_bfree if os.geteuid() == 0 else sv.f_bavail
        return free * sv.f_frsize

    def low_on_space(self) -> bool:
        """Less than AUDIT_RESERVE free where the store is: the audit log
        stops growing, so that what undo needs (a rollback writes too) is
        not used up by it."""
        return self.space_left() < AUDIT_RESERVE

    def prune_audit(self, before: float) -> int:
        """Drop audit events older than *before* (unix time)."""
        dropped = 0
        with self.write() as w:
            cur = w.txn.cursor(db=self.db_audit)
            cur.first()
            while cur.key() and schema.from_json(cur.value())["time"] < before:
                cur.delete()  # (moves to the next; past the last, the key is empty)
                dropped += 1
        return dropped

    def who(self, layers: list[int], inos: list[int]) -> dict[int, dict]:
        """For each of *inos*, the writer that first changed it in the
        lowest of *layers* that has it (with its id); one transaction."""
        out: dict[int, dict] = {}
        if self.db_who is None:
            return out
        writers: dict[bytes, dict] = {}
        layers = sorted(layers)
        key, db = schema.who_key, self.db_who
        with self.env.begin() as txn:
            get = txn.get
            for ino in inos:
                for layer in layers:
                    wid = get(key(layer, ino), db=db)
                    if wid is not None:
                        if wid not in writers:
                            info = txn.get(wid, db=self.db_writers)
                            writers[wid] = (schema.from_json(info) if info else {}) | {
                                "id": schema.from_u64(wid)
                            }
                        out[ino] = writers[wid]
                        break
        return out

    def chunk(self, h: bytes) -> bytes | None:
        with self.env.begin(db=self.db_chunks) as txn:
            return txn.get(h)
