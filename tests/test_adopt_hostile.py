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
