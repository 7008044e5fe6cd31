"""Control commands on a workspace that is not mounted: status, log,
rollback and commit operate on the store directly (given -C WORKSPACE), so
recovery never depends on FUSE, not even after the daemon was killed."""

from __future__ import annotations

import json
import os
import subprocess

from cowfs.errors import NO_STORE, NOT_MOUNTED, NOTHING_TO_DO, UNKNOWN_LAYER
from cowfs.layers import treesnap
from cowfs.system.mounts import is_cowfs_mount

from .helpers import managed_workspace, run


def test_status_log_rollback_commit_without_a_mount(mounted):
    ws = mounted
    before = ws.snapshot()
    layer = ws.checkpoint("offline work")
    (ws / "a.txt").write_text("changed\n")
    (ws / "new").write_text("new\n")
    os.unlink(ws / "dir" / "b.txt")
    ws.unmount()

    status = ws.json("status")
    assert status["mounted"] is False
    assert sorted((c["kind"], c["path"]) for c in status["changes"]) == [
        ("A", "new"),
        ("D", "dir/b.txt"),
        ("M", "a.txt"),
    ]
    assert [entry["id"] for entry in ws.json("log")][-1] == layer
    # -C may name any path inside the workspace, as when mounted
    inner = json.loads(run("-C", ws / "dir", "--json", "status").stdout)
    assert inner["changes"] == status["changes"]
    res = ws.json("rollback")
    assert res["dropped"] == [layer] and res["mounted"] is False
    treesnap.assert_same(before, ws.snapshot())
    assert not is_cowfs_mount(str(ws.path))

    # commit of the base layer, offline too; the next mount carries on
    (ws / "offline-edit").write_text("made while unmounted: not captured\n")
    ws.mount()
    (ws / "captured").write_text("x\n")
    ws.unmount()
    assert ws.json("commit")["into"] is None
    assert ws.cowfs("rollback", check=False).returncode == NOTHING_TO_DO
    ws.mount()
    assert (ws / "captured").exists() and ws.status() == []


def test_rollback_after_kill_9_without_mounting_again(mounted):
    ws = mounted
    before = ws.snapshot()
    layer = ws.checkpoint()
    (ws / "a.txt").write_text("half-done work\n")
    (ws / "dir" / "c").write_text("c\n")
    ws.kill()  # the mount is left behind, dead
    r = ws.cowfs("--json", "rollback", "--to", layer)
    assert "cleared the dead mount" in r.stderr
    assert json.loads(r.stdout)["dropped"] == [layer]
    assert not is_cowfs_mount(str(ws.path))
    ws.mounted = False
    treesnap.assert_same(before, ws.snapshot())
    ws.mount()  # and mounts again normally
    assert ws.status() == []


def test_offline_errors(workspace, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    r = run("-C", plain, "status", check=False)  # (no store: exit 4, and none is made)
    assert r.returncode == NO_STORE and r.stdout == "" and os.listdir(plain) == []
    assert "not inside a cowfs workspace" in r.stderr and len(r.stderr.splitlines()) == 1
    r = run("-C", plain, "checkpoint", check=False)  # needs the daemon
    assert r.returncode == NOT_MOUNTED
    workspace.mount()
    workspace.checkpoint()
    workspace.unmount()
    r = workspace.cowfs("rollback", "--to", "99", check=False)
    assert r.returncode == UNKNOWN_LAYER
    # an explicit store, for a workspace whose store lives elsewhere
    store = tmp_path / "elsewhere"
    with managed_workspace(tmp_path / "other") as other:
        other.mount("--store", store)
        (other / "f").write_text("f\n")
        other.unmount()
        r = run("-C", other.path, "--store", store, "--json", "status")
        assert [c["path"] for c in json.loads(r.stdout)["changes"]] == ["f"]
        run("-C", other.path, "--store", store, "rollback", "--yes")
        assert not (other / "f").exists()


def test_offline_status_carries_who_like_the_mounted_one(mounted):
    """Who made each change (pid, uid, command line) is in the store: an
    unmounted workspace's `status --json` gives what the mounted one gave,
    also for changes made since a rollback that can still be redone."""
    ws = mounted
    subprocess.run(["touch", str(ws / "made")], check=True)
    ws.checkpoint()
    (ws / "a.txt").write_text("in the layer\n")
    ws.rollback()
    subprocess.run(["sh", "-c", f"echo since > {ws / 'dir' / 'since'}"], check=True)
    mounted_view = ws.json("status")
    assert ws.json("status")["redo"]["available"]
    assert {c["path"]: c["who"]["cmd"][0] for c in mounted_view["changes"]} == {
        "made": "touch",
        "dir/since": "sh",
    }
    ws.unmount()
    offline = ws.json("status")
    assert offline["mounted"] is False
    assert offline["changes"] == mounted_view["changes"]
    assert offline["redo"] == mounted_view["redo"]
