"""`cowfs restore` carried out by the daemon through the mount's own
operations: exact after swaps, renames, hard links and attribute changes
(whole-tree comparisons, and a property test over random changes),
undoable, offline too, and cheap for a small edit of a big file."""

from __future__ import annotations

import dataclasses
import os
import shutil

from hypothesis import given, settings
from hypothesis import strategies as st

from cowfs.layers import treesnap
from cowfs.system.backing import RENAME_EXCHANGE, renameat2

from .helpers import managed_workspace


def _tree(ws) -> None:
    (ws / "a").write_bytes(b"object a\n")
    (ws / "b").write_bytes(b"object b\n" * 100)
    (ws / "d").mkdir()
    (ws / "d" / "x").write_text("x in d\n")
    (ws / "d" / "sub").mkdir()
    (ws / "d" / "sub" / "y").write_text("y\n")
    os.link(ws / "d" / "x", ws / "d" / "x2")
    os.symlink("../a", ws / "d" / "ln")
    os.setxattr(ws / "a", "user.tag", b"one")
    os.chmod(ws / "b", 0o640)
    with open(ws / "sparse", "wb") as f:
        f.truncate(64 << 20)
        f.seek(32 << 20)
        f.write(b"middle")
    os.mkfifo(ws / "fifo")


def _rest(snap: treesnap.Snapshot, links: bool = True) -> treesnap.Snapshot:
    """The tree below the root (whose own mtime a restore of names in it
    changes); *links*: with the hard-link groups."""
    return treesnap.Snapshot(
        (p, e if links else dataclasses.replace(e, link=None)) for p, e in snap.items() if p != b"."
    )


def test_restore_puts_back_swapped_renamed_and_relinked_objects_exactly(mounted):
    ws = mounted
    _tree(ws)
    ws.commit()
    original = ws.snapshot()
    work = ws.checkpoint("work")
    renameat2(os.open(ws.path, os.O_PATH), b"a", os.open(ws.path, os.O_PATH), b"b", RENAME_EXCHANGE)
    os.rename(ws / "d", ws / "e")  # d moves, and a new d takes its name
    (ws / "d").mkdir()
    (ws / "d" / "x").write_text("a new x\n")
    os.unlink(ws / "e" / "x2")
    os.link(ws / "e" / "sub" / "y", ws / "e" / "x2")
    os.setxattr(ws / "b", "user.tag", b"two")  # (b holds a's object now)
    os.chmod(ws / "a", 0o600)
    with open(ws / "sparse", "r+b") as f:
        f.seek(32 << 20)
        f.write(b"MIDDLE")
        f.truncate(40 << 20)
    os.unlink(ws / "fifo")
    os.symlink("nowhere", ws / "fifo")
    (ws / "new").write_text("made after\n")
    before = ws.snapshot()
    ws.checkpoint("restore")

    done = ws.json("restore", "--from", str(work), "a", "b", "d", "e", "sparse", "fifo", "new")
    assert {"a", "b", "d", "e", "sparse", "fifo", "new"} <= set(done["restored"])
    treesnap.assert_same(_rest(original), _rest(ws.snapshot()))
    ws.rollback()  # the restore is a change of the open layer
    treesnap.assert_same(_rest(before), _rest(ws.snapshot()))


def test_restore_of_a_small_edit_of_a_big_file_takes_the_chunk_not_the_file(mounted):
    ws = mounted
    with open(ws / "big", "wb") as f:
        f.write(os.urandom(1 << 20) * 48)
    ws.commit()
    original = ws.snapshot()
    layer = ws.checkpoint()
    with open(ws / "big", "r+b") as f:
        f.seek(20 << 20)
        f.write(b"one edit")
    ws.checkpoint()
    before = ws.json("status")["usage"]["bytes"]
    ws.json("restore", "--from", str(layer), "big")
    assert _rest(ws.snapshot())[b"big"] == _rest(original)[b"big"]
    grew = ws.json("status")["usage"]["bytes"] - before
    assert grew < 4 << 20, f"restoring one chunk's edit took {grew} bytes of undo data"


def test_restore_works_on_an_unmounted_workspace(mounted):
    ws = mounted
    layer = ws.checkpoint()
    (ws / "a.txt").write_text("changed\n")
    shutil.rmtree(ws / "dir")
    ws.checkpoint()
    ws.unmount()
    res = ws.json("restore", "--from", str(layer), "a.txt", "dir")
    assert res["mounted"] is False
    assert (ws / "a.txt").read_text() == "alpha\n"
    assert (ws / "dir" / "b.txt").read_text() == "beta\n"
    ws.mount()
    assert {c["path"] for c in ws.status()} <= {"a.txt", "dir", "dir/b.txt"}
    ws.rollback()  # (the restore was captured while unmounted)
    assert (ws / "a.txt").read_text() == "changed\n"
    assert not (ws / "dir").exists()


def test_restored_files_are_seen_at_once_through_the_kernels_caches(mounted):
    ws = mounted
    ws.checkpoint()
    (ws / "a.txt").write_text("changed\n")
    os.unlink(ws / "dir" / "b.txt")
    assert not (ws / "dir" / "b.txt").exists()  # (a negative entry the kernel keeps)
    os.stat(ws / "a.txt")
    ws.cowfs("restore", "a.txt", "dir/b.txt")
    assert (ws / "a.txt").read_text() == "alpha\n"
    assert (ws / "dir" / "b.txt").read_text() == "beta\n"
    assert os.stat(ws / "a.txt").st_size == 6


NAMES = ["a", "b", "c", "d/e", "d/f"]
ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["write", "rm", "swap", "mv", "link", "chmod", "mkdir", "trunc", "xattr"]),
        st.sampled_from(NAMES),
        st.sampled_from(NAMES),
        st.binary(max_size=300),
    ),
    max_size=12,
)


def _act(root, action: str, p: str, q: str, data: bytes) -> None:
    """One change a program might make (failures are part of life)."""
    P, Q = root / p, root / q
    try:
        if action == "write":
            P.write_bytes(data)
        elif action == "rm":
            shutil.rmtree(P) if P.is_dir() and not P.is_symlink() else P.unlink()
        elif action == "swap":
            d = os.open(root, os.O_PATH)
            try:
                renameat2(d, p.encode(), d, q.encode(), RENAME_EXCHANGE)
            finally:
                os.close(d)
        elif action == "mv":
            os.rename(P, Q)
        elif action == "link":
            os.link(P, Q)
        elif action == "chmod":
            os.chmod(P, 0o600 + len(data) % 0o100)
        elif action == "mkdir":
            P.mkdir()
        elif action == "trunc":
            os.truncate(P, len(data))
        elif action == "xattr":
            os.setxattr(P, "user.x", data or b"-")
    except OSError:
        pass


@settings(max_examples=12)
@given(setup=ACTIONS, work=ACTIONS, chosen=st.lists(st.sampled_from(["a", "b", "c", "d"])))
def test_restore_of_any_paths_after_any_changes_is_exact(
    tmp_path_factory, setup, work, chosen, fuse
):
    with managed_workspace(tmp_path_factory.mktemp("prop") / "ws") as ws:
        (ws / "d").mkdir()
        for name in NAMES:
            (ws / name).write_text(f"{name}\n")
        for action in setup:
            _act(ws.path, *action)
        ws.mount()
        original = _rest(ws.snapshot(), links=False)
        layer = ws.checkpoint()
        for action in work:
            _act(ws.path, *action)
        before = _rest(ws.snapshot())
        paths = sorted(set(chosen))
        present = [
            p for p in paths if os.path.lexists(ws / p) or any(k == p.encode() for k in original)
        ]
        if not present:
            return
        ws.checkpoint()
        ws.cowfs("restore", "--from", str(layer), *present)
        now = _rest(ws.snapshot(), links=False)
        for path in set(original) | set(now):
            top = path.split(b"/")[0].decode(errors="replace")
            if top in present:
                assert now.get(path) == original.get(path), path
            else:  # outside the restore, nothing changed
                assert (path in now) == (path in before), path
        ws.rollback()
        treesnap.assert_same(before, _rest(ws.snapshot()))
