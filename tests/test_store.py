"""The layer store, capture and undo without FUSE: a real LMDB store on a
real directory, changed the way the mount daemon changes it."""

from __future__ import annotations

import os

import pytest

from cowfs.errors import StoreError
from cowfs.layers import treesnap
from cowfs.layers.capture import Recorder
from cowfs.layers.layerfiles import Acting
from cowfs.service.session import Session, offline
from cowfs.storage import schema as S
from cowfs.storage.store import Store, digest
from cowfs.system import backing as B

C = 64 << 10


class Harness:
    """Capture-then-change on a plain directory, as the daemon does it."""

    def __init__(self, root):
        self.root = root
        Store.open(str(root / ".cowfs"), str(root)).close()
        # (a session on the store as it is: nothing resumed or checked)
        self.session = Session(str(root), store=str(root / ".cowfs"))
        self.session.inspect(readonly=False)
        self.store = self.session.store
        self.rootfd = self.session.rootfd
        self.view = self.session.stackview
        self.files = self.session.files
        self.files.ensure_base()
        self.rec = Recorder(self.store)
        self.rec.reset(fresh=False)

    def close(self):
        if self.session is not None:
            self.session.close()
            self.session = None

    def pwrite(self, name: str, data: bytes, off: int) -> None:
        path = self.root / name
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            self.rec.obj(st.st_ino)
            with self.rec.txn() as w:
                self.rec.data(w, st.st_ino, lambda: name.encode(), fd, st, off, off + len(data))
            os.pwrite(fd, data, off)
        finally:
            os.close(fd)

    def dir_meta(self, w) -> None:
        st = os.stat(self.root)
        self.rec.meta(w, st.st_ino, lambda: b"", st)

    def unlink(self, name: str) -> None:
        st = os.lstat(self.root / name)
        self.rec.obj(os.stat(self.root).st_ino)
        with self.rec.txn() as w:
            self.dir_meta(w)
            gid = self.rec.grave(w, name.encode(), st, os.stat(self.root).st_ino)
        B.renameat2(self.rootfd, name.encode(), self.store.grave_fd, str(gid).encode())

    def checkpoint(self) -> int:
        self.rec.flush()
        layer = self.files.checkpoint()
        self.rec.reset(fresh=True)
        return layer.id

    def snapshot(self):
        return treesnap.snapshot(self.root)

    def chunk_count(self) -> int:
        with self.store.read() as txn:
            return txn.stat(self.store.db_chunks)["entries"]


@pytest.fixture
def h(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    harness = Harness(root)
    yield harness
    harness.close()


def test_chunks_are_content_addressed_and_reference_counted(h):
    block = os.urandom(C)
    (h.root / "a").write_bytes(block * 2)
    (h.root / "b").write_bytes(block)
    h.pwrite("a", b"x", 0)
    h.pwrite("a", b"y", C)
    h.pwrite("b", b"z", 0)
    assert h.chunk_count() == 1
    with h.store.read() as txn:
        assert S.from_u64(txn.get(digest(block), db=h.store.db_refs)) == 3
    h.files.commit()
    assert h.chunk_count() == 0


def test_later_changes_of_a_captured_chunk_record_nothing(h):
    (h.root / "f").write_bytes(os.urandom(3 * C))
    h.pwrite("f", b"1", 10)
    n = len(h.store.layer_records(h.store.top().id))
    h.pwrite("f", b"2", 20)
    h.pwrite("f", b"3", C - 1)
    assert len(h.store.layer_records(h.store.top().id)) == n
    h.pwrite("f", b"4", C)
    assert len(h.store.layer_records(h.store.top().id)) == n + 1


def test_merge_keeps_the_lower_entry_and_drops_redundant_ones(h):
    data = os.urandom(2 * C)
    (h.root / "f").write_bytes(data)
    before = h.snapshot()
    h.checkpoint()
    h.pwrite("f", b"one", 0)
    lower = len(h.store.layer_records(h.store.top().id))
    h.checkpoint()
    h.pwrite("f", b"two", 1)  # same chunk: redundant after the merge
    h.pwrite("f", b"two", C)  # a chunk only the upper layer has
    h.files.commit()
    h.rec.reset(fresh=False)
    merged = h.store.layer_records(h.store.top().id)
    assert len(merged) == lower + 1
    chunks = [r for _, r in merged if isinstance(r, S.Chunk)]
    assert sorted(r.chunk for r in chunks) == [0, 1]
    assert h.chunk_count() == 2
    h.close()  # (rolled back as an offline command does it)
    offline(str(h.root), str(h.root / ".cowfs"), "rollback")
    treesnap.assert_same(before, h.snapshot())


def test_an_object_made_at_a_captured_path_is_pinned_by_its_created_entry(h):
    """A create at a captured path pins the object with the value of its
    ``N`` entry (no ``P`` entry of its own); an ``N`` of value 0 (made at an
    ignored path) does not; a ``P`` entry, as older stores wrote it beside
    the ``N``, still does.  A commit that meets the object's ``N`` of value
    0 below keeps the pin (the inode number was freed and given to a file
    made at a captured path above)."""
    made_ignored, made_named, old_style = 1 << 40, (1 << 40) + 1, (1 << 40) + 2
    lower = h.checkpoint()
    with h.store.write() as w:
        w.index_put(lower, made_ignored, S.IDX_CREATED, 0)
        w.index_put(lower, made_named, S.IDX_CREATED, 0)
        w.index_put(lower, old_style, S.IDX_CREATED, 0)
        w.index_put(lower, old_style, S.IDX_PINNED, 0)
    upper = h.checkpoint()
    with h.store.write() as w:
        w.index_put(upper, made_named, S.IDX_CREATED, S.CREATED_NAMED)
    rec = Recorder(h.store)
    assert rec.obj(made_named).pinned and rec.obj(made_named).created
    assert not rec.obj(made_ignored).pinned
    assert [rec.known_below(i) for i in (made_ignored, made_named, old_style)] == [
        False,
        False,
        True,
    ]
    h.files.commit()
    assert h.store.top().id == lower
    with h.store.read() as txn:
        key = S.index_key(lower, made_named, S.IDX_CREATED)
        assert S.index_seq(key, txn.get(key, db=h.store.db_index)) == S.CREATED_NAMED
    rec = Recorder(h.store)
    assert [rec.obj(i).pinned for i in (made_ignored, made_named, old_style)] == [
        False,
        True,
        True,
    ]
    h.checkpoint()
    rec = Recorder(h.store)
    assert [rec.known_below(i) for i in (made_ignored, made_named, old_style)] == [
        False,
        True,
        True,
    ]


def test_commit_of_the_base_frees_chunks_and_graves(h):
    (h.root / "f").write_bytes(os.urandom(C))
    (h.root / "g").write_bytes(b"gone")
    h.pwrite("f", b"!", 0)
    h.unlink("g")
    assert h.chunk_count() == 1 and os.listdir(h.store.path + "/grave")
    h.files.commit()
    assert h.chunk_count() == 0
    assert os.listdir(h.store.path + "/grave") == []
    assert not (h.root / "g").exists()


def test_an_interrupted_rollback_resumes_and_is_not_applied_twice(h):
    (h.root / "f").write_bytes(os.urandom(4 * C))
    (h.root / "g").write_text("g")
    before = h.snapshot()
    h.checkpoint()
    for i in range(4):
        h.pwrite("f", b"changed", i * C + 5)
    h.unlink("g")
    layer = h.store.top()
    with h.rec.txn() as w:
        h.rec.create(w, b"g", os.stat(h.root).st_ino)
    (h.root / "g").write_text("a new g")  # a replacement, as after unlink + create
    # Interrupt the rollback after two undo steps, the second one applied
    # but its record not yet deleted (as a crash would).
    h.store.set_meta_json(S.K_PENDING, {"op": "rollback", "to": layer.id})
    from cowfs.layers.undo import Undoer

    undo = Undoer(h.store, h.files.resolver)
    (seq1, rec1), (seq2, rec2) = list(h.store.records(layer.start, h.store.next_seq, reverse=True))[
        :2
    ]
    undo.apply(rec1)
    with h.store.write() as w:
        w.delete_record(seq1)
    undo.apply(rec2)
    assert (h.root / "g").read_text() == "g"
    report = h.session.resume_files()
    assert report is not None and not report.failures
    treesnap.assert_same(before, h.snapshot())
    assert h.store.get_meta_json(S.K_PENDING) is None


def test_a_failed_capture_is_not_believed_captured(h):
    (h.root / "f").write_bytes(os.urandom(2 * C))
    st = os.stat(h.root / "f")
    o = h.rec.obj(st.st_ino)
    fd = os.open(h.root / "f", os.O_RDONLY)
    try:
        with pytest.raises(RuntimeError):
            with h.rec.txn() as w:
                h.rec.data(w, st.st_ino, lambda: b"f", fd, st, 0, 10)
                raise RuntimeError("store write failed")
    finally:
        os.close(fd)
    assert not o.meta and not o.chunks
    assert not h.rec.write_is_captured(st.st_ino, 0, 10)
    assert h.store.layer_records(h.store.top().id) == []


def test_records_round_trip():
    rec = S.encode_record(S.Chunk(b"a/\xffb", 7, 3, 65536, b"\x00" * 16))
    assert S.decode_record(rec) == S.Chunk(b"a/\xffb", 7, 3, 65536, b"\x00" * 16)
    pairs = [(b"user.a", b"\x00\x01"), (b"user.b", b"")]
    assert S.decode_xattrs(S.encode_xattrs(pairs)) == pairs
    assert S.grave_id(S.grave_loc(42)) == 42 and S.grave_id(b"x/y") is None
    key = S.index_key(3, 99, S.IDX_CHUNK, 5)
    assert S.split_index_key(key) == (3, 99, S.IDX_CHUNK, 5)


@pytest.mark.parametrize("changed_since", [False, True])
def test_the_records_the_audit_of_a_rollback_read_serve_its_steps(h, changed_since):
    """The audit of a planned rollback (`StackView.undone`) reads the layer's
    records afresh when nothing is kept (as after a mount) and hands them
    to the rollback's steps -- unless the journal changed since, when the
    steps read it again.  Either way the tree is back exactly."""
    (h.root / "f").write_bytes(os.urandom(2 * C))
    (h.root / "g").write_bytes(b"g")
    before = h.snapshot()
    layer = h.checkpoint()
    h.pwrite("f", b"1", 0)
    h.unlink("g")
    h.rec.flush()
    h.view.readings.clear()
    h.session.plan_rollback(layer)
    assert sorted(c["path"] for c in h.view.undone(layer)) == ["f", "g"]
    start = h.store.get_layer(layer).start
    assert h.view._ahead is not None
    assert h.view._ahead.records == list(h.store.records(start, h.store.next_seq))
    if changed_since:
        h.pwrite("f", b"2", C)  # (another chunk: one more record)
    h.files.apply(h.session.planned(), Acting())
    h.session.finish_pending()
    treesnap.assert_same(before, h.snapshot())
    assert h.view._ahead is None


def test_a_format_1_store_is_read_as_it_is_and_upgraded_when_written(tmp_path):
    """Format 2 only adds a way to write integers past 2**63 - 1: a format 1
    store opens, stays format 1 while only read, and becomes format 2 at
    its first writable open; a store of a format this cowfs does not know
    is refused, saying so, and left as it is."""
    root = tmp_path / "ws"
    root.mkdir()
    store = str(root / ".cowfs")

    def set_format(n: int) -> None:
        s = Store.open(store, str(root))
        with s.env.begin(write=True, db=s.db_meta) as txn:
            txn.put(S.K_FORMAT, S.seal(S.DB_META, S.K_FORMAT, S.u64(n)))
        s.close()

    def get_format() -> int:
        s = Store.open(store, str(root), readonly=True, locked=False)
        try:
            with s.env.begin(db=s.db_meta) as txn:
                return S.meta_int(S.K_FORMAT, txn.get(S.K_FORMAT))
        finally:
            s.close()

    Store.open(store, str(root)).close()
    assert get_format() == S.FORMAT == 2
    set_format(1)
    assert get_format() == 1  # (a read-only open writes nothing)
    Store.open(store, str(root), create=False).close()
    assert get_format() == 2
    set_format(3)
    with pytest.raises(StoreError, match="has format 3, this cowfs reads formats 1, 2"):
        Store.open(store, str(root), create=False)
    with pytest.raises(StoreError, match="has format 3"):
        Store.open(store, str(root), readonly=True, locked=False)
