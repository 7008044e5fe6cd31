"""The LMDB schema of the layer store: every named database, every key layout
and the encoding of every value.  Keys are built and taken apart only here
(``u64``, ``index_key``, ``who_key``, ``redo_*_key``, ...); values are encoded
here too (``to_json``, ``encode_record``, ``encode_sum``, ``encode_xattrs``).

Integers in keys are unsigned 64-bit big-endian so that they sort numerically.

Databases
---------
``meta``     singleton settings and counters, keyed by a short ASCII name:
             ``format``      u64   schema version (FORMAT)
             ``workspace``   JSON  {"path", "dev", "ino", "fs", "handle"} of
                                   the workspace root the store belongs to
                                   (``fs``: statfs f_type; ``handle``: its
                                   file handle in hex, without the mount id:
                                   on an overlay or btrfs, whose device
                                   numbers change at each mount, the root is
                                   known by ``ino`` and ``handle``)
             ``chunk_size``  u64   size of the fixed, aligned data chunks
             ``next_seq``    u64   next journal sequence number
             ``next_layer``  u64   next layer id
             ``next_grave``  u64   next grave id
             ``next_writer`` u64   next writer id (absent: 1)
             ``forks``       JSON  the workspace's forks and the layers
                                   they pin (cowfs/layers/forkpoints.py)
             ``adopting``    JSON  {"fork", "layer"}: an adopt under way
                                   (cowfs/service/adopt.py); a mount rolls
                                   back a layer a crash left it in
             ``epoch``       u64   moves on in every transaction that
                                   deletes or puts back a journal record
                                   (absent: 0), so that a process reading
                                   the journal beside the daemon (a view)
                                   knows when what it read may have changed
             ``pending``     JSON  the group operation under way, resumed
                                   by the next mount if a crash interrupts it
                                   (see ``cowfs/layers/pending.py``):
                                   ``{"op": "rollback", "to": ID}``,
                                   ``{"op": "commit", "layer": ID}`` or
                                   ``{"op": "redo"}``, each with
                                   ``"files"``: bool, the file part is done,
                                   and ``"steps"``: the provider steps, in
                                   order, each ``{"do": "restore"|"discard",
                                   "provider", "layer", "data": the snapshot,
                                   "state": "todo"|"started"|"done"|"failed"}``
                                   and, once run, ``"seconds"``, ``"error"``
                                   (failed), ``"postmortem"`` (restores).
                                   Restores run before the files, discards
                                   after; the layers' post-mortems move to
                                   the top layer when the record is closed.
                                   Or ``{"op": "checkpoint", "layer": ID,
                                   "providers": [names]}`` while a checkpoint
                                   takes provider snapshots: after a crash,
                                   what they took is discarded and the layer
                                   merged into the one below.
             ``state``       JSON  {"mounted": bool, "pid": int or null}: the
                                   clean-state record
             ``limits``      JSON  {"max_store": bytes, "max_layers": int}, each
                                   absent (or 0) for no limit
             ``ignore``      JSON  the mount's --ignore patterns (a list)
             ``identity``    JSON  {"store": random id, "generation": n}: the
                                   database's, matched against the file
                                   STORE/identity at every opening (see
                                   ``store.check_identity``)
             ``grants``      JSON  the mount's --allow grants: a list of
                                   {"user"|"group": id, "name", "ops": [...]}
             ``drift``       JSON  written at a clean unmount: {"seq", "layers":
                                   the store's state then, "paths": workspace
                                   path -> its fingerprint (JSON [ino, mode,
                                   uid, gid, size, mtime_ns, ctime_ns], as the
                                   redo's ``f`` entries; null: absent;
                                   ["unreachable"]: a directory above is not
                                   one; an older cowfs wrote [size, mtime_ns,
                                   ctime_ns, ino]) of every path the layers
                                   changed};
                                   compared by the next mount while the store
                                   is still in that state
``layers``   u64 layer id -> JSON {"start": first seq, "created": unix time,
             "message": str} and, where there are any, "runs", "snapshots",
             "postmortems", "drift" (lists), "agent" (the agent event that
             opened the layer: {"agent", "event", "kind": "prompt"|"tool",
             "session", ...}) and "turns" (the "agent" records of layers
             merged into it, each with its "layer" and "message"), and
             "counted" ([its end, its records, changes, times only]: its
             net changes, kept once counted below the open layer).  The stack
             is the layers in id order; a layer
             owns the journal records from its ``start`` up to the next
             layer's ``start`` (the top layer: to the end of the journal), so
             merging a layer into the one below is deleting its row.
``journal``  u64 seq -> an undo record (one NamedTuple per kind, below:
             ``encode_record``).  Replaying a layer's records from the last to
             the first restores the tree as it was when the layer was opened.
``index``    u64 layer + u64 ino + 1-byte kind [+ u64 chunk] -> u64 seq
             (``index_key``, ``split_index_key``).
             Which objects (backing inode numbers) a layer has already
             captured, so later changes record nothing (while the last
             rollback can be redone, the open layer's changes since it are
             indexed under its *segment*, 2**63 + the rollback's first seq,
             a layer id no layer has; see ``redo``):
             ``N`` created in this layer (value: 0; ``CREATED_NAMED``, 1,
             when it was made at a captured path -- a CREATE record names
             it -- which pins it as a ``P`` entry would), ``M`` metadata captured,
             ``X`` xattrs captured, ``C`` + chunk number: that chunk captured,
             ``P`` pinned (value: 0): seen at a captured path (renamed or
             exchanged there; stores before ``CREATED_NAMED`` also wrote it
             for an object made there), so
             captured in this layer wherever it moves, even to an ignored
             path; any entry but a lone ``N`` of an object in a layer keeps
             its changes captured in the layers above too (an ``N`` of
             value ``CREATED_NAMED`` is not lone: see
             ``Recorder.known``),
             ``Z`` + chunk number: a range of zeros beginning at that chunk
             captured (the CHUNK record says how far it spans).
             ``N`` and ``P`` name no record (``INDEX_FLAGS``).
``chunks``   16-byte xxh3-128 digest -> chunk bytes (content-addressed).
``refs``     16-byte digest -> u64 number of records using it (in the journal
             and, for a redo, in ``redo``).
``graves``   u64 grave id -> u64 backing inode number of the object that was
             moved into ``STORE/grave/<id>`` (whole-file pre-images).
``gravesums`` u64 grave id -> what is known of the bytes of a regular file
             kept whole in ``STORE/grave/<id>`` (see ``encode_sum``): a state
             byte, u64 inode, u64 size, i64 mtime_ns, i64 time_ns and, once
             hashed, its 16-byte digest and the digest's form.  Written with
             the grave entry, deleted with it (``Writer.new_grave``,
             ``drop_grave``):
             ``p`` pending: inode, size and mtime as the file was removed, and
                   the wall-clock time of that (its ctime, set by the move
                   into the grave, is no later unless it changed since);
                   hashed later, off the request path (``gravesum``);
             ``h`` hashed: the digest of its bytes; time_ns is the ctime it
                   had when hashed.  Check and rollback verify it.  The
                   digest's form is the byte after it:
                   ``1`` (``SUM_FORM_DATA``): the digest of ``datahash``,
                         which reads only the ranges that hold data (a
                         sparse file of TiBs costs what it holds) and hashes
                         the content's 4 KiB blocks that are not all zeros
                         with their positions, and the size;
                   no byte (``SUM_FORM_ALL``, written by older cowfs): the
                         xxh3-128 of every byte of the file, holes read as
                         zeros;
             ``c`` changed since it was removed (written through an open
                   descriptor or another name of it, or before it could be
                   hashed): verified by identity only.
             No entry (not a regular file, or removed by older cowfs):
             verified by identity only, as the ``graves`` entry says.
``who``      u64 layer + u64 ino (``who_key``) -> u64 writer id: the process
             that first changed that object in that layer (kept by merges: the
             lower layer's entry wins, it is older; a segment's, like its index).
``writers``  u64 writer id -> JSON {"pid", "uid", "cmd": [argv...]}, one per
             process seen changing something (``next_writer`` in meta).
``audit``    u64 event number -> JSON event {"n": the number, "time", "event",
             "layer", ...}: mount, unmount, checkpoint, commit, rollback,
             restore, redo and every kept or undone change.  Independent of the
             layers: kept through commits and rollbacks until pruned (``cowfs
             audit --prune DAYS``).
``redo``     what the last rollback kept so that ``cowfs redo`` can undo it
             (see ``redo``); ``state``, and every other key begins with a
             one-byte kind (``redo_*_key``, ``split_redo_key``):
             ``state``             JSON {"state": "building" | "ready" |
                                   "redoing" | "unavailable" | "gone", "why",
                                   "to", "dropped": [ids], "kept": [ids left],
                                   "fresh": id of the base the rollback opened
                                   or null, "seq": the first seq after the
                                   rollback's layers (records from there on
                                   were made since), "time", "moves": true
                                   (the ``m`` entries were written), "segment":
                                   the index id of the changes made since (or
                                   null: none, or the fresh base serves)}
             ``f`` + location      its fingerprint when the rollback ended
                                   (JSON [ino, mode, uid, gid, size, mtime_ns,
                                   ctime_ns]; null: nothing there;
                                   ["unreachable"]: a directory above is not one)
             ``m`` + location      the redo moves what is there (empty)
             ``L`` + u64 layer     a dropped layer's row, as it was
             ``r`` + u64 seq       a dropped layer's journal record, verbatim
                                   (its chunk references are still counted)
             ``v`` + u64 seq + u8  the inverse of the undo step of record seq:
                                   records in the journal's format that put
                                   back what that step changed (a removed
                                   object was moved to the grave instead)
             ``i`` + index key     a dropped layer's index entry
             ``w`` + who key       a dropped layer's attribution
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple, get_type_hints

import xxhash

from ..errors import StoreError
from ..system.backing import GRAVE_PREFIX, grave_id, grave_loc  # noqa: F401  (for the records' users)
from ..text import quote

# The store's format: 2 adds integers past 2**63 - 1 in records (tag ``u``:
# inode numbers an overlay gives objects of its lower layers, the layer in
# the top bits).  A format 1 store is read as it is and becomes format 2 when
# it is first opened for writing (nothing else changes).
FORMAT = 2
READABLE_FORMATS = (1, 2)

DB_META = b"meta"
DB_LAYERS = b"layers"
DB_JOURNAL = b"journal"
DB_INDEX = b"index"
DB_CHUNKS = b"chunks"
DB_REFS = b"refs"
DB_GRAVES = b"graves"
DB_WHO = b"who"
DB_WRITERS = b"writers"
DB_AUDIT = b"audit"
DB_REDO = b"redo"
DB_GRAVESUMS = b"gravesums"
ALL_DBS = (
    DB_META,
    DB_LAYERS,
    DB_JOURNAL,
    DB_INDEX,
    DB_CHUNKS,
    DB_REFS,
    DB_GRAVES,
    DB_WHO,
    DB_WRITERS,
    DB_AUDIT,
    DB_REDO,
    DB_GRAVESUMS,
)

K_FORMAT = b"format"
K_WORKSPACE = b"workspace"
K_CHUNK_SIZE = b"chunk_size"
K_NEXT_SEQ = b"next_seq"
K_NEXT_LAYER = b"next_layer"
K_NEXT_GRAVE = b"next_grave"
K_PENDING = b"pending"
K_STATE = b"state"
K_LIMITS = b"limits"
K_DRIFT = b"drift"
K_NEXT_WRITER = b"next_writer"
K_EPOCH = b"epoch"
K_FORKS = b"forks"
K_ADOPTING = b"adopting"
K_IGNORE = b"ignore"
K_GRANTS = b"grants"
K_IDENTITY = b"identity"

_U64 = struct.Struct(">Q")


def u64(n: int) -> bytes:
    return _U64.pack(n)


def from_u64(b: bytes) -> int:
    return _U64.unpack(b)[0]


_ENCODE = json.JSONEncoder(sort_keys=True).encode  # (made once: json.dumps makes one a call)


def to_json(obj: Any) -> bytes:
    return _ENCODE(obj).encode()


def from_json(b: bytes) -> Any:
    return json.loads(b)


# -- the pending record (key ``pending``; see cowfs/layers/pending.py) ---------------------
# Typed here, kept as the JSON it always was: `from_json` and `to_json`
# convert at the store's edge, writing the keys a record has in the order
# cowfs has always written them (and any it does not know, after them).


@dataclass(frozen=True)
class PendingStep:
    """A provider step of the pending record."""

    do: str  # "restore" or "discard"
    provider: str
    layer: int
    data: Any  # the snapshot, as the provider took it
    state: str = "todo"  # "todo", "started", "done" or "failed"
    seconds: float | None = None  # once run
    error: str | None = None  # (failed)
    postmortem: dict | None = None  # (a restore's)
    extra: dict = field(default_factory=dict)  # keys this cowfs does not know

    @classmethod
    def from_json(cls, d: dict) -> PendingStep:
        known = {k: d[k] for k in _STEP_KEYS if k in d}
        return cls(**known, extra={k: v for k, v in d.items() if k not in _STEP_KEYS})

    def to_json(self) -> dict:
        d: dict[str, Any] = {
            "do": self.do,
            "provider": self.provider,
            "layer": self.layer,
            "data": self.data,
            "state": self.state,
        }
        for key in ("seconds", "error", "postmortem"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d | self.extra


_STEP_KEYS = ("do", "provider", "layer", "data", "state", "seconds", "error", "postmortem")


@dataclass(frozen=True)
class PendingRecord:
    """The group operation under way: a rollback (*to*), a redo, the
    discards of a committed layer's snapshots (*layer*) or a checkpoint's
    captures (*layer*, *providers*).  A field that is None (or False, for
    *skip_damaged*) is not in the JSON."""

    op: str | None  # (None: none was written)
    to: int | None = None
    layer: int | None = None
    files: bool | None = None  # whether the file part is done
    steps: tuple[PendingStep, ...] | None = None  # in order
    providers: list[str] | None = None
    skip_damaged: bool = False
    extra: dict = field(default_factory=dict)  # keys this cowfs does not know

    @classmethod
    def from_json(cls, d: dict) -> PendingRecord:
        steps = d.get("steps")
        return cls(
            op=d.get("op"),
            to=d.get("to"),
            layer=d.get("layer"),
            files=d.get("files"),
            steps=tuple(PendingStep.from_json(s) for s in steps) if steps is not None else None,
            providers=d.get("providers"),
            skip_damaged=bool(d.get("skip_damaged")),
            extra={k: v for k, v in d.items() if k not in _RECORD_KEYS},
        )

    def to_json(self) -> dict:
        d: dict[str, Any] = {}
        for key in ("op", "to", "layer", "files"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.steps is not None:
            d["steps"] = [step.to_json() for step in self.steps]
        if self.providers is not None:
            d["providers"] = self.providers
        if self.skip_damaged:
            d["skip_damaged"] = True
        return d | self.extra

    @property
    def all_steps(self) -> tuple[PendingStep, ...]:
        return self.steps or ()


_RECORD_KEYS = ("op", "to", "layer", "files", "steps", "providers", "skip_damaged")


# -- the note of the last rollback (key ``redo_state``; see cowfs/layers/redo.py) ----------


@dataclass(frozen=True)
class RedoState:
    """What the last rollback kept for a redo, and where that stands
    (``state``: building, ready, redoing, unavailable or gone; ``why``:
    why it cannot be redone).  Kept as the JSON it always was (see
    `to_json`): "moves" once sealed, "segment" once sealed or discarded."""

    state: str
    why: str
    to: int
    dropped: list[int]  # the rolled-back layers
    kept: list[int]  # the layers below them
    fresh: int | None  # the fresh base it opened, if it rolled back the base too
    seq: int  # the first seq recorded since the rollback
    time: float
    moves: bool | None = None  # whether it noted where the redo moves (sealed)
    segment: int | None = None  # the index id of what changed since (see redo)
    segment_written: bool = False  # whether "segment" is in the JSON (maybe null)
    extra: dict = field(default_factory=dict)  # keys this cowfs does not know

    @classmethod
    def from_json(cls, d: dict) -> RedoState:
        return cls(
            state=d["state"],
            why=d.get("why", ""),
            to=d["to"],
            dropped=d["dropped"],
            kept=d["kept"],
            fresh=d.get("fresh"),
            seq=d["seq"],
            time=d["time"],
            moves=d.get("moves"),
            segment=d.get("segment"),
            segment_written="segment" in d,
            extra={k: v for k, v in d.items() if k not in _REDO_KEYS},
        )

    def to_json(self) -> dict:
        d: dict[str, Any] = {
            "state": self.state,
            "why": self.why,
            "to": self.to,
            "dropped": self.dropped,
            "kept": self.kept,
            "fresh": self.fresh,
            "seq": self.seq,
            "time": self.time,
        }
        if self.moves is not None:
            d["moves"] = self.moves
        if self.segment_written or self.segment is not None:
            d["segment"] = self.segment
        return d | self.extra


_REDO_KEYS = ("state", "why", "to", "dropped", "kept", "fresh", "seq", "time", "moves", "segment")


# -- checksums ------------------------------------------------------------------
# Every journal record, index entry, layer row, meta value and the redo note
# is written sealed: a NUL byte, the 8-byte xxh3-64 digest of the database's
# name, the key and the value, then the value.  A sealed value is verified
# when read; one that fails is damage, reported and never used.  Values an
# older cowfs wrote carry no seal and are read as they are (``check`` counts
# them): a JSON value never begins with NUL, an unsealed integer is 8 bytes,
# an unsealed journal record begins with its kind (never 0).

SEAL = 0
SEAL_LEN = 9


class Damage(ValueError):
    """A stored value that fails its checksum or does not decode."""


def _digest(db: bytes, key: bytes, body: bytes) -> bytes:
    return xxhash.xxh3_64_digest(b"".join((db, b"\0", key, b"\0", body)))


def seal(db: bytes, key: bytes, body: bytes) -> bytes:
    """*body* sealed for *key* of database *db* (journal records: b"", b"")."""
    return b"\0" + _digest(db, key, body) + body


def is_sealed(raw: bytes) -> bool:
    return len(raw) >= SEAL_LEN and raw[0] == SEAL


def unseal(db: bytes, key: bytes, raw: bytes) -> bytes:
    """The value sealed in *raw* (or *raw* itself, written unsealed by an
    older cowfs); Damage when its checksum does not match."""
    if not is_sealed(raw):
        return raw
    body = raw[SEAL_LEN:]
    if raw[1:SEAL_LEN] != _digest(db, key, body):
        raise Damage("fails its checksum")
    return body


def describe_db(db: bytes, key: bytes) -> str:
    """What an entry of the store is, for messages."""
    if db == DB_LAYERS and len(key) == 8:
        return f"the record of layer {from_u64(key)}"
    if db == DB_META:
        return f"the store's {key.decode(errors='replace')!r} entry"
    if db == DB_REDO and key == K_REDO_STATE:
        return "the note of the last rollback (for redo)"
    return f"an entry of the store's {db.decode()} database"


def open_sealed(db: bytes, key: bytes, raw: bytes) -> bytes:
    """The value of an entry a sound store must have intact: StoreError
    (naming it) when it fails its checksum."""
    try:
        return unseal(db, key, raw)
    except Damage as e:
        raise StoreError(
            f"the store is damaged: {describe_db(db, key)} {e}; run `cowfs check`"
        ) from None


def meta_json(db: bytes, key: bytes, raw: bytes | None) -> Any:
    """A sealed JSON value (None for none), StoreError when damaged."""
    if raw is None:
        return None
    body = open_sealed(db, key, raw)
    try:
        return from_json(body)
    except ValueError:
        raise StoreError(
            f"the store is damaged: {describe_db(db, key)} does not decode; run `cowfs check`"
        ) from None


def meta_int(key: bytes, raw: bytes) -> int:
    """A sealed u64 of the meta database, StoreError when damaged."""
    body = open_sealed(DB_META, key, raw)
    if len(body) != 8:
        raise StoreError(
            f"the store is damaged: {describe_db(DB_META, key)} does not decode; run `cowfs check`"
        )
    return from_u64(body)


def index_value(key: bytes, seq: int) -> bytes:
    return seal(DB_INDEX, key, u64(seq))


def index_seq(key: bytes, raw: bytes) -> int | None:
    """The seq an index entry names; None when it is damaged (an entry the
    capture then does not trust: the object is captured again)."""
    try:
        body = unseal(DB_INDEX, key, raw)
    except Damage:
        return None
    return from_u64(body) if len(body) == 8 else None


# -- index keys ---------------------------------------------------------------

IDX_CREATED = b"N"
IDX_META = b"M"
IDX_XATTRS = b"X"
IDX_CHUNK = b"C"
IDX_PINNED = b"P"  # (value 0) seen at a captured path: never ignored in this layer
IDX_ZEROS = b"Z"  # + the first chunk of a range of zeros (a CHUNK record spanning chunks)
INDEX_FLAGS = (IDX_CREATED, IDX_PINNED)  # index entries that name no record
# the value of an ``N`` entry of an object made at a captured path (a CREATE
# record names it): pinned, without a ``P`` entry of its own (an index entry
# per file made is LMDB pages the daemon maps: 200,000 new files, 10 MB)
CREATED_NAMED = 1


def pins(kind: bytes, value: int | None) -> bool:
    """Whether an index entry of *kind* whose value is *value*
    (``index_seq``; None: damaged, trusted to pin) pins its object."""
    return kind == IDX_PINNED or kind == IDX_CREATED and value != 0


def index_prefix(layer: int, ino: int | None = None) -> bytes:
    return u64(layer) if ino is None else u64(layer) + u64(ino)


def index_key(layer: int, ino: int, kind: bytes, chunk: int | None = None) -> bytes:
    key = u64(layer) + u64(ino) + kind
    return key + u64(chunk) if chunk is not None else key


class IndexKey(NamedTuple):
    layer: int
    ino: int
    kind: bytes
    chunk: int | None


def split_index_key(key: bytes) -> IndexKey:
    layer, ino = from_u64(key[:8]), from_u64(key[8:16])
    kind = key[16:17]
    chunk = from_u64(key[17:25]) if len(key) > 17 else None
    return IndexKey(layer, ino, kind, chunk)


# -- attribution keys -----------------------------------------------------------
# (like index keys, they begin with their layer: index_prefix finds both)


def who_key(layer: int, ino: int) -> bytes:
    return u64(layer) + u64(ino)


def key_layer(key: bytes) -> int:
    """The layer an index or attribution key belongs to."""
    return from_u64(key[:8])


def with_layer(key: bytes, layer: int) -> bytes:
    """The same index or attribution key, in layer *layer*."""
    return u64(layer) + key[8:]


# -- keys of the redo database -------------------------------------------------------
# (each but the state begins with one byte naming what it holds; see ``redo`` above)

K_REDO_STATE = b"state"
REDO_LAYER = b"L"
REDO_RECORD = b"r"
REDO_INVERSE = b"v"
REDO_INDEX = b"i"
REDO_WHO = b"w"
REDO_PRINT = b"f"
REDO_MOVED = b"m"


def redo_layer_key(layer: int) -> bytes:
    return REDO_LAYER + u64(layer)


def redo_record_key(seq: int) -> bytes:
    return REDO_RECORD + u64(seq)


def redo_inverse_key(seq: int, i: int | None = None) -> bytes:
    """The key of inverse *i* of record *seq*'s undo step (None: the prefix
    of them all)."""
    return REDO_INVERSE + u64(seq) + (bytes((i,)) if i is not None else b"")


def redo_kept_key(kind: bytes, key: bytes) -> bytes:
    """Where the redo database keeps *key* of a dropped layer (kind
    ``REDO_LAYER``, ``REDO_RECORD``, ``REDO_INDEX``, ``REDO_WHO``) or a
    location's note (``REDO_PRINT``, ``REDO_MOVED``)."""
    return kind + key


def split_redo_key(key: bytes) -> tuple[bytes, bytes]:
    """(kind, the rest): the original key of a kept entry, the location of a
    note, the seq (+ u8) of an inverse."""
    return key[:1], key[1:]


def redo_inverse_seq(key: bytes) -> int:
    return from_u64(key[1:9])


# -- content hashes of grave objects ---------------------------------------------

SUM_PENDING = b"p"
SUM_HASHED = b"h"
SUM_CHANGED = b"c"

# the forms of a hashed entry's digest
SUM_FORM_ALL = 0  # xxh3-128 of every byte (older cowfs: no form byte)
SUM_FORM_DATA = 1  # datahash: what the file holds, block by block
SUM_FORMS = (SUM_FORM_ALL, SUM_FORM_DATA)

_SUM = struct.Struct(">cQQqq")


class GraveSum(NamedTuple):
    state: bytes
    ino: int
    size: int
    mtime_ns: int
    time_ns: int  # pending: when it was removed; hashed: its ctime then
    digest: bytes = b""
    form: int = SUM_FORM_DATA  # (of the digest, when there is one)


def encode_sum(s: GraveSum) -> bytes:
    head = _SUM.pack(s.state, s.ino, s.size, s.mtime_ns, s.time_ns)
    if not s.digest or s.form == SUM_FORM_ALL:
        return head + s.digest
    return head + s.digest + bytes([s.form])


def decode_sum(raw: bytes) -> GraveSum | None:
    """None for a value that does not decode (reported by the check)."""
    if len(raw) not in (_SUM.size, _SUM.size + 16, _SUM.size + 17):
        return None
    state, ino, size, mtime_ns, time_ns = _SUM.unpack_from(raw)
    digest = bytes(raw[_SUM.size : _SUM.size + 16])
    form = raw[-1] if len(raw) == _SUM.size + 17 else SUM_FORM_ALL
    s = GraveSum(state, ino, size, mtime_ns, time_ns, digest, form)
    if (
        s.state not in (SUM_PENDING, SUM_HASHED, SUM_CHANGED)
        or (s.state == SUM_HASHED) != (len(s.digest) == 16)
        or form not in SUM_FORMS
        or (len(raw) == _SUM.size + 17 and form == SUM_FORM_ALL)
    ):
        return None
    return s


# -- locations ----------------------------------------------------------------
# A location names an object at the moment a record was written: a path
# relative to the workspace root (bytes, '/'-separated, b"" for the root), or a
# grave entry in the store, written GRAVE_PREFIX + decimal id.  NUL never occurs
# in file names, so the two cannot collide.


def show_loc(loc: bytes) -> str:
    """A location for messages: the workspace path (quoted as text.quote
    does), or the removed object."""
    gid = grave_id(loc)
    return f"(removed object {gid})" if gid is not None else (quote(loc) or ".")


# -- undo records ---------------------------------------------------------------
# Each record says how to undo one change.  They are applied last first.  A
# journal value is the kind byte, then each field in order: ``i`` + i64 for an
# integer, ``b`` + u32 length + the bytes, (``n`` for None, never written).
# Every kind's first field is the location it names.  The name records
# (CREATE, LINK, GRAVE, RENAME, EXCHANGE) end with the backing inode of
# the directory of each name they record (``dir``, ``src_dir``, ...): their
# undo step acts in that directory or fails.  Those fields are written
# only when not 0 and read as 0 when absent (records of an older cowfs,
# and the ones a redo writes): then the step acts wherever the path leads,
# as it always did.

CREATE = 1
LINK = 2
GRAVE = 3
RENAME = 4
EXCHANGE = 5
META = 6
XATTRS = 7
CHUNK = 8
DAMAGED = 0  # a record that does not decode (never written)

KIND_NAMES = {
    DAMAGED: "damaged record",
    CREATE: "create",
    LINK: "link",
    GRAVE: "grave",
    RENAME: "rename",
    EXCHANGE: "exchange",
    META: "meta",
    XATTRS: "xattrs",
    CHUNK: "chunk",
}


class Create(NamedTuple):
    """An object was created at *path* (in directory *dir*): remove it."""

    path: bytes
    dir: int = 0

    @property
    def kind(self) -> int:
        return CREATE


class Link(NamedTuple):
    """A hard link was made at *path* (in directory *dir*): unlink it."""

    path: bytes
    dir: int = 0

    @property
    def kind(self) -> int:
        return LINK


class Grave(NamedTuple):
    """The object *ino* at *path* (in directory *dir*) was moved into grave
    entry *grave*: move it back."""

    path: bytes
    grave: int
    ino: int
    dir: int = 0

    @property
    def kind(self) -> int:
        return GRAVE


class Rename(NamedTuple):
    """Object *ino* was renamed *src* -> *dst* (from directory *src_dir* to
    *dst_dir*): rename it back."""

    src: bytes
    dst: bytes
    ino: int
    src_dir: int = 0
    dst_dir: int = 0

    @property
    def kind(self) -> int:
        return RENAME


class Exchange(NamedTuple):
    """*a* (object *ino_a*, in directory *a_dir*) and *b* (*ino_b*, in
    *b_dir*) were exchanged: exchange them again."""

    a: bytes
    b: bytes
    ino_a: int
    ino_b: int
    a_dir: int = 0
    b_dir: int = 0

    @property
    def kind(self) -> int:
        return EXCHANGE


class Meta(NamedTuple):
    """The attributes of object *ino* (at *loc*) before its first change."""

    loc: bytes
    ino: int
    mode: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int

    @property
    def kind(self) -> int:
        return META


class Xattrs(NamedTuple):
    """All xattrs of object *ino* before its first xattr change (``encode_xattrs``)."""

    loc: bytes
    ino: int
    blob: bytes

    @property
    def kind(self) -> int:
        return XATTRS


class Chunk(NamedTuple):
    """The old bytes of chunk number *chunk* of object *ino*: *length* bytes
    stored under *digest* in ``chunks``; an empty digest: the chunk was all
    zeros (a hole).  A record with an empty digest may span more than one
    chunk (*length* greater than the chunk size, indexed ``IDX_ZEROS``):
    the bytes [chunk * chunk size, + length) were all zeros -- one record
    for a run of holes, so capturing a sparse file whole costs what it
    holds, not its size (``chunk_problem`` says which are valid).  Where layers merged into one
    overlap such a range with other records of the same chunks, the oldest
    record holds the state at the start: a rollback applies it last, a
    reading of the journal keeps the first (see ``cowfs/storage/zeros.py``)."""

    loc: bytes
    ino: int
    chunk: int
    length: int
    digest: bytes

    @property
    def kind(self) -> int:
        return CHUNK


class Damaged(NamedTuple):
    """A journal value that does not decode (corruption), kept to be reported."""

    raw: bytes

    @property
    def kind(self) -> int:
        return DAMAGED


Record = Create | Link | Grave | Rename | Exchange | Meta | Xattrs | Chunk | Damaged
Change = Create | Link | Grave | Rename | Exchange | Meta | Xattrs | Chunk  # (written)

RECORD_TYPES: dict[int, type[Change]] = {
    CREATE: Create,
    LINK: Link,
    GRAVE: Grave,
    RENAME: Rename,
    EXCHANGE: Exchange,
    META: Meta,
    XATTRS: Xattrs,
    CHUNK: Chunk,
}
# the type of each field (int or bytes), for checking what a journal value decodes to
_SHAPES: dict[int, tuple[type, ...]] = {
    kind: tuple(get_type_hints(cls).values()) for kind, cls in RECORD_TYPES.items()
}
assert all(t in (int, bytes) for shape in _SHAPES.values() for t in shape)


def object_of(rec: Record) -> int | None:
    """The object (backing inode) a META, XATTRS or CHUNK record restores."""
    return rec.ino if isinstance(rec, Meta | Xattrs | Chunk) else None


def restores(rec: Record) -> int | None:
    """The object whose bytes or attributes a record puts back (a GRAVE
    record: the removed object, from the grave)."""
    return rec.ino if isinstance(rec, Grave) else object_of(rec)


class Fingerprint(NamedTuple):
    """What ``backing.fingerprint`` keeps of an object, in the order of its
    JSON list (the drift record, a rollback's seal): ns times."""

    ino: int
    mode: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    ctime_ns: int

    def older_form(self) -> list[int]:
        """As a drift record of an older cowfs kept it: [size, mtime_ns,
        ctime_ns, ino]."""
        return [self.size, self.mtime_ns, self.ctime_ns, self.ino]


def chunk_problem(rec: Chunk, chunk_size: int) -> str | None:
    """What makes a decoded CHUNK record impossible (None: nothing): a
    chunk or length out of range, bytes longer than a chunk, a range of
    zeros past the largest file offset."""
    if rec.chunk < 0 or rec.length < 0:
        return f"chunk {rec.chunk} of length {rec.length}"
    if rec.digest and rec.length > chunk_size:
        return f"chunk {rec.chunk}: {rec.length} bytes, more than a chunk"
    if rec.chunk * chunk_size + rec.length > 1 << 63:
        return f"zeros from chunk {rec.chunk} over {rec.length} bytes, past any file's end"
    return None


def record_name(rec: Record) -> str:
    return KIND_NAMES[rec.kind]


def record_loc(rec: Change) -> bytes:
    """The location a record names first (its path, source, or the object's)."""
    return rec[0]


def meta_record(loc: bytes, st: os.stat_result) -> Meta:
    """The META record of the object *st* describes, at *loc*."""
    return Meta(
        loc, st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_atime_ns, st.st_mtime_ns
    )


_I = struct.Struct(">q")
_U = struct.Struct(">Q")
_L = struct.Struct(">I")
_I_MAX = (1 << 63) - 1


def encode_record(rec: Change) -> bytes:
    """A journal value: the record's fields (but trailing ones that are
    optional and 0: see ``_REQUIRED``), sealed (see ``seal``).  A field is
    ``i`` + a signed 64-bit integer, ``u`` + an unsigned one (past the
    signed ones), or ``b`` + a u32 length + bytes."""
    out = [bytes((rec.kind,))]
    n = len(rec)
    least = _REQUIRED[rec.kind]
    while n > least and rec[n - 1] == 0:
        n -= 1
    for f in rec[:n] if n < len(rec) else rec:
        if isinstance(f, int):
            # (an integer past a signed one: an inode number an overlay
            # gives with its layer in the top bits -- format 2)
            out.append(b"i" + _I.pack(f) if f <= _I_MAX else b"u" + _U.pack(f))
        else:
            out.append(b"b" + _L.pack(len(f)) + bytes(f))
    return seal(b"", b"", b"".join(out))


_TAG_INT, _TAG_BYTES, _TAG_UINT = ord("i"), ord("b"), ord("u")

# kind -> how many of its fields every record has (the others, at the end,
# are optional: absent, they are 0)
_REQUIRED: dict[int, int] = {
    kind: len(cls._fields) - len(cls._field_defaults) for kind, cls in RECORD_TYPES.items()
}
assert all(
    v == 0 for cls in RECORD_TYPES.values() for v in cls._field_defaults.values()
)  # (absent, they decode as 0)


# kind -> (record type, the tag of each field in order)
_DECODERS: dict[int, tuple[type[Change], bytes]] = {
    kind: (cls, bytes(_TAG_INT if t is int else _TAG_BYTES for t in _SHAPES[kind]))
    for kind, cls in RECORD_TYPES.items()
}


def decode_record(data: bytes) -> Change:
    """ValueError (Damage) for a value that fails its checksum or is not a
    record of a known kind with the fields of its kind."""
    if data[0] == SEAL:
        data = unseal(b"", b"", data)
    return _decode_fields(data)


def _decode_fields(data: bytes) -> Change:
    kind = data[0]
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise ValueError(f"corrupt journal record (kind {kind})")
    cls, tags = decoder
    fields: list[int | bytes] = []
    add = fields.append
    pos = 1
    least = _REQUIRED[kind]
    for tag in tags:
        if pos == len(data) and len(fields) >= least:
            break  # (the optional fields after it are absent: 0)
        have = data[pos]
        if have != tag and not (have == _TAG_UINT and tag == _TAG_INT):
            raise ValueError(f"corrupt journal record (kind {kind}: field {len(fields)})")
        if tag == _TAG_INT:
            add((_I if have == _TAG_INT else _U).unpack_from(data, pos + 1)[0])
            pos += 9
        else:
            end = pos + 5 + _L.unpack_from(data, pos + 1)[0]
            if end > len(data):
                raise ValueError(f"corrupt journal record (kind {kind}: truncated)")
            add(bytes(data[pos + 5 : end]))
            pos = end
    if pos != len(data):
        raise ValueError(f"corrupt journal record (kind {kind}: bytes past its fields)")
    if len(fields) < len(tags):
        fields += [0] * (len(tags) - len(fields))  # (the optional fields: all integers)
    return cls._make(fields)


def decode_or_damaged(data: bytes) -> Record:
    """Decode a journal record; one that fails its checksum or does not
    decode (corruption) comes back as a Damaged record holding its bytes,
    so readers can report it."""
    try:
        return decode_record(data)
    except (ValueError, IndexError, struct.error):
        return Damaged(bytes(data))


def damage_of(rec: Damaged) -> str:
    """What is wrong with a damaged record, and the path it seems to name
    (read from its unverified bytes: a hint for people, never acted on)."""
    raw = rec.raw
    why = "does not decode"
    if is_sealed(raw):
        why = "fails its checksum"
        raw = raw[SEAL_LEN:]
    try:
        seems = _decode_fields(raw)
    except (ValueError, IndexError, struct.error):
        return why
    return f"{why} (it seems to be a {record_name(seems)} record of {show_loc(record_loc(seems))})"


def encode_xattrs(pairs: list[tuple[bytes, bytes]]) -> bytes:
    out = []
    for name, value in sorted(pairs):
        out.append(_L.pack(len(name)) + name + _L.pack(len(value)) + value)
    return b"".join(out)


def decode_xattrs(blob: bytes) -> list[tuple[bytes, bytes]]:
    pairs = []
    pos = 0
    while pos < len(blob):
        n = _L.unpack_from(blob, pos)[0]
        name = blob[pos + 4 : pos + 4 + n]
        pos += 4 + n
        m = _L.unpack_from(blob, pos)[0]
        value = blob[pos + 4 : pos + 4 + m]
        pos += 4 + m
        pairs.append((bytes(name), bytes(value)))
    return pairs
