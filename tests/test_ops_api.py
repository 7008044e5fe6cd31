"""The operations driven directly, without FUSE (as s3ql's t3_fs_api):
``Ops`` on a real backing directory and a real store, opened by a real
session the way the daemon opens them (``Session.open``, then ``Ops`` on
the session's directory, store and recorder, the session attached to it),
called the way an engine calls it -- lookups, creates, writes, renames,
hard links, removals, attributes, xattrs -- with checkpoints, rollbacks,
commits and redo through the session.  What is checked: the answers
(errnos, link counts, modes, bytes), the inode table, and whole trees
compared before and after (``treesnap``).  Nothing is mounted: these run
in milliseconds each, where the engine is not the question."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from cowfs.fuse.inodes import ROOT, SPARE_INO, Handle, Node
from cowfs.fuse.ops import Ctx, Ops
from cowfs.layers import treesnap
from cowfs.layers.undo import Touched
from cowfs.service.session import MountHooks, Session
from cowfs.storage import schema
from cowfs.system import backing

CTX = Ctx(os.getpid(), 0, 0, 0o022)


class Direct(MountHooks):
    """The session's hooks into operations no kernel serves: what the
    daemon's hooks (``daemon.Mounted``) do, less the kernel's caches --
    nothing to flush, and the entries an undo would have the kernel forget
    are kept for the tests to look at."""

    def __init__(self, ops: Ops):
        self.ops = ops
        self.invalidated: list[tuple[list[tuple[int, bytes]], list[int]]] = []

    async def blocking(self, fn: Callable, *args: Any) -> Any:
        return fn(*args)  # (no requests to serve meanwhile)

    async def wait(self, fn: Callable, *args: Any) -> Any:
        return fn(*args)

    def layer_switched(self) -> None:
        self.ops.layer_switched()

    async def after_undo(self, touched: Touched) -> None:
        self.invalidated.append(self.ops.after_undo(touched))
        self.ops.layer_switched(after_undo=True)

    def after_commit(self, freed: list) -> None:
        self.ops.after_commit(freed)

    def removed(self, inos: list) -> None:
        self.ops.let_go(inos)

    def operations(self) -> Ops:
        return self.ops


class Served:
    """A workspace served by ``Ops`` with no mount: the operations as
    ``ops``, the session as ``session``, the backing directory as ``path``;
    helpers that walk paths and open, write and read files the way an
    engine's requests would."""

    def __init__(self, path: Path):
        self.path = path
        self.session = Session(str(path))
        self.session.open()
        s = self.session
        self.ops = Ops(s.rootfd, s.store, s.recorder, hidden=s.hidden)
        self.hooks = Direct(self.ops)
        s.attach(self.hooks)
        self.ops.on_full = s.give_back_room

    def close(self) -> None:
        ops = self.ops
        for fh, h in list(ops.handles.items()):
            if isinstance(h, Handle):
                ops.release(fh)
            else:
                ops.releasedir(fh)
        for node in list(ops.table.nodes.values()):
            if node is not ops.root:
                ops.fds.close(node)
        self.session.close()

    # -- paths and files, as requests would have them ---------------------------------

    def node(self, path: str) -> Node:
        """Look *path* up name by name (the kernel takes a reference to each)."""
        node = self.ops.root
        for name in filter(None, path.split("/")):
            node, _ = self.ops.lookup(node.ino, name.encode(), ctx=CTX)
        return node

    def parent(self, path: str) -> tuple[int, bytes]:
        head, _, name = path.rpartition("/")
        return self.node(head).ino, name.encode()

    def create(self, path: str, data: bytes = b"", mode: int = 0o644) -> Node:
        parent, name = self.parent(path)
        fh, _, node, _ = self.ops.create(parent, name, mode, os.O_WRONLY | os.O_CREAT, ctx=CTX)
        if data:
            assert self.ops.write(fh, 0, data) == len(data)
        self.ops.release(fh)
        return node

    def write(self, path: str, data: bytes, off: int = 0) -> None:
        fh, _ = self.ops.open(self.node(path).ino, os.O_WRONLY, ctx=CTX)
        try:
            assert self.ops.write(fh, off, data) == len(data)
        finally:
            self.ops.release(fh)

    def read(self, path: str) -> bytes:
        fh, _ = self.ops.open(self.node(path).ino, os.O_RDONLY, ctx=CTX)
        try:
            return self.ops.read(fh, 0, 1 << 20)
        finally:
            self.ops.release(fh)

    def mkdir(self, path: str, mode: int = 0o755) -> Node:
        parent, name = self.parent(path)
        return self.ops.mkdir(parent, name, mode, ctx=CTX)[0]

    def unlink(self, path: str) -> None:
        self.ops.unlink(*self.parent(path), ctx=CTX)

    def rmdir(self, path: str) -> None:
        self.ops.rmdir(*self.parent(path), ctx=CTX)

    def rename(self, old: str, new: str, flags: int = 0) -> None:
        self.ops.rename(*self.parent(old), *self.parent(new), flags, ctx=CTX)

    def link(self, old: str, new: str) -> Node:
        return self.ops.link(self.node(old).ino, *self.parent(new), ctx=CTX)[0]

    def nlink(self, path: str) -> int:
        node, st = self.ops.getattr(self.node(path).ino)
        return self.ops.nlink(node, st)

    def snapshot(self) -> treesnap.Snapshot:
        """The tree as the view shows it: the backing directory's, but for
        the names kept in the grave (for a redo, or an open file), which
        count in the backing files' link counts, not in the view's
        (``Ops.nlink``): a file whose other names are all there is no hard
        link."""
        snap = treesnap.snapshot(self.path)
        names = collections.Counter(e.link for e in snap.values() if e.link is not None)
        for rel, e in snap.items():
            if e.link is not None and names[e.link] == 1:
                snap[rel] = dataclasses.replace(e, link=None)
        return snap

    # -- the layer lifecycle, through the session -------------------------------------

    def checkpoint(self) -> int:
        return trio.run(self.session.checkpoint)["id"]

    def rollback(self, to: int | None = None) -> dict:
        return trio.run(lambda: self.session.rollback(to, yes=True))

    def commit(self) -> dict:
        return trio.run(self.session.commit)

    def redo(self) -> dict:
        return trio.run(self.session.redo)


@contextlib.contextmanager
def served(path: Path) -> Iterator[Served]:
    """*path* (made if need be) served by ``Ops``, under umask 0 as the
    daemon runs (the modes asked for are the modes made)."""
    path.mkdir(exist_ok=True)
    old = os.umask(0)
    ws = Served(path)
    try:
        yield ws
    finally:
        try:
            ws.close()
        finally:
            os.umask(old)


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Served]:
    """A workspace holding a.txt and dir/b.txt, served by ``Ops``."""
    root = tmp_path / "ws"
    root.mkdir()
    (root / "a.txt").write_bytes(b"alpha\n")
    (root / "dir").mkdir()
    (root / "dir" / "b.txt").write_bytes(b"beta\n")
    with served(root) as ws:
        yield ws


def errno_of(fn: Callable[..., Any], *args: Any, **kw: Any) -> int | None:
    try:
        fn(*args, **kw)
    except OSError as e:
        return e.errno
    return None


def assert_same_tree(before: treesnap.Snapshot, ws: Served) -> None:
    assert treesnap.compare(before, ws.snapshot()) == []


# -- lookups, the store, the inode table ------------------------------------------------


def test_lookup_answers_the_backing_objects_own_inode_numbers_and_hides_the_store(ws):
    node = ws.node("dir/b.txt")
    assert node.ino == node.bino == os.stat(ws.path / "dir" / "b.txt").st_ino
    assert set(ws.ops.names(ROOT)) == {b"a.txt", b"dir"}
    assert errno_of(ws.ops.lookup, ROOT, b".cowfs", ctx=CTX) == errno.ENOENT
    assert errno_of(ws.ops.lookup, ROOT, b"missing", ctx=CTX) == errno.ENOENT
    assert errno_of(ws.create, ".cowfs") == errno.EPERM
    assert errno_of(ws.ops.getattr, 12345678) == errno.ESTALE


def test_forget_drops_a_node_and_a_new_lookup_gives_the_same_number(ws):
    node = ws.node("a.txt")
    ws.node("a.txt")
    assert node.nlookup == 2
    ws.ops.forget([(node.ino, 1)])
    assert node.live and ws.ops.table.nodes[node.ino] is node
    ws.ops.forget([(node.ino, 1)])
    assert not node.live and node.ino not in ws.ops.table.nodes
    assert errno_of(ws.ops.getattr, node.ino) == errno.ESTALE
    again = ws.node("a.txt")
    assert again is not node and again.ino == node.ino


def test_a_node_whose_object_is_gone_keeps_its_number_and_a_new_object_gets_a_spare_one(ws):
    table = ws.ops.table
    old = ws.node("a.txt")
    table.orphan(old.bino)  # (as if the object were gone, its number free again)
    assert table.by_bino(old.bino) is None and old.parent is None
    new = ws.node("a.txt")
    assert new is not old and new.bino == old.bino
    assert new.ino == SPARE_INO and table.by_bino(old.bino) is new
    assert ws.ops.getattr(old.ino)[0] is old  # (the kernel still holds the old one)
    ws.ops.forget([(old.ino, old.nlookup)])
    assert table.by_bino(new.bino) is new and table.node(SPARE_INO) is new


def test_readdir_hands_out_entries_from_a_position_and_counts_what_was_taken(ws):
    fh = ws.ops.opendir(ROOT, ctx=CTX)
    taken: list[tuple[bytes, int]] = []

    def three(name: bytes, node: Node, st: os.stat_result, nxt: int) -> bool:
        if len(taken) == 3:
            return False  # (no room left in the reply)
        taken.append((name, nxt))
        return True

    ws.ops.readdir(fh, 0, three)
    rest: list[bytes] = []
    ws.ops.readdir(fh, taken[-1][1], lambda name, node, st, nxt: rest.append(name) or True)
    ws.ops.releasedir(fh)
    names = [n for n, _ in taken] + rest
    assert names[:2] == [b".", b".."] and sorted(names[2:]) == [b"a.txt", b"dir"]
    for name in (b"a.txt", b"dir"):  # (each taken once: the kernel holds one reference)
        assert ws.ops.table.by_bino(os.stat(ws.path / os.fsdecode(name)).st_ino).nlookup == 1


# -- creating, writing, removing --------------------------------------------------------


def test_create_write_read_and_the_errnos_of_names_that_exist_or_do_not(ws):
    node = ws.create("new.txt", b"hello", mode=0o640)
    node_, st_ = ws.ops.getattr(node.ino)
    assert (st_.st_size, stat.S_IMODE(st_.st_mode)) == (5, 0o640)
    assert ws.read("new.txt") == b"hello"
    assert (ws.path / "new.txt").read_bytes() == b"hello"
    assert errno_of(ws.ops.create, ROOT, b"new.txt", 0o644, os.O_CREAT | os.O_EXCL, ctx=CTX) == (
        errno.EEXIST
    )
    assert errno_of(ws.mkdir, "dir") == errno.EEXIST
    assert errno_of(ws.unlink, "nothing") == errno.ENOENT
    assert errno_of(ws.unlink, "dir") == errno.EISDIR
    assert errno_of(ws.rmdir, "a.txt") == errno.ENOTDIR
    assert errno_of(ws.rmdir, "dir") == errno.ENOTEMPTY
    assert errno_of(ws.ops.write, 999, 0, b"x") is not None  # (no such handle)


def test_mkdir_mode_follows_the_callers_umask_and_rmdir_takes_it_away(ws):
    node = ws.mkdir("sub", 0o777)
    assert stat.S_IMODE(ws.ops.getattr(node.ino)[1].st_mode) == 0o755
    assert ws.nlink("") == 4  # (., a, dir, sub's ..: the store is not counted)
    ws.rmdir("sub")
    assert not (ws.path / "sub").exists()
    assert ws.nlink("") == 3


def test_an_open_file_unlinked_is_still_read_and_written_and_rollback_brings_it_back(ws):
    before = ws.snapshot()
    ws.checkpoint()
    fh, _ = ws.ops.open(ws.node("a.txt").ino, os.O_RDWR, ctx=CTX)
    ws.unlink("a.txt")
    assert not (ws.path / "a.txt").exists()
    ws.ops.write(fh, 0, b"ALPHA")
    assert ws.ops.read(fh, 0, 100) == b"ALPHA\n"
    ws.ops.release(fh)
    ws.rollback()
    assert_same_tree(before, ws)
    assert ws.read("a.txt") == b"alpha\n"


# -- hard links ------------------------------------------------------------------------


def test_hard_links_are_one_node_with_its_names_and_link_counts(ws):
    a = ws.node("a.txt")
    b = ws.link("a.txt", "dir/hard")
    assert b is a
    assert ws.nlink("a.txt") == ws.nlink("dir/hard") == 2
    assert sorted(n for _, n in ws.ops.table.names(a)) == [b"a.txt", b"hard"]
    ws.unlink("a.txt")  # (kept in the grave: the view does not count it)
    assert ws.nlink("dir/hard") == 1
    assert ws.ops.table.loc(a) == b"dir/hard"
    assert errno_of(ws.link, "dir/hard", "dir/b.txt") == errno.EEXIST


def test_hard_links_made_and_removed_roll_back_to_the_same_tree(ws):
    os.link(ws.path / "a.txt", ws.path / "dir" / "old-link")
    before = ws.snapshot()
    ws.checkpoint()
    ws.link("a.txt", "c.txt")
    ws.unlink("dir/old-link")
    ws.write("c.txt", b"changed through the new name\n")
    assert ws.read("a.txt") == b"changed through the new name\n"
    ws.rollback()
    assert_same_tree(before, ws)
    assert os.stat(ws.path / "a.txt").st_ino == os.stat(ws.path / "dir" / "old-link").st_ino


def test_a_rename_between_two_names_of_one_file_changes_nothing(ws):
    ws.link("a.txt", "b.txt")
    before = ws.snapshot()
    ws.rename("a.txt", "b.txt")
    assert_same_tree(before, ws)


# -- renames ---------------------------------------------------------------------------


def test_rename_over_an_existing_file_replaces_it_and_rollback_puts_both_back(ws):
    before = ws.snapshot()
    ws.checkpoint()
    replaced = ws.node("dir/b.txt")
    ws.rename("a.txt", "dir/b.txt")
    assert ws.read("dir/b.txt") == b"alpha\n" and not (ws.path / "a.txt").exists()
    assert ws.ops.table.by_bino(replaced.bino) is replaced  # (kept in the grave)
    assert schema.grave_id(ws.ops.table.path(replaced)) is not None
    ws.rollback()
    assert_same_tree(before, ws)


def test_rename_refusals_come_before_anything_changes(ws):
    ws.mkdir("full")
    ws.create("full/x")
    ws.mkdir("empty")
    before = ws.snapshot()
    assert errno_of(ws.rename, "dir", "full") == errno.ENOTEMPTY
    assert errno_of(ws.rename, "dir", "a.txt") == errno.ENOTDIR
    assert errno_of(ws.rename, "a.txt", "empty") == errno.EISDIR
    assert errno_of(ws.rename, "a.txt", "dir/b.txt", backing.RENAME_NOREPLACE) == errno.EEXIST
    assert errno_of(ws.rename, "a.txt", "none", backing.RENAME_EXCHANGE) == errno.ENOENT
    assert errno_of(ws.rename, "missing", "x") == errno.ENOENT
    assert_same_tree(before, ws)


def test_rename_of_a_directory_over_an_empty_one_and_an_exchange_roll_back(ws):
    ws.mkdir("empty")
    before = ws.snapshot()
    ws.checkpoint()
    moved = ws.node("dir")
    ws.rename("dir", "empty")
    assert ws.ops.table.path(moved) == b"empty"
    assert ws.read("empty/b.txt") == b"beta\n"
    ws.create("other", b"other\n")
    ws.rename("other", "empty/b.txt", backing.RENAME_EXCHANGE)
    assert ws.read("other") == b"beta\n" and ws.read("empty/b.txt") == b"other\n"
    ws.rollback()
    assert_same_tree(before, ws)


# -- attributes and xattrs ---------------------------------------------------------------


def test_setattr_mode_times_and_truncation_roll_back_exactly(ws):
    (ws.path / "big").write_bytes(os.urandom(300_000))
    before = ws.snapshot()
    ws.checkpoint()
    node = ws.node("big")
    _, st_ = ws.ops.setattr(node.ino, None, mode=0o600, ctx=CTX)
    assert stat.S_IMODE(st_.st_mode) == 0o600 and node.mode == st_.st_mode
    _, st_ = ws.ops.setattr(node.ino, None, atime_ns=10**18, mtime_ns=2 * 10**18, ctx=CTX)
    assert st_.st_mtime_ns == 2 * 10**18
    _, st_ = ws.ops.setattr(node.ino, None, size=1000, ctx=CTX)
    assert st_.st_size == 1000
    ws.write("big", b"x" * 5000, off=200_000)
    dnode = ws.node("dir")
    ws.ops.setattr(dnode.ino, None, mode=0o700, ctx=CTX)
    ws.rollback()
    assert_same_tree(before, ws)


def test_setattr_size_of_a_directory_is_einval(ws):
    assert errno_of(ws.ops.setattr, ws.node("dir").ino, None, size=0, ctx=CTX) == errno.EINVAL


def test_xattrs_set_listed_removed_with_their_errnos_and_rolled_back(ws):
    node = ws.node("a.txt")
    ws.ops.setxattr(node.ino, b"user.kept", b"1", ctx=CTX)
    before = ws.snapshot()
    ws.checkpoint()
    assert ws.ops.getxattr(node.ino, b"user.kept", ctx=CTX) == b"1"
    code = errno_of(ws.ops.setxattr, node.ino, b"user.kept", b"2", ctx=CTX, flags=os.XATTR_CREATE)
    assert code == errno.EEXIST
    code = errno_of(ws.ops.setxattr, node.ino, b"user.no", b"2", ctx=CTX, flags=os.XATTR_REPLACE)
    assert code == errno.ENODATA
    ws.ops.setxattr(node.ino, b"user.new", b"2", ctx=CTX)
    ws.ops.setxattr(node.ino, b"user.kept", b"changed", ctx=CTX)
    assert sorted(ws.ops.listxattr(node.ino, ctx=CTX)) == [b"user.kept", b"user.new"]
    ws.ops.removexattr(node.ino, b"user.new", ctx=CTX)
    assert errno_of(ws.ops.removexattr, node.ino, b"user.new", ctx=CTX) == errno.ENODATA
    assert errno_of(ws.ops.getxattr, node.ino, b"user.new", ctx=CTX) == errno.ENODATA
    ws.rollback()
    assert_same_tree(before, ws)
    assert ws.ops.listxattr(node.ino, ctx=CTX) == [b"user.kept"]  # (not a stale "none")


def test_symlinks_are_made_read_linked_and_rolled_back(ws):
    before = ws.snapshot()
    ws.checkpoint()
    parent, name = ws.parent("dir/ln")
    node, st_ = ws.ops.symlink(parent, name, b"../a.txt", ctx=CTX)
    assert stat.S_ISLNK(st_.st_mode) and ws.ops.readlink(node.ino, ctx=CTX) == b"../a.txt"
    assert ws.link("dir/ln", "dir/ln2") is node
    assert os.readlink(ws.path / "dir" / "ln2") == "../a.txt"
    ws.rollback()
    assert_same_tree(before, ws)


# -- the layer lifecycle ---------------------------------------------------------------


def test_a_checkpoints_changes_roll_back_exactly_and_redo_makes_them_again(ws):
    ws.checkpoint()
    before = ws.snapshot()
    layer = ws.checkpoint()
    ws.write("a.txt", b"ALPHA, longer than before\n")
    ws.mkdir("new")
    ws.create("new/f", b"f\n")
    ws.rename("dir/b.txt", "new/b.txt")
    ws.unlink("a.txt")
    after = ws.snapshot()
    result = ws.rollback()
    assert layer in result["dropped"]
    assert_same_tree(before, ws)
    assert ws.hooks.invalidated  # (the entries the kernel would forget)
    ws.redo()
    assert treesnap.compare(after, ws.snapshot()) == []
    assert ws.read("new/b.txt") == b"beta\n"


def test_rollback_to_an_earlier_layer_undoes_the_layers_above_it(ws):
    first = ws.checkpoint()
    before = ws.snapshot()
    ws.create("one", b"1")
    ws.checkpoint()
    ws.write("one", b"22")
    ws.rename("dir", "dir2")
    ws.checkpoint()
    ws.unlink("dir2/b.txt")
    ws.rollback(to=first)
    assert_same_tree(before, ws)


def test_a_commit_merges_the_top_layer_and_its_rollback_undoes_both(ws):
    ws.checkpoint()
    before = ws.snapshot()
    ws.checkpoint()
    ws.write("a.txt", b"first\n")
    ws.link("dir/b.txt", "b-link")
    ws.checkpoint()
    ws.write("a.txt", b"second, longer\n")
    ws.unlink("dir/b.txt")
    ws.commit()
    ws.rollback()
    assert_same_tree(before, ws)


def test_the_inode_table_follows_an_undo_names_and_modes(ws):
    ws.checkpoint()
    node = ws.node("dir/b.txt")
    d = ws.node("dir")
    ws.rename("dir/b.txt", "moved.txt")
    ws.ops.setattr(d.ino, None, mode=0o700, ctx=CTX)
    assert ws.ops.table.path(node) == b"moved.txt"
    ws.rollback()
    assert ws.ops.table.path(node) == b"dir/b.txt"
    assert stat.S_IMODE(d.mode) == 0o755
    assert ws.node("dir/b.txt") is node


def test_files_made_in_the_open_layer_are_not_captured_and_roll_back_to_nothing(ws):
    before = ws.snapshot()
    ws.checkpoint()
    node = ws.create("fresh", b"x" * 100_000)
    assert ws.ops.recorder.obj(node.bino).created
    ws.write("fresh", b"y" * 10, off=50)
    ws.unlink("fresh")
    ws.rollback()
    assert_same_tree(before, ws)


def test_a_base_commit_frees_removed_files_and_the_table_forgets_them(ws):
    gone = ws.node("a.txt")
    held = ws.node("dir/b.txt")
    fh, _ = ws.ops.open(held.ino, os.O_RDONLY, ctx=CTX)
    ws.unlink("a.txt")
    ws.unlink("dir/b.txt")
    assert schema.grave_id(ws.ops.table.path(gone)) is not None  # (kept for a rollback)
    ws.commit()  # (of the base layer: its changes are for good, the grave's names go)
    for node in (gone, held):
        assert ws.ops.table.by_bino(node.bino) is None and node.parent is None
        assert ws.ops.getattr(node.ino)[0] is node  # (the kernel still holds it)
    assert ws.ops.read(fh, 0, 100) == b"beta\n"  # (open: still read, by its fd)
    ws.ops.release(fh)
    assert sorted(os.listdir(ws.path)) == [".cowfs", "dir"] and not os.listdir(ws.path / "dir")


# -- a property: any sequence of changes rolls back exactly -----------------------------

NAMES = st.sampled_from(["a.txt", "dir/b.txt", "dir/c", "d", "d/e", "f"])
CHANGES = st.lists(
    st.one_of(
        st.tuples(st.just("write"), NAMES, st.binary(max_size=300), st.integers(0, 200_000)),
        st.tuples(st.just("create"), NAMES, st.binary(max_size=50)),
        st.tuples(st.just("unlink"), NAMES),
        st.tuples(st.just("mkdir"), NAMES),
        st.tuples(st.just("rmdir"), NAMES),
        st.tuples(st.just("rename"), NAMES, NAMES),
        st.tuples(st.just("link"), NAMES, NAMES),
        st.tuples(st.just("truncate"), NAMES, st.integers(0, 70_000)),
        st.tuples(st.just("chmod"), NAMES, st.sampled_from([0o600, 0o755, 0o4755])),
        st.tuples(st.just("setxattr"), NAMES, st.binary(min_size=1, max_size=20)),
        st.tuples(st.just("checkpoint")),
    ),
    max_size=25,
)


def apply(ws: Served, change: tuple) -> None:
    """One change, as a program would ask it; refusals (errnos) are part
    of the game."""
    kind, *args = change
    with contextlib.suppress(OSError):
        if kind == "write":
            ws.write(args[0], args[1], off=args[2])
        elif kind == "create":
            ws.create(args[0], args[1])
        elif kind == "unlink":
            ws.unlink(args[0])
        elif kind == "mkdir":
            ws.mkdir(args[0])
        elif kind == "rmdir":
            ws.rmdir(args[0])
        elif kind == "rename":
            ws.rename(args[0], args[1])
        elif kind == "link":
            ws.link(args[0], args[1])
        elif kind == "truncate":
            ws.ops.setattr(ws.node(args[0]).ino, None, size=args[1], ctx=CTX)
        elif kind == "chmod":
            ws.ops.setattr(ws.node(args[0]).ino, None, mode=args[1], ctx=CTX)
        elif kind == "setxattr":
            ws.ops.setxattr(ws.node(args[0]).ino, b"user.x", args[1], ctx=CTX)
        elif kind == "checkpoint":
            ws.checkpoint()


@settings(max_examples=30, deadline=None)
@given(CHANGES)
def test_any_changes_after_a_checkpoint_roll_back_to_the_same_tree(changes):
    with tempfile.TemporaryDirectory(prefix="cowfs-ops-") as d:
        root = Path(d) / "ws"
        root.mkdir()
        (root / "a.txt").write_bytes(bytes(range(256)) * 400)
        (root / "dir").mkdir()
        (root / "dir" / "b.txt").write_bytes(b"beta\n")
        with served(root) as ws:
            first = ws.checkpoint()
            before = ws.snapshot()
            for change in changes:
                apply(ws, change)
            ws.rollback(to=first)
            assert_same_tree(before, ws)
