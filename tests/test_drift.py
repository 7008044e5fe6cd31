"""Drift: paths the layers changed that are changed again while the
workspace is not mounted make `mount` refuse (listing them); with
--accept-drift it mounts and records the drift in the log."""

from __future__ import annotations

import os
import shutil

from cowfs.errors import DRIFT
from cowfs.system.mounts import is_cowfs_mount


def prepared(ws):
    """A layer that changed a.txt and dir/b.txt, then a clean unmount."""
    ws.checkpoint("work")
    (ws / "a.txt").write_text("changed in the layer\n")
    (ws / "dir" / "b.txt").write_text("also changed\n")
    ws.unmount()


def test_changes_made_while_unmounted_are_refused_then_accepted(mounted):
    ws = mounted
    prepared(ws)
    with open(ws / "a.txt", "a") as f:  # behind cowfs's back
        f.write("edited while not mounted\n")
    os.unlink(ws / "dir" / "b.txt")
    (ws / "untouched-by-layers").write_text("fine\n")
    r = ws.cowfs("mount", ws.path, check=False)
    assert r.returncode == DRIFT, r.stderr
    assert "a.txt" in r.stderr and "dir/b.txt" in r.stderr and "--accept-drift" in r.stderr
    assert "paths the layers changed were changed while" in r.stderr, r.stderr
    assert "untouched-by-layers" not in r.stderr
    assert not is_cowfs_mount(str(ws.path))
    assert ws.cowfs("rollback", check=False).returncode == DRIFT  # offline neither
    ws.mount("--accept-drift")
    top = ws.log()[-1]
    assert top["drift"][0]["paths"] == ["a.txt", "dir/b.txt"]
    assert "drift accepted at mount" in ws.cowfs("log").stdout
    ws.unmount()
    ws.mount()  # accepted once: mounts normally again


def test_a_replaced_file_with_the_same_size_and_times_is_drift(mounted):
    ws = mounted
    prepared(ws)
    a = ws / "a.txt"
    st = os.stat(a)
    shutil.copy2(a, ws / "copy")  # same bytes, size and mtime
    os.replace(ws / "copy", a)  # but another inode
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = ws.cowfs("mount", ws.path, check=False)
    assert r.returncode == DRIFT and "a.txt" in r.stderr
    assert "1 path the layers changed was changed while" in r.stderr, r.stderr


def test_no_drift_mounts_and_offline_commands_keep_the_record(mounted):
    ws = mounted
    prepared(ws)
    assert ws.json("status")["changes"]  # offline status leaves it alone
    ws.mount()  # nothing changed: mounts
    assert ws.log()[-1].get("drift") == []
    ws.unmount()
    ws.rollback()  # offline rollback, then a change
    (ws / "a.txt").write_text("after the offline rollback\n")
    ws.mount()  # a.txt is no longer a layer's path


def test_a_drift_record_of_an_older_cowfs_is_read_as_it_was_written(mounted):
    """An older cowfs kept [size, mtime, ctime, inode] of each path: a
    mount compares the paths with that record as such, so nothing changed
    mounts, and a change is still drift."""
    from cowfs.storage import schema as S
    from cowfs.storage.store import Store

    ws = mounted
    prepared(ws)
    store = Store.open(str(ws / ".cowfs"), str(ws.path), create=False)
    try:
        record = store.get_meta_json(S.K_DRIFT)
        assert all(len(fp) == 7 for fp in record["paths"].values() if fp is not None)
        record["paths"] = {
            p: fp if fp is None else [fp[4], fp[5], fp[6], fp[0]]
            for p, fp in record["paths"].items()
        }
        store.set_meta_json(S.K_DRIFT, record)
    finally:
        store.close()
    ws.mount()  # as the older cowfs left it: no drift
    assert ws.log()[-1].get("drift") == []
    ws.unmount()
    os.chmod(ws / "a.txt", 0o600)  # (a new record, then a change of mode alone)
    os.chmod(ws / "dir", 0o700)
    os.rename(ws / "dir", ws / "moved")
    r = ws.cowfs("mount", ws.path, check=False)
    assert r.returncode == DRIFT and "a.txt" in r.stderr and "dir/b.txt" in r.stderr, r.stderr
