"""The journal reader kept between requests: a reading fed records a few at
a time, queried in between (as status, diff and show query it), says
exactly what one reading of all the records at once says; a reading kept
for a real store follows its appends, and is read afresh once records are
deleted or put back.  No FUSE: generated records, a real LMDB store."""

from __future__ import annotations

import gc
import weakref

from hypothesis import given
from hypothesis import strategies as st

from cowfs.storage import schema as S
from cowfs.storage.journal import Reading, Readings
from cowfs.storage.store import Store

NAMES = [b"a", b"b", b"c"]
PATHS = [
    b"/".join(p)
    for p in [(x,) for x in NAMES]
    + [(x, y) for x in NAMES for y in NAMES]
    + [(x, y, z) for x in NAMES[:2] for y in NAMES[:2] for z in NAMES[:2]]
]


def _under(p: bytes, q: bytes) -> bool:
    return p == q or p.startswith(q + b"/") or q.startswith(p + b"/")


@st.composite
def record(draw) -> S.Change:
    path = st.sampled_from(PATHS)
    ino = st.integers(1, 12)
    kind = draw(
        st.sampled_from(
            ["create", "link", "grave", "rename", "exchange", "meta", "chunk", "xattrs"]
        )
    )
    if kind == "create":
        return S.Create(draw(path))
    if kind == "link":
        return S.Link(draw(path))
    if kind == "grave":
        return S.Grave(draw(path), draw(st.integers(1, 99)), draw(ino))
    if kind in ("rename", "exchange"):
        a = draw(path)
        b = draw(path.filter(lambda b: not _under(a, b)))  # (the kernel refuses those)
        if kind == "rename":
            return S.Rename(a, b, draw(ino))
        return S.Exchange(a, b, draw(ino), draw(ino))
    if kind == "meta":
        return S.Meta(
            draw(path),
            draw(ino),
            draw(st.sampled_from([0o100644, 0o40755])),
            0,
            0,
            draw(st.integers(0, 9)),
            1,
            draw(st.integers(1, 3)),
        )
    if kind == "chunk":
        return S.Chunk(
            draw(path),
            draw(ino),
            draw(st.integers(0, 2)),
            5,
            draw(st.sampled_from([b"h1", b"h2", None])),
        )
    return S.Xattrs(draw(path), draw(ino), draw(st.sampled_from([b"", b"x"])))


def said(j: Reading) -> dict:
    """Everything a reading tells its readers (querying it as they do)."""
    names = j.names
    return {
        "start": dict(j.start),
        "created": sorted(j.created()),
        "linked": [names.where(s) for s in j.linked],
        "meta": dict(j.meta),
        "chunks": j.chunks,
        "xattrs": j.xattrs,
        "graves": j.graves,
        "removed": j.removed,
        "touched": j.touched(),
        "now": {p: names.now(p) for p in PATHS},
        "back": {p: names.back(p) for p in PATHS},
    }


def query(j: Reading, paths: list[bytes]) -> None:
    """What status (touched, now, where) and show (back) ask between feeds."""
    j.touched()
    for p in paths:
        j.names.now(p)
        j.names.back(p)


@given(
    st.lists(record(), max_size=40),
    st.lists(st.integers(0, 40), max_size=6),
    st.lists(st.sampled_from(PATHS), max_size=4),
)
def test_a_reading_fed_in_parts_and_queried_between_says_what_one_reading_says(
    records, cuts, asked
):
    numbered = list(enumerate(records))
    kept = Reading((), 1 << 16)
    last = 0
    for cut in sorted(c for c in cuts if c <= len(numbered)) + [len(numbered)]:
        assert kept.feed(numbered[last:cut]) == cut - last
        last = cut
        query(kept, asked)
    assert said(kept) == said(Reading(numbered, 1 << 16))


# -- kept for a store ------------------------------------------------------------------


def open_store(tmp_path) -> Store:
    ws = tmp_path / "ws"
    ws.mkdir()
    return Store.open(str(tmp_path / "store"), str(ws))


def write(store: Store, *records: S.Change) -> None:
    with store.write() as w:
        for rec in records:
            w.record(rec)


def test_a_kept_reading_follows_the_appends_and_is_read_again_after_a_deletion(tmp_path):
    store = open_store(tmp_path)
    try:
        kept = Readings(store)
        kept.WAIT = 3  # (read in the write's wake, or when asked)
        start = store.next_seq
        kept.opened(start)
        write(store, S.Create(b"a.tmp"), S.Rename(b"a.tmp", b"a", 7))
        j = kept.get(start)
        write(store, S.Create(b"d"), S.Rename(b"a", b"d/a", 7))
        assert kept.get(start) is j  # (fed as the transaction committed)
        assert said(j) == said(Reading(store.records(start, store.next_seq), store.chunk_size))
        assert said(j)["created"] == [b"d", b"d/a"]

        with store.write() as w:  # (a rollback's or commit's kind of write)
            w.delete_record(start + 3)
        fresh = kept.get(start)
        assert fresh is not j
        assert said(fresh) == said(Reading(store.records(start, store.next_seq), store.chunk_size))
        assert said(fresh)["created"] == [b"a", b"d"]  # (the move is gone)
    finally:
        store.close()


def test_a_reading_not_kept_when_appends_came_past_it_catches_up(tmp_path):
    store = open_store(tmp_path)
    try:
        start = store.next_seq
        write(store, S.Create(b"x"))
        kept = Readings(store)  # (it was not there for the first write)
        j = kept.get(start)
        store.on_append = None  # (nobody told of this one)
        write(store, S.Rename(b"x", b"y", 3))
        assert kept.get(start) is j  # (read on demand from where it got to)
        assert said(j) == said(Reading(store.records(start, store.next_seq), store.chunk_size))
        assert list(j.created()) == [b"y"]
    finally:
        store.close()


def test_a_reading_past_the_limit_is_not_kept_yet_says_the_same(tmp_path):
    store = open_store(tmp_path)
    try:
        kept = Readings(store)
        kept.LIMIT = 10
        start = store.next_seq
        kept.opened(start)
        for i in range(8):
            write(store, S.Create(b"f%d" % i), S.Rename(b"f%d" % i, b"g%d" % i, i + 1))
        j = kept.get(start)
        # (not kept: handed out again only while someone holds it)
        assert kept.get(start) is j
        assert said(j) == said(Reading(store.records(start, store.next_seq), store.chunk_size))
        held = weakref.ref(j)
        del j
        gc.collect()  # (a reading is a tree of slots: garbage in cycles)
        assert held() is None
        assert said(kept.get(start)) == said(
            Reading(store.records(start, store.next_seq), store.chunk_size)
        )
        # the newest readings are the ones kept
        kept.LIMIT = 1000
        others = [store.next_seq]
        kept.opened(others[0])
        for _ in range(Readings.KEEP):
            write(store, S.Create(b"n%d" % store.next_seq))
            others.append(store.next_seq)
            kept.opened(others[-1])
        kept_now = [kept.get(s) for s in others[-Readings.KEEP :]]
        assert [kept.get(s) for s in others[-Readings.KEEP :]] == kept_now
    finally:
        store.close()
