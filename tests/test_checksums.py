"""Every record the store holds is verified before it is used: journal
records, index entries, layer rows, the store's settings and counters, the
redo note.  Bits are flipped in real stores (LMDB opened directly while the
workspace is unmounted); check names what is damaged, a rollback never
applies a damaged record, and stores an older cowfs wrote without checksums
keep working."""

from __future__ import annotations

import json
import os
import stat

from cowfs.errors import PARTIAL, STORE_ERROR
from cowfs.layers import treesnap
from cowfs.storage import schema as S

from .test_check import check, damaged, raw_store, records  # noqa: F401 (fixture)


def flip_sealed(txn, db, key: bytes, change) -> None:
    """Rewrite the value at *key* as a flipped bit would: its body changed
    by *change*, its checksum left as it was."""
    raw = txn.get(key, db=db)
    assert S.is_sealed(raw)
    txn.put(key, raw[: S.SEAL_LEN] + change(raw[S.SEAL_LEN :]), db=db)


def test_a_flipped_mode_bit_in_a_record_is_never_applied(damaged):  # noqa: F811
    ws, layer, before = damaged
    with raw_store(ws) as (txn, dbs):
        seq, rec = next(
            (seq, rec)
            for seq, rec in records(txn, dbs)
            if isinstance(rec, S.Meta) and rec.loc == b"a.txt"
        )
        assert stat.S_IMODE(rec.mode) == 0o644
        setuid = rec._replace(mode=rec.mode | stat.S_ISUID)
        old = S.encode_record(rec)[S.SEAL_LEN :]
        new = S.encode_record(setuid)[S.SEAL_LEN :]
        assert len(old) == len(new)
        # exactly one bit differs: the record still decodes, only its checksum tells
        assert bin(int.from_bytes(old, "big") ^ int.from_bytes(new, "big")).count("1") == 1
        flip_sealed(txn, dbs[S.DB_JOURNAL], S.u64(seq), lambda _: new)
    code, res, _ = check(ws)
    assert code == STORE_ERROR
    [p] = [p for p in res["problems"] if f"record {seq}" in p["problem"]]
    assert "fails its checksum" in p["problem"] and "meta record of a.txt" in p["problem"]
    assert p["layers"] == [layer] and p["paths"] == ["a.txt"]
    r = ws.cowfs("rollback", check=False)
    assert r.returncode == PARTIAL, r.stderr
    assert "Traceback" not in r.stderr and "a.txt: not restored" in r.stderr
    st = os.lstat(ws / "a.txt")
    assert not st.st_mode & stat.S_ISUID
    assert (ws / "a.txt").read_text() == "changed\n"  # left whole as it is, not torn
    after = ws.snapshot()
    for path in (b"big", b"dir", b"dir/b.txt"):
        assert after[path] == before[path]
    # what it could not apply stays in the store, with its layer, until given up
    assert "--skip-damaged" in r.stderr
    assert [entry["id"] for entry in json.loads(ws.cowfs("--json", "log").stdout)][-1] == layer
    code, res, _ = check(ws)
    assert code == STORE_ERROR and any(f"record {seq}" in p["problem"] for p in res["problems"])
    r = ws.cowfs("rollback", check=False)  # again: the same, nothing changes
    assert r.returncode == PARTIAL and "a.txt: not restored" in r.stderr
    treesnap.assert_same(after, ws.snapshot())
    r = ws.cowfs("rollback", "--skip-damaged", check=False)
    assert r.returncode == PARTIAL and "a.txt: not restored" in r.stderr
    assert layer not in [e["id"] for e in json.loads(ws.cowfs("--json", "log").stdout)]
    code, res, _ = check(ws)
    assert (code, res["problems"]) == (0, []), res["problems"]
    treesnap.assert_same(after, ws.snapshot())
    assert not os.lstat(ws / "a.txt").st_mode & stat.S_ISUID


def test_a_damaged_layer_row_or_counter_is_named_never_a_traceback(damaged):  # noqa: F811
    ws, layer, _ = damaged
    with raw_store(ws) as (txn, dbs):
        flip_sealed(
            txn, dbs[S.DB_LAYERS], S.u64(layer), lambda b: b.replace(b"to damage", b"to dbmage")
        )
    for args in (("status",), ("log",), ("rollback",)):
        r = ws.cowfs(*args, check=False)
        assert r.returncode == STORE_ERROR, (args, r.stderr)
        assert f"the record of layer {layer} fails its checksum" in r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    code, res, _ = check(ws)
    assert code == STORE_ERROR and f"layer {layer}" in res["problems"][0]["problem"]
    r = ws.cowfs("mount", str(ws.path), check=False)
    assert r.returncode == STORE_ERROR and f"layer {layer}" in r.stderr
    with raw_store(ws) as (txn, dbs):  # put the byte back: all is well again
        flip_sealed(
            txn, dbs[S.DB_LAYERS], S.u64(layer), lambda b: b.replace(b"to dbmage", b"to damage")
        )
        flip_sealed(
            txn, dbs[S.DB_META], S.K_NEXT_SEQ, lambda b: bytes([b[0] ^ 0x80]) + b[1:]
        )  # (the journal's counter: a wrong one would overwrite records)
    r = ws.cowfs("status", check=False)
    assert r.returncode == STORE_ERROR and "'next_seq' entry" in r.stderr


def test_a_damaged_index_entry_is_reported_and_never_trusted(damaged):  # noqa: F811
    ws, layer, before = damaged
    with raw_store(ws) as (txn, dbs):
        # a flipped bit in the key of big's chunk entry: chunk 1 -> chunk 3 (never captured)
        cur = txn.cursor(db=dbs[S.DB_INDEX])
        entries = [(bytes(k), bytes(v)) for k, v in cur]
        key, val = next(
            (k, v)
            for k, v in entries
            if S.split_index_key(k).kind == S.IDX_CHUNK and S.split_index_key(k).chunk == 1
        )
        txn.delete(key, db=dbs[S.DB_INDEX])
        moved = key[:-1] + bytes([key[-1] ^ 0x02])
        txn.put(moved, val, db=dbs[S.DB_INDEX])
    code, res, _ = check(ws)
    assert code == STORE_ERROR
    [p] = res["problems"]
    assert "1 index entry fail" in p["problem"] and p["repairable"]
    ws.mount()
    # what the damaged entry claimed captured is captured when it changes
    with open(ws / "big", "r+b") as f:
        f.seek(3 * 64 << 10)
        f.write(b"x")
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def unseal_everything(ws) -> int:
    """Rewrite the store as a cowfs before checksums wrote it."""
    n = 0
    with raw_store(ws) as (txn, dbs):
        for name in (S.DB_JOURNAL, S.DB_INDEX, S.DB_LAYERS, S.DB_META, S.DB_REDO):
            db = dbs[name]
            for key, raw in [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]:
                if S.is_sealed(raw) and not (name == S.DB_REDO and key != S.K_REDO_STATE):
                    txn.put(key, raw[S.SEAL_LEN :], db=db)
                    n += 1
    return n


def test_a_store_without_checksums_still_works_and_check_counts_it(damaged):  # noqa: F811
    ws, layer, before = damaged
    n = unseal_everything(ws)
    assert n > 10
    code, res, _ = check(ws)
    assert (code, res["ok"]) == (0, True)
    assert res["unsealed"] == n
    r = ws.cowfs("check", check=False)
    assert "without a checksum" in r.stdout, r.stdout
    ws.mount()
    assert json.loads(ws.cowfs("--json", "log").stdout)[-1]["id"] == layer
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())
