"""Forks against what could take their fork point or their mounts away:
a commit of a base layer that holds a fork's records, ``--at`` a mount
point, ``--at`` a path that is not the directory's own name."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from cowfs.errors import ALREADY_MOUNTED, REFUSED
from cowfs.layers import treesnap
from cowfs.system.mounts import is_cowfs_mount, mounts, path_key, runtime_dir

from .helpers import managed_workspace
from .test_forks import fork, fork_mounts, forks_of, parent  # noqa: F401  (the fixture)


def test_a_commit_of_the_base_keeps_a_fork_made_before_any_change(parent):  # noqa: F811
    ws = parent  # (just mounted: the base layer starts where the fork's layer does)
    at_fork = ws.snapshot()
    f = fork(ws, "a")
    (ws / "src" / "a.txt").write_text("after the fork\n")
    ws.commit()  # (the fork's layer into the base layer: kept)
    r = ws.cowfs("commit", check=False)
    assert r.returncode == REFUSED and "fork a" in r.stderr, r.stderr
    time.sleep(1.1)
    treesnap.assert_same(at_fork, treesnap.snapshot(f))
    ws.cowfs("drop", "a")
    ws.commit()


def test_fork_at_a_mount_point_is_refused_and_leaves_that_mount(parent, tmp_path):  # noqa: F811
    ws = parent
    with managed_workspace(tmp_path / "other") as other:
        other.mount()
        r = ws.cowfs("fork", "--at", str(other.path), "a", check=False)
        assert r.returncode == ALREADY_MOUNTED and "mount point" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        assert is_cowfs_mount(str(other.path))  # (not taken down on the way)
        assert other.status() == [] and forks_of(ws) == {}


def test_fork_at_a_path_through_a_link_is_bound_and_dropped_by_its_own_name(
    parent,  # noqa: F811
    tmp_path,
):
    ws = parent
    (tmp_path / "real").mkdir()
    os.symlink("real", tmp_path / "link")
    r = ws.cowfs("fork", "--at", str(tmp_path / "link"), "a")
    assert f"mounted at {tmp_path / 'real'}" in r.stdout, (r.stdout, r.stderr)
    assert forks_of(ws)["a"]["at"] == [str(tmp_path / "real")]
    assert (tmp_path / "real" / "src" / "a.txt").read_text() == "alpha\n"
    ws.cowfs("drop", "a")
    assert not any(m.mountpoint == str(tmp_path / "real") for m in mounts())
    assert not fork_mounts(ws.path) and forks_of(ws) == {}
    assert os.listdir(Path(tmp_path / "real")) == []
    assert not os.path.exists(os.path.join(runtime_dir(), "forks", path_key(str(ws.path))))


def test_an_unmount_of_the_workspace_leaves_its_forks_and_their_users_alone(parent, tmp_path):  # noqa: F811
    ws = parent
    fork(ws, "a")
    (tmp_path / "at").mkdir()
    ws.cowfs("fork", "--at", str(tmp_path / "at"), "b")
    user = subprocess.Popen(["sleep", "60"], cwd=tmp_path / "at")
    try:
        time.sleep(0.2)
        ws.unmount()
        assert any(m.mountpoint == str(tmp_path / "at") for m in mounts())
        (tmp_path / "at" / "made.txt").write_text("while the workspace is unmounted\n")
        ws.mount()
        rows = forks_of(ws)
        assert rows["a"]["mounted"] and rows["b"]["mounted"], rows
        assert rows["b"]["users"] == [user.pid]
        assert (tmp_path / "at" / "made.txt").exists()
    finally:
        user.kill()
        user.wait()
    ws.cowfs("drop", "b")
    assert not any(m.mountpoint == str(tmp_path / "at") for m in mounts())


@pytest.mark.parametrize("args", [["fork", "b"], ["drop", "a"], ["forks"]])
def test_fork_commands_refuse_the_fork_option(parent, args):  # noqa: F811
    ws = parent
    fork(ws, "a")
    r = ws.cowfs("--fork", "a", *args, check=False)
    assert r.returncode == 2 and "--fork does not apply" in r.stderr, r.stderr
    assert sorted(forks_of(ws)) == ["a"] and forks_of(ws)["a"]["mounted"]
