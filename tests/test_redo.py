"""Redo: undoing the last rollback exactly (the tree with mtimes, xattrs and
hard links, and the layers themselves), and refusing — changing nothing —
once something it would touch changed since; changes elsewhere are kept,
and belong to the top layer it brings back.  Generated histories are
covered by the model test (tests/test_model.py: the redo rule, and
rollbacks followed at once by a redo); kill -9 in the middle of a redo by
tests/test_crash.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cowfs.errors import NOTHING_TO_DO, REFUSED
from cowfs.interface.api import Workspace as ApiWorkspace
from cowfs.layers import redo, treesnap
from cowfs.storage import schema as S

from .helpers import COWFS, helper_of, plain, run


def layer_ids(ws) -> list[int]:
    return [layer["id"] for layer in ws.log()]


def change_everything(ws) -> None:
    """One layer's worth of every kind of change."""
    with open(ws / "big.bin", "r+b") as f:  # bytes inside chunks
        f.seek(70_000)
        f.write(b"X" * 100)
        f.seek(200_000)
        f.write(b"\0" * 5000)
    with open(ws / "grow.txt", "a") as f:  # an append past several chunks
        f.write("longer now\n" * 20_000)
    os.truncate(ws / "shrink.bin", 1000)  # a truncation
    subprocess.run(["sed", "-i", "s/alpha/ALPHA/", str(ws / "a.txt")], check=True)
    os.chmod(ws / "big.bin", 0o600)
    os.chown(ws / "grow.txt", 1000, 1000)
    os.setxattr(ws / "x.txt", "user.k", b"two")
    os.utime(ws / "x.txt", ns=(1_500_000_000_000_000_000, 1_500_000_000_000_000_000))
    (ws / "new" / "deep").mkdir(parents=True)  # new directories and files
    (ws / "new" / "deep" / "f").write_text("made\n")
    os.rename(ws / "dir", ws / "moved")  # a directory renamed
    os.link(ws / "moved" / "b.txt", ws / "hard")  # a hard link
    os.symlink("moved/b.txt", ws / "sym")
    os.unlink(ws / "gone.txt")  # a removal
    os.rename(ws / "x.txt", ws / "moved" / "x2.txt")  # a file moved into the moved dir


def prepare(ws) -> None:
    (ws / "big.bin").write_bytes(os.urandom(300_000))
    (ws / "grow.txt").write_text("short\n")
    (ws / "shrink.bin").write_bytes(os.urandom(200_000))
    (ws / "gone.txt").write_text("to be removed\n")
    (ws / "x.txt").write_text("x\n")
    os.setxattr(ws / "x.txt", "user.k", b"one")
    ws.commit()


def test_redo_brings_back_the_tree_and_the_layers_exactly(mounted):
    ws = mounted
    prepare(ws)
    layer = ws.checkpoint("work")
    start = ws.snapshot()
    change_everything(ws)
    before = ws.snapshot()
    status = plain(ws.status())
    log = [(x["id"], x["message"], x["changes"], x["records"]) for x in ws.log()]
    usage = ws.json("status")["usage"]

    assert ws.rollback()["dropped"] == [layer]
    treesnap.assert_same(start, ws.snapshot())
    assert ws.json("status")["redo"] == {
        "available": True,
        "layers": [layer],
        "why": "",
        "current": True,
    }
    assert "can be undone: cowfs redo" in ws.cowfs("status").stdout
    assert ws.json("check")["ok"]  # what is kept is consistent

    res = ws.json("redo")
    assert res["restored"] == [layer] and not res["failures"] and res["top"] == layer
    treesnap.assert_same(before, ws.snapshot())
    assert plain(ws.status()) == status
    assert [(x["id"], x["message"], x["changes"], x["records"]) for x in ws.log()] == log
    after = ws.json("status")["usage"]  # nothing kept behind
    assert after["grave"] == usage["grave"] and after["data"] <= usage["data"] + (64 << 10)
    assert ws.json("status")["redo"] is None
    assert ws.json("check")["ok"]

    # the layer is back for real: it rolls back exactly again, and redoes again
    ws.rollback()
    treesnap.assert_same(start, ws.snapshot())
    ws.json("redo")
    treesnap.assert_same(before, ws.snapshot())
    r = ws.cowfs("redo", check=False)  # only the last rollback, once
    assert r.returncode == NOTHING_TO_DO and "nothing to redo" in r.stderr
    ws.unmount()  # and the stack persists
    ws.mount()
    treesnap.assert_same(before, ws.snapshot())
    ws.rollback()
    treesnap.assert_same(start, ws.snapshot())


def test_redo_of_a_rollback_of_several_layers_and_of_the_base(mounted):
    ws = mounted
    base = layer_ids(ws)[0]
    (ws / "one").write_text("1\n")
    second = ws.checkpoint("two")
    at_second = ws.snapshot()
    (ws / "two").write_text("2\n")
    os.rename(ws / "dir", ws / "dir2")
    third = ws.checkpoint("three")
    (ws / "dir2" / "three").write_text("3\n")
    os.unlink(ws / "one")
    before = ws.snapshot()
    ids = layer_ids(ws)
    assert ids == [base, second, third]

    res = ws.rollback(to=base)  # every layer: a fresh base opens
    assert res["dropped"] == ids and res["top"] not in ids
    api = ApiWorkspace.attach(str(ws.path))  # (the Python API)
    redone = api.redo()
    assert redone.restored == ids and redone.top == third
    treesnap.assert_same(before, ws.snapshot())
    assert layer_ids(ws) == ids  # the fresh base is gone again
    ws.rollback(to=second)
    treesnap.assert_same(at_second, ws.snapshot())
    assert ws.json("check")["ok"]


def test_redo_is_refused_after_a_change_it_would_touch_and_changes_nothing(mounted):
    ws = mounted
    r = ws.cowfs("redo", check=False)
    assert r.returncode == NOTHING_TO_DO and "nothing to redo" in r.stderr
    with open(ws / "a.txt", "a") as f:  # captured by the base layer
        f.write("in the base layer\n")
    layer = ws.checkpoint()
    (ws / "new.txt").write_text("new\n")
    with open(ws / "a.txt", "a") as f:
        f.write("in the layer\n")
    ws.rollback()
    used = ws.json("status")["usage"]["bytes"]
    # A write the base layer captured already records nothing new in the
    # journal; the file is one the redo would put back: no redo.
    with open(ws / "a.txt", "r+") as f:
        f.write("Z")
    changed = ws.snapshot()
    r = ws.cowfs("redo", check=False)
    assert r.returncode == REFUSED, (r.returncode, r.stderr)
    assert (
        f"cannot redo the rollback of layer {layer}: a.txt changed since the rollback; "
        "nothing was changed" in r.stderr
    )
    treesnap.assert_same(changed, ws.snapshot())  # nothing changed
    assert len(layer_ids(ws)) == 1
    assert ws.json("status")["redo"] == {
        "available": False,
        "layers": [layer],
        "why": "a.txt changed since the rollback",
        "current": True,
    }
    assert "cannot be redone: a.txt changed since the rollback" in ws.cowfs("log").stdout
    assert ws.json("check")["ok"]
    # what was kept is freed by the next checkpoint (or commit, or rollback)
    ws.checkpoint()
    assert ws.json("status")["usage"]["bytes"] < used
    assert ws.json("check")["ok"]
    r = ws.cowfs("redo", check=False)
    assert r.returncode == REFUSED and "a checkpoint was taken after it" in r.stderr

    (ws / "later.txt").write_text("later\n")  # a checkpoint ends it too
    ws.rollback()
    ws.checkpoint()
    r = ws.cowfs("redo", check=False)
    assert r.returncode == REFUSED and "a checkpoint was taken after it" in r.stderr

    (ws / "more.txt").write_text("more\n")  # and --no-redo keeps nothing
    ws.cowfs("rollback", "--no-redo")
    r = ws.cowfs("redo", check=False)
    assert r.returncode == REFUSED and "made with --no-redo" in r.stderr


def test_redo_after_a_remount_and_offline_and_refused_after_an_offline_edit(mounted):
    ws = mounted
    layer = ws.checkpoint()
    (ws / "a.txt").write_text("edited in the layer\n")
    (ws / "dir" / "c.txt").write_text("new\n")
    before = ws.snapshot()
    ws.rollback()
    ws.unmount()
    ws.mount()  # a remount changes nothing
    ws.json("redo")
    treesnap.assert_same(before, ws.snapshot())

    ws.unmount()  # not mounted at all
    ws.cowfs("rollback")
    res = ws.json("redo")
    assert res["restored"] == [layer] and res["mounted"] is False
    ws.mount()
    treesnap.assert_same(before, ws.snapshot())
    ws.unmount()

    ws.cowfs("rollback")
    (ws / "a.txt").write_text("edited behind cowfs's back\n")
    r = ws.cowfs("redo", check=False)
    assert r.returncode == REFUSED and "a.txt" in r.stderr and "changed since" in r.stderr
    assert (ws / "a.txt").read_text() == "edited behind cowfs's back\n"
    assert not (ws / "dir" / "c.txt").exists()  # nothing was changed


def test_a_file_held_open_across_rollback_and_redo(mounted):
    ws = mounted
    ws.checkpoint()
    fd = os.open(ws / "made.txt", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"first\n")
        before = ws.snapshot()
        ws.rollback()
        assert not (ws / "made.txt").exists()
        ws.json("redo")  # the very same file comes back
        treesnap.assert_same(before, ws.snapshot())
        os.write(fd, b"second\n")  # and the open fd still writes to it
        assert (ws / "made.txt").read_bytes() == b"first\nsecond\n"
        ws.rollback()
        assert not (ws / "made.txt").exists()
        os.write(fd, b"third\n")  # writing to it after the rollback
        r = ws.cowfs("redo", check=False)  # is a change: no redo
        # (the daemon sees the write, or -- written through passthrough by
        # the kernel engine -- the fingerprint of the kept file shows it)
        assert (
            r.returncode == REFUSED
            and "(removed object" in r.stderr
            and "changed since the rollback" in r.stderr
        ), r.stderr
        assert not (ws / "made.txt").exists()
    finally:
        os.close(fd)
    assert ws.json("check")["ok"]


def new_package_with_a_cache(ws) -> treesnap.Snapshot:
    """Mount with __pycache__/ ignored; in a new layer, a package compiled
    by python (its cache uncaptured).  Returns the tree."""
    (ws / ".cowfsignore").write_text("__pycache__/\n")
    ws.mount()
    ws.checkpoint()
    (ws / "pkg").mkdir()
    (ws / "pkg" / "mod.py").write_text("X = 1\n")
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ws / "pkg")], check=True)
    assert list((ws / "pkg" / "__pycache__").iterdir())
    return ws.snapshot()


def test_redo_brings_back_a_new_package_with_its_ignored_cache(workspace):
    ws = workspace
    before = new_package_with_a_cache(ws)
    ws.rollback()
    assert not (ws / "pkg").exists()  # with what was made in it, ignored
    ws.json("redo")
    treesnap.assert_same(before, ws.snapshot())  # ... and all of it comes back


def test_redo_is_in_the_audit_log(mounted):
    ws = mounted
    layer = ws.checkpoint()
    (ws / "a.txt").write_text("changed\n")
    ws.rollback()
    ws.json("redo")
    events = [json.loads(line) for line in ws.cowfs("audit", "--jsonl").stdout.splitlines()]
    redo = [e for e in events if e["event"] == "redo"]
    assert len(redo) == 1 and redo[0]["restored"] == [layer]
    redone = [e for e in events if e.get("redone")]
    assert [(e["path"], e["kind"]) for e in redone] == [("a.txt", "M")]


def test_a_rollback_with_provider_snapshots_cannot_be_redone(mounted, tmp_path):
    ws = mounted
    state = tmp_path / "state"
    state.write_text("v1\n")
    ws.cowfs(
        "provider",
        "add",
        "cfg",
        "--capture",
        f'cp {state} "$COWFS_STATE_DIR/s"',
        "--restore",
        f'cp "$COWFS_STATE_DIR/s" {state}',
        "--discard",
        "true",
    )
    ws.json("checkpoint", "--provider", "cfg")
    state.write_text("v2\n")
    (ws / "a.txt").write_text("changed\n")
    ws.rollback()
    assert state.read_text() == "v1\n"
    r = ws.cowfs("redo", check=False)
    assert r.returncode == REFUSED and "provider snapshots" in r.stderr
    assert (ws / "a.txt").read_text() == "alpha\n" and state.read_text() == "v1\n"


def test_link_counts_follow_rollback_and_redo(mounted):
    """Hard links made and removed in a layer: every name shows the right
    st_nlink at once (the kernel's cached attributes are invalidated)."""
    ws = mounted
    os.link(ws / "dir" / "b.txt", ws / "b2")
    ws.commit()
    ws.checkpoint()
    os.link(ws / "a.txt", ws / "a2")  # a link made in the layer
    os.unlink(ws / "b2")  # and one removed
    counts = {"a.txt": 2, "a2": 2, "dir/b.txt": 1}
    assert {p: os.stat(ws / p).st_nlink for p in counts} == counts
    ws.rollback()
    assert os.stat(ws / "a.txt").st_nlink == 1
    assert os.stat(ws / "dir" / "b.txt").st_nlink == 2 == os.stat(ws / "b2").st_nlink
    ws.json("redo")
    assert {p: os.stat(ws / p).st_nlink for p in counts} == counts


def test_an_offline_change_inside_a_directory_the_redo_would_move_refuses_it(mounted):
    ws = mounted
    ws.checkpoint()
    os.unlink(ws / "dir" / "b.txt")
    os.rmdir(ws / "dir")  # the redo moves dir back to the grave
    ws.rollback()
    ws.unmount()
    (ws / "dir" / "new").write_text("important\n")  # made while not mounted
    r = ws.cowfs("redo", check=False)
    assert r.returncode == REFUSED and "dir" in r.stderr and "changed since" in r.stderr
    assert (ws / "dir" / "new").read_text() == "important\n"
    os.unlink(ws / "dir" / "new")
    os.setxattr(ws / "dir", "user.other", b"x")  # so is an attribute of it
    r = ws.cowfs("redo", check=False)
    assert r.returncode == REFUSED and "dir" in r.stderr
    assert os.getxattr(ws / "dir", "user.other") == b"x"


def test_a_refused_commit_leaves_the_redo(mounted):
    ws = mounted
    (ws / "new.txt").write_text("new\n")
    ws.rollback()  # the base layer: a fresh one opens
    r = ws.cowfs("commit", check=False)
    assert r.returncode == NOTHING_TO_DO
    ws.json("redo")
    assert (ws / "new.txt").read_text() == "new\n"


def test_writes_racing_a_rollback_and_its_redo(mounted):
    """Appends to a file while a rollback runs: some may land in the layer
    before it, some after it.  Whatever the timing, a redo is refused only
    when the file is one it would put back (an append landed in the layer
    and one after the rollback), and one that goes ahead is exact: rolling
    the layer back again gives the tree it was opened on."""
    ws = mounted
    with open(ws / "a.txt", "a") as f:  # captured by the base layer:
        f.write("base\n")  # appends record nothing new
    ws.checkpoint()
    start = ws.snapshot()
    for i in range(2000):
        (ws / "dir" / f"f{i}").write_bytes(b"x")
    rollback = subprocess.Popen(
        [sys.executable, "-m", "cowfs", "-C", str(ws.path), "rollback"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    while rollback.poll() is None:
        with open(ws / "a.txt", "a") as f:
            f.write("x")
    assert rollback.wait() == 0, rollback.stderr.read()
    now = ws.snapshot()
    r = ws.cowfs("--json", "redo", check=False)
    if r.returncode != 0:
        assert r.returncode == REFUSED and "a.txt changed since the rollback" in r.stderr, r.stderr
        treesnap.assert_same(now, ws.snapshot())
        return
    assert len(os.listdir(ws / "dir")) == 2001
    assert (ws / "a.txt").read_text().startswith("alpha\nbase\n")
    ws.rollback()
    treesnap.assert_same(start, ws.snapshot())


def test_a_rollback_interrupted_before_its_files_resumes_with_the_filters(workspace):
    """The next mount finishes an interrupted rollback under the capture
    filters its layers were captured with (and keeps what a redo needs)."""
    from cowfs.service.session import Session

    ws = workspace
    before = new_package_with_a_cache(ws)
    ws.unmount()
    # a crash right after the rollback was planned: only its pending record is written
    session = Session(str(ws.path), store=str(ws / ".cowfs"))
    session.inspect(readonly=False)  # (the store as it is: nothing resumed)
    try:
        session.plan_rollback()
    finally:
        session.close()
    ws.mount()
    assert not (ws / "pkg").exists()  # with its ignored cache
    ws.json("redo")
    treesnap.assert_same(before, ws.snapshot())


def test_a_rollback_killed_before_its_fingerprint_is_sealed_by_the_next_mount(mounted):
    """The store as a crash leaves it between the end of the rollback's files
    and the fingerprint of what a redo touches: the next mount takes it."""
    import lmdb

    from cowfs.layers import redo
    from cowfs.storage import schema as S

    ws = mounted
    ws.checkpoint()
    (ws / "a.txt").write_text("edited\n")
    (ws / "dir" / "new").write_text("new\n")
    before = ws.snapshot()
    ws.rollback()
    ws.unmount()
    env = lmdb.open(str(ws / ".cowfs" / "db"), max_dbs=len(S.ALL_DBS) + 2, subdir=True)
    try:
        db = env.open_db(S.DB_REDO)
        with env.begin(write=True, db=db) as txn:
            state = S.meta_json(S.DB_REDO, S.K_REDO_STATE, txn.get(S.K_REDO_STATE))
            assert state["state"] == redo.READY
            for key in [k for k, _ in txn.cursor() if k.startswith(S.REDO_PRINT)]:
                txn.delete(key)
            new = S.to_json(state | {"state": redo.BUILDING, "fresh": None})
            txn.put(S.K_REDO_STATE, S.seal(S.DB_REDO, S.K_REDO_STATE, new))
    finally:
        env.close()
    ws.mount()
    assert ws.json("status")["redo"]["available"] is True
    ws.json("redo")
    treesnap.assert_same(before, ws.snapshot())


# -- changes since the rollback, elsewhere or where the redo acts ---------------------------


def without(snap: treesnap.Snapshot, top: bytes) -> treesnap.Snapshot:
    """*snap* without the directory *top* and what is below it."""
    return treesnap.Snapshot(
        (p, e) for p, e in snap.items() if p != top and not p.startswith(top + b"/")
    )


def only(snap: treesnap.Snapshot, top: bytes) -> treesnap.Snapshot:
    return treesnap.Snapshot(
        (p, e) for p, e in snap.items() if p == top or p.startswith(top + b"/")
    )


def test_a_change_elsewhere_leaves_the_redo_and_is_kept_by_it(mounted):
    """After a rollback, a new file in a directory the redo does not touch,
    a file the open layer had captured already, and an ignored cache: the
    redo goes ahead, brings the layer back exactly and leaves them as they
    are; they belong to the top layer now, so rolling it back again gives
    the tree it was opened on."""
    ws = mounted
    (ws / ".cowfsignore").write_text("cache/\n")
    (ws / "other").mkdir()
    (ws / "other" / "kept.txt").write_text("base\n")
    ws.commit()
    with open(ws / "other" / "kept.txt", "a") as f:  # captured by the base layer
        f.write("in the base layer\n")
    layer = ws.checkpoint("work")
    start = ws.snapshot()
    change_everything_but_other(ws)
    before = ws.snapshot()
    status = plain(ws.status())
    ws.rollback()
    treesnap.assert_same(start, ws.snapshot())

    (ws / "other" / "new.txt").write_text("made since the rollback\n")
    with open(ws / "other" / "kept.txt", "a") as f:  # nothing new for the base layer,
        f.write("and since the rollback\n")  # but the redo's layer needs it
    (ws / "other" / "cache").mkdir()
    (ws / "other" / "cache" / "x.pyc").write_bytes(b"\x00cache")
    since = ws.snapshot()
    listed = plain(ws.status())
    assert sorted(c["path"] for c in listed) == ["other/kept.txt", "other/new.txt"]
    [who] = [c["who"] for c in ws.status() if c["path"] == "other/new.txt"]
    assert who["pid"] > 0  # attributed like any change
    assert ws.json("status")["redo"] == {
        "available": True,
        "layers": [layer],
        "why": "",
        "current": True,
    }
    assert ws.json("check")["ok"]

    res = ws.json("redo")
    assert res["restored"] == [layer] and not res["failures"]
    after = ws.snapshot()
    # what the layer changed is back exactly; what changed since, exactly as it was
    treesnap.assert_same(without(before, b"other"), without(after, b"other"))
    treesnap.assert_same(only(since, b"other"), only(after, b"other"))

    def key(c):
        return c["path"], c["kind"], c.get("from")

    assert sorted(map(key, plain(ws.status()))) == sorted(map(key, status + listed))
    assert ws.json("check")["ok"]

    ws.unmount()  # (persists)
    ws.mount()
    ws.rollback()  # the layer, with what came since
    treesnap.assert_same(start, without(ws.snapshot(), b"other/cache"))  # (ignored: left)
    ws.json("redo")
    treesnap.assert_same(after, ws.snapshot())
    ws.rollback(to=layer_ids(ws)[0])  # and the base layer below it
    assert (ws / "other" / "kept.txt").read_text() == "base\n"
    assert not (ws / "other" / "new.txt").exists()


def change_everything_but_other(ws) -> None:
    (ws / "a.txt").write_text("edited\n")
    (ws / "dir" / "c.txt").write_text("new\n")
    os.rename(ws / "dir" / "b.txt", ws / "dir" / "b2.txt")
    os.mkdir(ws / "made")
    (ws / "made" / "f").write_text("f\n")


def test_a_change_elsewhere_after_a_rollback_of_every_layer(mounted):
    """The fresh base layer a rollback of every layer opens takes what
    changes since; a redo makes it part of the top layer it brings back."""
    ws = mounted
    (ws / "other").mkdir()
    ws.commit()
    start = ws.snapshot()
    second = ws.checkpoint()
    change_everything_but_other(ws)
    before = ws.snapshot()
    ws.rollback(to=layer_ids(ws)[0])
    (ws / "other" / "new.txt").write_text("since\n")
    since = ws.snapshot()
    ws.unmount()  # offline, too
    res = ws.json("redo")
    assert res["top"] == second and res["mounted"] is False
    ws.mount()
    after = ws.snapshot()
    treesnap.assert_same(without(before, b"other"), without(after, b"other"))
    treesnap.assert_same(only(since, b"other"), only(after, b"other"))
    assert ws.json("check")["ok"]
    ws.rollback(to=layer_ids(ws)[0])
    treesnap.assert_same(start, ws.snapshot())


def test_a_change_where_the_redo_acts_refuses_it(mounted):
    """A new name in a directory whose entries the redo puts back, a change
    below a directory it moves, an attribute of a file it restores: each
    refuses the redo, naming the path, changing nothing."""
    ws = mounted
    (ws / "dir" / "sub").mkdir()
    (ws / "dir" / "sub" / "s.txt").write_text("s\n")
    ws.commit()
    layer = ws.checkpoint()
    os.rename(ws / "dir", ws / "moved")  # the redo moves dir again
    (ws / "a.txt").write_text("edited\n")
    ws.rollback()
    cases = [
        (lambda: (ws / "dir" / "new").write_text("x\n"), "dir changed since the rollback"),
        (
            lambda: (ws / "dir" / "sub" / "deep").write_text("x\n"),
            "dir/sub/deep changed since the rollback, inside dir, which the redo moves",
        ),
        (lambda: os.chmod(ws / "a.txt", 0o600), "a.txt changed since the rollback"),
    ]
    for change, message in cases:
        change()
        now = ws.snapshot()
        r = ws.cowfs("redo", check=False)
        assert r.returncode == REFUSED, r.stderr
        assert f"cannot redo the rollback of layer {layer}: " in r.stderr and all(
            part in r.stderr for part in message.split(" changed since the rollback")
        ), r.stderr
        treesnap.assert_same(now, ws.snapshot())
        assert ws.json("status")["redo"]["available"] is False
        ws.rollback()  # (the change goes, the redo with it)
        layer = ws.checkpoint()
        os.rename(ws / "dir", ws / "moved")
        (ws / "a.txt").write_text("edited\n")
        ws.rollback()
    assert ws.json("check")["ok"]


def test_the_room_a_redo_holds_is_given_back_to_a_change_that_needs_it(workspace):
    """--max-store: a change that finds no room while a redo holds what the
    rollback kept gets that room (the redo goes, saying why)."""
    ws = workspace
    (ws / "big.bin").write_bytes(os.urandom(2 << 20))
    (ws / "other.bin").write_bytes(os.urandom(2 << 20))
    ws.mount("--max-store", "5M")
    layer = ws.checkpoint()
    (ws / "big.bin").write_bytes(os.urandom(2 << 20))  # 2 MiB of pre-images
    ws.rollback()  # + 2 MiB kept for the redo
    (ws / "other.bin").write_bytes(os.urandom(2 << 20))  # needs 2 MiB more: there is room
    r = ws.cowfs("redo", check=False)
    assert (
        r.returncode == REFUSED
        and f"the rollback of layer {layer}" in r.stderr
        and "the store needed the room it held" in r.stderr
    ), r.stderr
    assert ws.json("check")["ok"]


@pytest.mark.parametrize("ending", ["checkpoint", "rollback", "commit"])
def test_changes_since_a_rollback_stay_with_the_open_layer_when_the_redo_goes(mounted, ending):
    """Once a checkpoint, a rollback or a commit ends the chance to redo,
    what changed since the rollback is the open layer's, like any change of
    it: rolling that layer back undoes it exactly (also a file the layer had
    captured before the rollback), committing it keeps it."""
    ws = mounted
    (ws / "other").mkdir()
    (ws / "other" / "kept.txt").write_text("base\n")
    ws.commit()
    base_start = ws.snapshot()
    with open(ws / "other" / "kept.txt", "a") as f:  # captured by the base layer
        f.write("in the base layer\n")
    ws.checkpoint()
    change_everything_but_other(ws)
    ws.rollback()
    with open(ws / "other" / "kept.txt", "a") as f:
        f.write("since the rollback\n")
    (ws / "other" / "new.txt").write_text("since\n")
    os.unlink(ws / "dir" / "b.txt")  # (where the redo acts: refused)
    live = ws.snapshot()
    if ending == "commit":
        ws.commit()  # the base layer: permanent
        assert ws.status() == [] and ws.json("check")["ok"]
        treesnap.assert_same(live, ws.snapshot())
        return
    if ending == "checkpoint":
        ws.checkpoint()
        assert ws.json("check")["ok"]
        r = ws.cowfs("redo", check=False)
        assert r.returncode == REFUSED and "a checkpoint was taken after it" in r.stderr
    assert ws.json("check")["ok"]
    ws.rollback(to=layer_ids(ws)[0])
    treesnap.assert_same(base_start, ws.snapshot())
    assert ws.json("check")["ok"]


# -- a rollback killed in the middle of a batch of steps ---------------------------------

KILL_AT = """
import os, sys
from cowfs.layers import undo
from cowfs.service import session
count = [0]
def dying(step):
    def counted(*args, **kwargs):
        count[0] += 1
        if count[0] > int(sys.argv[3]):
            os._exit(9)       # (as a kill -9 would: nothing more is written)
        return step(*args, **kwargs)
    return counted
undo.Undoer.apply = dying(undo.Undoer.apply)
undo.Undoer.put_back_and_remove = dying(undo.Undoer.put_back_and_remove)
op = sys.argv[2]
args = {"yes": True, "keep_redo": op == "rollback"} if op.startswith("rollback") else {}
session.offline(sys.argv[1], None, op.split("-")[0], **args)
"""


def kill_within(ws, op: str, steps: int) -> None:
    """Run *op* (rollback, rollback-no-redo or redo) on the unmounted
    workspace and kill it (as kill -9 would) after *steps* of its undo
    steps."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    r = subprocess.run(
        [sys.executable, "-c", KILL_AT, str(ws.path), op, str(steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 9, f"the {op} took fewer than {steps} steps: {r.stderr}"


def assert_sound_midway(ws) -> None:
    """The store of an operation killed midway is sound: objects on their
    way into or out of the grave are no problems (nor anything a repair
    would free: the resumed steps move them)."""
    report = json.loads(ws.cowfs("--json", "check", check=False).stdout)
    assert report["ok"], report["problems"]


def assert_resumed(ws, op: str) -> None:
    """Mount: the interrupted *op* is finished, every step of it without
    a failure, and nothing else is said."""
    warnings = json.loads(run("--json", "mount", ws.path).stdout)["warnings"]
    ws.mounted = True
    assert len(warnings) == 1, warnings
    assert re.fullmatch(rf"finished an interrupted {op} \([\d,]+ steps?\)", warnings[0]), warnings


def a_layer_of_many_kinds(ws) -> tuple[treesnap.Snapshot, treesnap.Snapshot]:
    """Two directories of files, committed; then a layer that holds what
    `sed -i` does (a temporary file renamed over each name, and one into a
    new name), new files and directories, writes, mode changes and
    removals, a name used twice, a file renamed over another, one made and
    removed again, one removed and made anew, hard links.  Returns the
    tree at its checkpoint and at its end."""
    for d in ("p", "q"):
        (ws / d).mkdir()
        for i in range(40):
            (ws / d / f"f{i}").write_text(f"{d} {i}\n")
    ws.commit()
    at_checkpoint = ws.snapshot()
    ws.checkpoint()
    for d in ("p", "q"):
        for i in range(40):
            f = ws / d / f"f{i}"
            if i % 4 == 0:
                subprocess.run(["sed", "-i", "s/ / changed /", str(f)], check=True)
            elif i % 4 == 1:
                (ws / d / f"new{i}.tmp").write_text("new\n")
                os.rename(ws / d / f"new{i}.tmp", ws / d / f"new{i}")
            elif i % 4 == 2:
                with open(f, "a") as fh:
                    fh.write("more\n")
                os.chmod(f, 0o600)
            else:
                os.unlink(f)
        (ws / d / "sub").mkdir()
        (ws / d / "sub" / "inside").write_text("inside\n")
        (ws / d / "made").write_text("made\n")
        os.unlink(ws / d / "made")
        (ws / d / "t").write_text("1\n")
        os.rename(ws / d / "t", ws / d / "u")
        (ws / d / "t").write_text("2\n")
        os.rename(ws / d / "f1", ws / d / "f2")
        os.unlink(ws / d / "f5")
        (ws / d / "f5").write_text("anew\n")
        # hard links: one made to a file written before and after it (the
        # rollback moves that name into the grave and changes the object
        # through the other), one to a file made in the layer, renamed
        os.link(ws / d / "f6", ws / d / "f6-link")
        with open(ws / d / "f6-link", "a") as fh:
            fh.write("through the link\n")
        os.link(ws / d / "new9", ws / d / "new9-link")
        os.rename(ws / d / "new9-link", ws / d / "moved-link")
    return at_checkpoint, ws.snapshot()


@pytest.mark.parametrize(
    "op, steps",
    [("rollback", n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 30, 57, 90, 120, 130, 135)]
    + [("rollback-no-redo", n) for n in (1, 7, 60, 130)],
)
def test_a_rollback_killed_within_a_batch_resumes_and_is_redone_exactly(mounted, op, steps):
    """The rollback keeps what a redo needs a batch of steps at a time, and
    applies the steps of a batch again when it resumes: killed after any
    step, the store is sound, the next mount ends it with the tree at the
    checkpoint, and its redo with the tree before it.  (--no-redo: each
    record goes as its step is taken.)"""
    ws = mounted
    at_checkpoint, before = a_layer_of_many_kinds(ws)
    ws.unmount()
    kill_within(ws, op, steps)
    assert_sound_midway(ws)
    assert_resumed(ws, "rollback")
    treesnap.assert_same(at_checkpoint, ws.snapshot())
    if op == "rollback":
        assert ws.json("status")["redo"]["available"] is True
        ws.json("redo")
        treesnap.assert_same(before, ws.snapshot())


@pytest.mark.parametrize("steps", [1, 3, 4, 5, 9, 14, 30, 57, 90, 131])
def test_a_rollback_in_small_batches_killed_after_any_step_resumes_exactly(
    mounted, monkeypatch, steps
):
    """Batches of 4 steps: each batch after the first is planned and kept
    while the steps of the one before it are taken (without a helper
    process, as here, just before them).  Killed after any step -- with
    the next batch's inverses kept or not -- the store is sound, the next
    mount ends the rollback exactly, and its redo.  The mount's own
    rollbacks take their batches in its helper process."""
    monkeypatch.setenv("COWFS_UNDO_BATCH", "4")
    ws = mounted
    ws.unmount()
    ws.mount()  # (a daemon with the small batches)
    at_checkpoint, before = a_layer_of_many_kinds(ws)
    ws.unmount()
    kill_within(ws, "rollback", steps)
    assert_sound_midway(ws)
    assert_resumed(ws, "rollback")
    treesnap.assert_same(at_checkpoint, ws.snapshot())
    ws.json("redo")
    treesnap.assert_same(before, ws.snapshot())
    ws.rollback()
    treesnap.assert_same(at_checkpoint, ws.snapshot())
    ws.json("redo")
    treesnap.assert_same(before, ws.snapshot())
    assert ws.json("check")["ok"]


@pytest.mark.parametrize("batch", [None, "8"])
def test_a_large_layer_rolls_back_and_redoes_exactly_through_the_helper(
    mounted, monkeypatch, batch
):
    """Thousands of records of every kind in nested directories: the
    rollback takes them in many batches, most planned and kept while the
    daemon's helper process takes the steps of the one before, and puts
    back the tree exactly (and what the mount shows); the redo too."""
    if batch is not None:
        monkeypatch.setenv("COWFS_UNDO_BATCH", batch)
        mounted.unmount()
        mounted.mount()
    ws = mounted
    prepare(ws)
    for d in range(12):
        sub = ws / "tree" / f"d{d}" / "inner"
        sub.mkdir(parents=True)
        for i in range(60):
            (sub / f"f{i}").write_text(f"{d} {i}\n")
    ws.commit()
    start = ws.snapshot()
    ws.checkpoint()
    for d in range(12):
        sub = ws / "tree" / f"d{d}" / "inner"
        for i in range(60):
            f = sub / f"f{i}"
            if i % 3 == 0:  # written under a temporary name, renamed into place (twice)
                for n in range(2):
                    (sub / f"f{i}.tmp").write_text(f"rewritten {n}\n")
                    os.rename(sub / f"f{i}.tmp", f)
            elif i % 3 == 1:
                (sub / f"new{i}.tmp").write_text("new\n")
                os.rename(sub / f"new{i}.tmp", sub / f"new{i}")
            elif i % 6 == 2:
                os.unlink(f)
            else:
                os.chmod(f, 0o600)
                os.utime(f, ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
        os.chmod(sub, 0o700)
        os.rename(sub / "f4", ws / "tree" / f"d{d}" / "f4-moved")
        os.link(sub / "f7", sub / "f7-link")
    change_everything(ws)
    before = ws.snapshot()
    assert ws.log()[-1]["records"] > 1500
    helper = helper_of(ws)

    ws.rollback()
    treesnap.assert_same(start, ws.snapshot())
    assert ws.json("check")["ok"]
    ws.json("redo")
    treesnap.assert_same(before, ws.snapshot())
    ws.rollback()
    treesnap.assert_same(start, ws.snapshot())
    assert helper_of(ws) == helper  # (one helper for the mount's life)


def test_a_rollback_goes_on_exactly_when_its_helper_process_is_lost(mounted, monkeypatch):
    """The helper killed while a rollback runs: its batch is taken again by
    the rollback (its steps change nothing they did), the rollback ends
    exactly, the mount shows the tree, and the rollbacks after it take
    their steps themselves."""
    monkeypatch.setenv("COWFS_UNDO_BATCH", "8")
    ws = mounted
    ws.unmount()
    ws.mount()
    for d in range(40):
        (ws / f"d{d}").mkdir()
    ws.commit()
    start = ws.snapshot()
    ws.checkpoint()
    for d in range(40):
        for i in range(250):
            (ws / f"d{d}" / f"f{i}.tmp").write_text(f"{i}\n")
            os.rename(ws / f"d{d}" / f"f{i}.tmp", ws / f"d{d}" / f"f{i}")
    before = ws.snapshot()
    helper = helper_of(ws)
    rollback = subprocess.Popen(
        [*COWFS, "-C", str(ws.path), "--json", "rollback"], stdout=subprocess.PIPE, text=True
    )
    try:
        time.sleep(0.5)
        assert rollback.poll() is None, "the rollback ended before its helper was killed"
        os.kill(helper, signal.SIGKILL)
        out, _ = rollback.communicate(timeout=300)
    finally:
        if rollback.poll() is None:
            rollback.kill()
    assert rollback.returncode == 0 and json.loads(out)["failures"] == []
    treesnap.assert_same(start, ws.snapshot())
    assert ws.json("check")["ok"]
    ws.json("redo")  # (each of these takes its steps itself)
    treesnap.assert_same(before, ws.snapshot())
    ws.rollback()
    treesnap.assert_same(start, ws.snapshot())
    ws.unmount()
    treesnap.assert_same(start, ws.snapshot())
    log = (ws / ".cowfs" / "daemon.log").read_text()
    assert "the rollback helper process is lost" in log


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 10, 25, 40, 70, 100, 150])
def test_a_redo_killed_within_a_batch_resumes_exactly(mounted, steps):
    """A redo forgets the inverses it applied a batch at a time: killed
    after any step, the next mount finishes it, exactly."""
    ws = mounted
    at_checkpoint, before = a_layer_of_many_kinds(ws)
    ws.rollback()
    treesnap.assert_same(at_checkpoint, ws.snapshot())
    ws.unmount()
    kill_within(ws, "redo", steps)
    assert_sound_midway(ws)
    assert_resumed(ws, "redo")
    treesnap.assert_same(before, ws.snapshot())


# -- where a redo acts, when no directory moved -----------------------------------------

_FILES = [b"d/a", b"d/b", b"d/c", b"e/a", b"e/f", S.grave_loc(1), S.grave_loc(2)]


@st.composite
def _inverse_group(draw):
    """The inverses of one undo step that moves no directory: a move of a
    file (into or out of the grave too) or an exchange, with the times of
    the directories it touches; or attribute and byte records."""
    kind = draw(st.sampled_from(["rename", "exchange", "meta"]))
    ino = draw(st.integers(1, 9))
    if kind == "meta":
        loc = draw(st.sampled_from(_FILES))
        return [S.Meta(loc, ino, 0o100644, 0, 0, 1, 0, 0), S.Chunk(loc, ino, 0, 1, b"")]
    a, b = draw(st.lists(st.sampled_from(_FILES), min_size=2, max_size=2, unique=True))
    first = S.Rename(a, b, ino) if kind == "rename" else S.Exchange(a, b, ino, ino + 1)
    parents = {p.rpartition(b"/")[0] for p in (a, b) if S.grave_id(p) is None}
    return [first, *(S.Meta(p, 100, 0o40755, 0, 0, 1, 0, 0) for p in sorted(parents))]


@given(st.lists(_inverse_group(), max_size=30))
def test_the_locations_of_a_rollback_that_moved_no_directory(groups):
    """What a redo touches, found without following names (no directory
    moved, so none holds other places) is what following them finds."""
    locs, moved, last = redo._locations(enumerate(groups))
    assert (locs, moved) == redo.touched_locations(groups)
    assert last == {
        loc: i for i, group in enumerate(groups) for rec in group for loc in redo._locs(rec)
    }


def test_the_fingerprints_of_a_rollback_are_those_of_each_location(tmp_path):
    """`fingerprints` (what a rollback seals) gives, for every kind of
    location, the bytes `fingerprint` and `print_json` give one by one: a
    file, a directory, a symlink, nothing, a name under a file or under a
    missing directory, the root, grave entries present and absent."""
    from cowfs.system import backing as B

    root, graves = tmp_path / "root", tmp_path / "graves"
    (root / "d" / "e").mkdir(parents=True)
    graves.mkdir()
    (root / "d" / "f").write_text("f\n")
    (root / "d" / "e" / "g").write_bytes(b"\0" * 5000)
    os.symlink("f", root / "d" / "link")
    (graves / "7").write_text("kept\n")
    os.chmod(root / "d" / "f", 0o600)
    locs = sorted(
        [
            b"",
            b"d",
            b"d/e",
            b"d/e/g",
            b"d/f",
            b"d/f/under",
            b"d/link",
            b"d/none",
            b"gone/x",
            b"gone/y/z",
            b"top",
            S.grave_loc(7),
            S.grave_loc(8),
        ]
    )
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    gravefd = os.open(graves, os.O_RDONLY | os.O_DIRECTORY)
    try:
        r = B.Resolver(rootfd, gravefd)
        with r.reading():
            fast = redo.fingerprints(r, locs)
        slow = [(loc, redo.print_json(B.fingerprint(r, loc))) for loc in locs]
    finally:
        os.close(rootfd)
        os.close(gravefd)
    assert fast == slow
    got = dict(fast)
    assert (
        got[b"d/none"] == b"null"
        and got[b"d/f/under"] == b'["unreachable"]'
        and got[S.grave_loc(8)] == b"null"
        and json.loads(got[S.grave_loc(7)])[4] == 5
    )


def test_the_fingerprints_a_rollback_seals_are_those_of_the_tree_it_leaves(mounted, monkeypatch):
    """The seal takes some fingerprints from the steps themselves (a file
    written under a temporary name and renamed into place leaves nothing at
    its name, a removed file put back nothing in the grave): every one it
    keeps is what looking at the location gives once the rollback is done
    -- with names used again by later changes, a file renamed over another,
    and `sed -i`."""
    from cowfs.service import session
    from cowfs.storage.store import Store, scan
    from cowfs.system import backing as B

    ws = mounted
    for d in ("p", "q"):
        (ws / d).mkdir()
        for i in range(20):
            (ws / d / f"f{i}").write_text(f"{d} {i}\n")
    ws.commit()
    ws.checkpoint()
    for d in ("p", "q"):
        for i in range(30):
            (ws / d / f"n{i}.tmp").write_text(f"{i}\n")
            os.rename(ws / d / f"n{i}.tmp", ws / d / f"n{i}")
        for i in range(0, 20, 3):
            subprocess.run(["sed", "-i", "s/ / changed /", str(ws / d / f"f{i}")], check=True)
        (ws / d / "t").write_text("1\n")
        os.rename(ws / d / "t", ws / d / "u")
        (ws / d / "t").write_text("2\n")
        os.rename(ws / d / "t", ws / d / "n3")  # over a new file
        os.rename(ws / d / "f1", ws / d / "f2")  # over an old one
        os.link(ws / d / "n4", ws / d / "n4.link")
        (ws / d / "n5.tmp").write_text("again\n")
        os.rename(ws / d / "n5.tmp", ws / d / "n5")
        os.chmod(ws / d / "n6", 0o600)
    before = ws.snapshot()
    ws.unmount()
    looked: list[bytes] = []
    fingerprints = redo.fingerprints
    monkeypatch.setattr(
        redo, "fingerprints", lambda r, locs: looked.extend(locs) or fingerprints(r, locs)
    )
    session.offline(str(ws.path), None, "rollback", yes=True)
    store = Store.open(str(ws / ".cowfs"), str(ws.path), create=False)
    rootfd = os.open(ws.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with store.env.begin(db=store.db_redo) as txn:
            kept = {
                bytes(S.split_redo_key(k)[1]): bytes(v)
                for k, v in scan(txn, store.db_redo, S.REDO_PRINT)
            }
        r = B.Resolver(rootfd, store.grave_fd)
        now = {loc: redo.print_json(B.fingerprint(r, loc)) for loc in kept}
    finally:
        store.close()
        os.close(rootfd)
    assert kept == now
    # (the redo moves such a file from the grave straight to its name: the
    # temporary name is none of its business)
    assert b"p/n7" in kept and b"p/n7" not in looked and b"p/n7.tmp" not in kept
    # (nor the grave entries that a file removed in the layer was put back from)
    emptied = {loc for loc, v in kept.items() if S.grave_id(loc) is not None and v == b"null"}
    assert emptied and not emptied & set(looked)
    assert len(looked) < len(kept) - 50, (len(looked), len(kept))
    ws.mount()
    ws.json("redo")
    treesnap.assert_same(before, ws.snapshot())


def test_a_rollback_that_keeps_nothing_puts_files_renamed_into_place_back_too(mounted):
    """With --no-redo, a file written under a temporary name and renamed
    into place goes in one step too (unlinked): the tree is the one at the
    checkpoint, also where the temporary name was a hard link's or is taken
    again by a later file, and where the rename replaced an older file."""
    ws = mounted
    (ws / "d").mkdir()
    for i in range(10):
        (ws / "d" / f"f{i}").write_text(f"{i}\n")
    ws.commit()
    at_checkpoint = ws.snapshot()
    ws.checkpoint()
    for i in range(10):
        subprocess.run(["sed", "-i", "s/$/ changed/", str(ws / "d" / f"f{i}")], check=True)
        (ws / "d" / f"n{i}.tmp").write_text(f"new {i}\n")
        os.rename(ws / "d" / f"n{i}.tmp", ws / "d" / f"n{i}")
    os.link(ws / "d" / "n1", ws / "d" / "n1.tmp")
    os.rename(ws / "d" / "n1.tmp", ws / "d" / "n1.again")  # (a second name of it)
    (ws / "d" / "n2.tmp").write_text("later\n")  # the name taken again
    ws.cowfs("rollback", "--no-redo")
    treesnap.assert_same(at_checkpoint, ws.snapshot())
    assert ws.json("check")["ok"]
