"""The typed records of schema.py keep the on-disk format: every kind encodes
to the very bytes the positional encoder (``encode_record(kind, *fields)``,
cowfs up to the typed records) wrote for the same values, sealed with a
checksum, and what that encoder wrote (unsealed, as older stores hold it)
decodes to the same values.  A flipped bit anywhere in a sealed record makes
it damaged, never another record.  No FUSE."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cowfs.storage import schema as S

# -- the positional format, frozen as it was written before the typed records ----

_I = struct.Struct(">q")
_L = struct.Struct(">I")


def old_encode(kind: int, *fields: int | bytes | None) -> bytes:
    out = [bytes((kind,))]
    for f in fields:
        if f is None:
            out.append(b"n")
        elif isinstance(f, int):
            out.append(b"i" + _I.pack(f))
        else:
            out.append(b"b" + _L.pack(len(f)) + bytes(f))
    return b"".join(out)


def old_decode(data: bytes) -> tuple[int, tuple]:
    kind, fields, pos = data[0], [], 1
    while pos < len(data):
        tag = data[pos]
        if tag == ord("b"):
            n = _L.unpack_from(data, pos + 1)[0]
            fields.append(bytes(data[pos + 5 : pos + 5 + n]))
            pos += 5 + n
        elif tag == ord("i"):
            fields.append(_I.unpack_from(data, pos + 1)[0])
            pos += 9
        else:
            raise ValueError(tag)
    return kind, tuple(fields)


# One record of each kind, with the bytes the positional encoder wrote for it
# (taken from cowfs before the typed records: they must never change).
GOLDEN = [
    (S.Create(b"dir/new file"), "01620000000c6469722f6e65772066696c65"),
    (S.Link(b"a/\xffb"), "026200000004612fff62"),
    (
        S.Grave(b"gone.txt", 12, 4242),
        "036200000008676f6e652e74787469000000000000000c690000000000001092",
    ),
    (
        S.Rename(b"a", S.grave_loc(7), 99),
        "0462000000016162000000080067726176652f37690000000000000063",
    ),
    (
        S.Exchange(b"x", b"y/z", 5, 6),
        "056200000001786200000003792f7a690000000000000005690000000000000006",
    ),
    (
        S.Meta(b"", 2, 0o40755, 1000, 1000, 4096, -1, 1700000000123456789),
        "0662000000006900000000000000026900000000000041ed6900000000000003e86900000000000003e8"
        "69000000000000100069ffffffffffffffff6917979cfe3d85cd15",
    ),
    (
        S.Xattrs(b"f", 3, S.encode_xattrs([(b"user.a", b"\x00\x01")])),
        "07620000000166690000000000000003620000001000000006757365722e61000000020001",
    ),
    (
        S.Chunk(b"big", 8, 3, 65536, bytes(range(16))),
        "0862000000036269676900000000000000086900000000000000036900000000000100006200000010"
        "000102030405060708090a0b0c0d0e0f",
    ),
]


def test_golden_covers_every_kind():
    assert {type(rec) for rec, _ in GOLDEN} == set(S.RECORD_TYPES.values())
    assert {rec.kind for rec, _ in GOLDEN} == set(S.KIND_NAMES) - {S.DAMAGED}
    for kind, cls in S.RECORD_TYPES.items():
        assert (
            S.KIND_NAMES[kind]
            and S.record_name(cls._make(b"" if t is bytes else 0 for t in S._SHAPES[kind]))
            == S.KIND_NAMES[kind]
        )


@pytest.mark.parametrize("rec, raw", GOLDEN, ids=lambda x: type(x).__name__)
def test_golden_bytes(rec, raw):
    data = bytes.fromhex(raw)
    assert S.encode_record(rec) == S.seal(b"", b"", data)
    assert S.decode_record(S.encode_record(rec)) == rec
    # (the golden records have no directory fields: those are written only when set)
    assert old_encode(rec.kind, *rec[: S._REQUIRED[rec.kind]]) == data
    assert S.decode_record(data) == rec
    assert type(S.decode_record(data)) is type(rec)
    assert S.decode_or_damaged(data) == rec
    assert old_decode(data) == (rec.kind, tuple(rec[: S._REQUIRED[rec.kind]]))


_loc = st.one_of(st.binary(max_size=40), st.integers(0, 2**40).map(S.grave_loc))
_i64 = st.integers(-(2**63), 2**63 - 1)
_u = st.integers(0, 2**63 - 1)


@st.composite
def records(draw):
    kind = draw(st.sampled_from(sorted(S.RECORD_TYPES)))
    cls = S.RECORD_TYPES[kind]
    names = cls._fields
    fields = [
        draw(_loc)
        if t is bytes and n in ("path", "src", "dst", "a", "b", "loc")
        else draw(st.binary(max_size=300))
        if t is bytes
        else draw(_i64 if n.endswith("_ns") else _u)
        for n, t in zip(names, S._SHAPES[kind], strict=True)
    ]
    return cls._make(fields)


def written(rec) -> tuple:
    """The fields of *rec* a journal value holds: but the optional ones at
    the end that are 0 (the directories of the name records)."""
    n = len(rec)
    while n > S._REQUIRED[rec.kind] and rec[n - 1] == 0:
        n -= 1
    return tuple(rec[:n])


@given(records())
def test_same_bytes_as_the_positional_encoder(rec):
    data = S.encode_record(rec)
    assert data == S.seal(b"", b"", old_encode(rec.kind, *written(rec)))
    back = S.decode_record(data)
    assert back == rec and type(back) is type(rec)
    assert old_decode(data[S.SEAL_LEN :]) == (rec.kind, written(rec))


@given(records(), st.data())
def test_a_flipped_bit_makes_a_record_damaged(rec, data):
    raw = bytearray(S.encode_record(rec))
    bit = data.draw(st.integers(0, len(raw) * 8 - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    got = S.decode_or_damaged(bytes(raw))
    assert isinstance(got, S.Damaged)
    assert got.raw == bytes(raw)


def test_a_damaged_record_says_what_it_seems_to_be():
    raw = bytearray(S.encode_record(S.Meta(b"dir/f", 7, 0o100644, 0, 0, 1, 2, 3)))
    raw[-30] ^= 0x08  # (inside the mode field)
    got = S.decode_or_damaged(bytes(raw))
    assert isinstance(got, S.Damaged)
    assert S.damage_of(got) == "fails its checksum (it seems to be a meta record of dir/f)"
    assert S.damage_of(S.Damaged(b"\x09junk")) == "does not decode"


def test_sealed_values_are_bound_to_their_key():
    sealed = S.seal(S.DB_LAYERS, S.u64(3), b'{"start": 1}')
    assert S.unseal(S.DB_LAYERS, S.u64(3), sealed) == b'{"start": 1}'
    for db, key in ((S.DB_LAYERS, S.u64(4)), (S.DB_META, S.u64(3))):
        with pytest.raises(S.Damage):
            S.unseal(db, key, sealed)
    # what an older cowfs wrote is read as it is
    assert S.unseal(S.DB_LAYERS, S.u64(3), b'{"start": 1}') == b'{"start": 1}'
    assert S.index_seq(b"k", S.u64(9)) == 9
    assert S.index_seq(b"k", S.index_value(b"k", 9)) == 9
    assert S.index_seq(b"j", S.index_value(b"k", 9)) is None


def test_named_fields_are_the_positions_of_the_format():
    assert S.Create._fields == ("path", "dir")
    assert S.Link._fields == ("path", "dir")
    assert S.Grave._fields == ("path", "grave", "ino", "dir")
    assert S.Rename._fields == ("src", "dst", "ino", "src_dir", "dst_dir")
    assert S.Exchange._fields == ("a", "b", "ino_a", "ino_b", "a_dir", "b_dir")
    assert S.Meta._fields == ("loc", "ino", "mode", "uid", "gid", "size", "atime_ns", "mtime_ns")
    assert S.Xattrs._fields == ("loc", "ino", "blob")
    assert S.Chunk._fields == ("loc", "ino", "chunk", "length", "digest")


def test_meta_record_from_a_stat(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"12345")
    s = p.stat()
    m = S.meta_record(b"f", s)
    assert S.encode_record(m)[S.SEAL_LEN :] == old_encode(
        S.META,
        b"f",
        s.st_ino,
        s.st_mode,
        s.st_uid,
        s.st_gid,
        s.st_size,
        s.st_atime_ns,
        s.st_mtime_ns,
    )
    assert (m.mode, m.size, m.mtime_ns) == (s.st_mode, 5, s.st_mtime_ns)


@pytest.mark.parametrize(
    "raw",
    [
        b"\x06garbage",  # a bad tag
        old_encode(9, b"x"),  # no such kind
        old_encode(S.DAMAGED, b"x"),  # never written
        old_encode(S.CREATE),  # no fields
        old_encode(S.CREATE, 5),  # an int for a path
        old_encode(S.GRAVE, b"p", 1),  # a field short
        old_encode(S.CHUNK, b"p", 1, 2, 3, b"h", 4),  # a field too many
        old_encode(S.META, b"p", 1, 2, 3, None, 5, 6, 7),  # a None
        old_encode(S.CHUNK, b"p", 1, 2, 3, 4),  # an int for the digest
        b"\x08i\x00",  # cut short
    ],
)
def test_what_does_not_decode_is_damaged(raw):
    with pytest.raises((ValueError, IndexError, struct.error)):
        S.decode_record(raw)
    rec = S.decode_or_damaged(raw)
    assert rec == S.Damaged(raw) and rec.kind == S.DAMAGED
    assert S.record_name(rec) == "damaged record"


def test_keys_as_they_were_built_by_hand():
    assert S.index_key(3, 99, S.IDX_CHUNK, 5) == S.u64(3) + S.u64(99) + b"C" + S.u64(5)
    assert S.split_index_key(S.index_key(3, 99, S.IDX_PINNED)) == (3, 99, b"P", None)
    k = S.split_index_key(S.index_key(3, 99, S.IDX_CHUNK, 5))
    assert (k.layer, k.ino, k.kind, k.chunk) == (3, 99, S.IDX_CHUNK, 5)
    assert S.who_key(4, 7) == S.u64(4) + S.u64(7)
    assert S.key_layer(S.who_key(4, 7)) == 4
    assert S.with_layer(S.who_key(4, 7), 2) == S.who_key(2, 7)
    assert S.redo_layer_key(4) == b"L" + S.u64(4)
    assert S.redo_record_key(9) == b"r" + S.u64(9)
    assert S.redo_inverse_key(9) == b"v" + S.u64(9)
    assert S.redo_inverse_key(9, 2) == b"v" + S.u64(9) + b"\x02"
    assert S.redo_inverse_seq(S.redo_inverse_key(9, 2)) == 9
    assert S.redo_kept_key(S.REDO_INDEX, b"key") == b"ikey"
    assert S.redo_kept_key(S.REDO_WHO, b"key") == b"wkey"
    assert S.redo_kept_key(S.REDO_PRINT, b"a/b") == b"fa/b"
    assert S.redo_kept_key(S.REDO_MOVED, b"a/b") == b"ma/b"
    assert S.split_redo_key(S.redo_layer_key(4)) == (b"L", S.u64(4))
    # the one-byte kinds never begin the state key
    kinds = [
        S.REDO_LAYER,
        S.REDO_RECORD,
        S.REDO_INVERSE,
        S.REDO_INDEX,
        S.REDO_WHO,
        S.REDO_PRINT,
        S.REDO_MOVED,
    ]
    assert len(set(kinds)) == len(kinds) and S.K_REDO_STATE[:1] not in kinds


def test_docstring_names_every_database_and_index_kind():
    doc = S.__doc__ or ""
    for db in S.ALL_DBS:
        assert f"``{db.decode()}``" in doc
    for kind in (S.IDX_CREATED, S.IDX_META, S.IDX_XATTRS, S.IDX_CHUNK, S.IDX_PINNED):
        assert f"``{kind.decode()}``" in doc
    for kind in (
        S.REDO_LAYER,
        S.REDO_RECORD,
        S.REDO_INVERSE,
        S.REDO_INDEX,
        S.REDO_WHO,
        S.REDO_PRINT,
        S.REDO_MOVED,
    ):
        assert f"``{kind.decode()}`` +" in doc
    for key in (
        S.K_FORMAT,
        S.K_WORKSPACE,
        S.K_CHUNK_SIZE,
        S.K_NEXT_SEQ,
        S.K_NEXT_LAYER,
        S.K_NEXT_GRAVE,
        S.K_NEXT_WRITER,
        S.K_PENDING,
        S.K_STATE,
        S.K_LIMITS,
        S.K_IGNORE,
        S.K_DRIFT,
    ):
        assert f"``{key.decode()}``" in doc
    for op in ("rollback", "commit", "redo", "checkpoint"):
        assert f'"op": "{op}"' in doc


def test_name_records_carry_their_directories_and_old_ones_read_as_none():
    """CREATE, LINK, GRAVE, RENAME and EXCHANGE end with the backing inode
    of the directory of each name (where the undo step must act); written
    only when set, and read as 0 (act wherever the path leads) from the
    records an older cowfs wrote, which have none."""
    for rec in (
        S.Create(b"d/new", 11),
        S.Link(b"d/l", 12),
        S.Grave(b"d/g", 3, 4, 13),
        S.Rename(b"a/x", b"b/y", 5, 14, 15),
        S.Rename(b"a/x", S.grave_loc(2), 5, 14),
        S.Exchange(b"a/x", b"b/y", 6, 7, 16, 17),
    ):
        data = S.encode_record(rec)
        assert S.decode_record(data) == rec
        least = S._REQUIRED[rec.kind]
        old = old_encode(rec.kind, *rec[:least])
        assert S.decode_record(old) == rec._replace(**{f: 0 for f in rec._fields[least:]})
        assert len(S.encode_record(rec._replace(**{f: 0 for f in rec._fields[least:]}))) == (
            len(S.seal(b"", b"", old))
        )
    # (a field cut in two is still damage; one cut off whole, from a sealed
    # record, fails its checksum)
    assert isinstance(S.decode_or_damaged(old_encode(S.CREATE, b"p", 1)[:-3]), S.Damaged)
    sealed = S.encode_record(S.Create(b"p", 1))
    assert isinstance(S.decode_or_damaged(sealed[:-9]), S.Damaged)


@given(st.integers(2**63, 2**64 - 1), st.integers(0, 2**63 - 1))
def test_inode_numbers_past_a_signed_integer_round_trip(ino, small):
    """An overlay numbers its lower layer's objects with the layer in the
    top bits (xino): such numbers are written with the ``u`` tag (format
    2); every smaller number as before, byte for byte."""
    rec = S.Meta(b"d/f", ino, 0o100644, 0, 0, 1, -5, 7)
    data = S.encode_record(rec)
    assert S.decode_record(data) == rec
    body = data[S.SEAL_LEN :]
    assert body[1 + 5 + 3] == ord("u")  # (kind, the path field, then the inode number)
    plain = S.Meta(b"d/f", small, 0o100644, 0, 0, 1, -5, 7)
    assert S.encode_record(plain) == S.seal(b"", b"", old_encode(plain.kind, *plain))
    # a ``u`` where a field is bytes is damage, as any wrong tag is
    bad = bytearray(body)
    bad[1] = ord("u")
    assert isinstance(S.decode_or_damaged(bytes(bad)), S.Damaged)
