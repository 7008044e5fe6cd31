"""Adopt against what a fork holds or does that its workspace did
otherwise: a change of a modification time alone in the fork where the
workspace changed the path, or removed it."""

from __future__ import annotations

import os

from cowfs.layers import treesnap

from .test_forks import fork, forks_of, parent  # noqa: F401  (the fixture)


def test_a_time_alone_changed_in_the_fork_leaves_the_workspaces_own_change(parent):  # noqa: F811
    """A `touch` in the fork conflicts with nothing, and makes nothing but
    that time: the workspace's edit, chmod and removal of the same paths
    stand (none of them put back as they were at the fork point)."""
    ws = parent
    f = fork(ws, "a")
    for rel in ("src/a.txt", "big.bin", "empty", "src/link"):
        os.utime(f / rel, ns=(5 * 10**17, 5 * 10**17), follow_symlinks=False)
    (ws / "src" / "a.txt").write_text("the workspace's edit\n")  # (a.hard: the same file)
    os.unlink(ws / "big.bin")
    os.chmod(ws / "empty", 0o700)
    os.unlink(ws / "src" / "link")
    before = ws.snapshot()
    res = ws.json("adopt", "a")
    assert res["conflicts"] == [] and forks_of(ws) == {}
    after = ws.snapshot()
    assert (ws / "src" / "a.hard").read_text() == "the workspace's edit\n"
    assert after[b"src/a.txt"].link == after[b"src/a.hard"].link  # (still one object)
    assert not (ws / "big.bin").exists() and not (ws / "src" / "link").exists()
    assert after[b"empty"].mode == before[b"empty"].mode
    assert {k: v for k, v in after.items() if k not in (b"src", b"src/a.txt", b"src/a.hard")} == {
        k: v for k, v in before.items() if k not in (b"src", b"src/a.txt", b"src/a.hard")
    }
    ws.rollback(res["layer"])
    treesnap.assert_same(before, ws.snapshot())


def test_a_time_alone_changed_in_the_fork_is_made_where_the_workspace_left_the_path(parent):  # noqa: F811
    ws = parent
    f = fork(ws, "a")
    os.utime(f / "big.bin", ns=(5 * 10**17, 5 * 10**17))
    forked = treesnap.snapshot(f)
    ws.json("adopt", "a")
    assert ws.snapshot()[b"big.bin"] == forked[b"big.bin"]


def test_a_link_the_fork_made_to_a_file_it_left_as_it_was_is_a_link_after_the_adopt(parent):  # noqa: F811
    """`ln` in the fork of a file it did not change otherwise (one name, or
    two at the fork point): the adopt makes the new name that very file,
    not a copy of it."""
    ws = parent
    f = fork(ws, "a")
    os.link(f / "big.bin", f / "big.link")
    os.link(f / "src" / "a.txt", f / "a.third")  # (sorted before the names it joins)
    forked = treesnap.snapshot(f)
    before = ws.snapshot()
    res = ws.json("adopt", "a")
    after = ws.snapshot()
    assert after[b"big.link"].link == after[b"big.bin"].link
    assert after[b"a.third"].link == after[b"src/a.txt"].link == after[b"src/a.hard"].link
    for rel in (b"big.bin", b"big.link", b"a.third", b"src/a.txt", b"src/a.hard"):
        assert after[rel] == forked[rel], rel
    ws.rollback(res["layer"])
    treesnap.assert_same(before, ws.snapshot())
