"""Command providers: state outside the workspace (here a real sqlite3
database in another directory) snapshotted and restored with the layers."""

from __future__ import annotations

import subprocess

import pytest

from cowfs import Workspace, treesnap
from cowfs.errors import DAEMON_ERROR, PARTIAL, USAGE


def sql(db, statement: str) -> str:
    return subprocess.run(["sqlite3", str(db), statement], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "outside" / "app.db"
    path.parent.mkdir()
    sql(path, "create table t(x); insert into t values ('original');")
    return path


def add_db_provider(ws, db, name="db", capture=None):
    ws.cowfs("provider", "add", name,
             "--capture", capture or f'cp "{db}" "$COWFS_STATE_DIR/copy.db"',
             "--restore", f'cp "$COWFS_STATE_DIR/copy.db" "{db}"',
             "--discard", f'echo "$COWFS_LAYER" >> "{db.parent}/discarded"')


def test_checkpoint_with_a_provider_restores_files_and_state_together(mounted, db):
    ws = mounted
    add_db_provider(ws, db)
    before = ws.snapshot()
    layer = ws.json("checkpoint", "-m", "migrate", "--provider", "db")
    assert [s["provider"] for s in layer["snapshots"]] == ["db"]
    sql(db, "update t set x = 'migrated'")
    (ws / "a.txt").write_text("migrated\n")
    res = ws.rollback()
    assert [r["provider"] for r in res["restored"]] == ["db"]
    assert sql(db, "select x from t") == "original"
    treesnap.assert_same(before, ws.snapshot())
    # the dropped layer's snapshot was discarded
    assert (db.parent / "discarded").read_text().split() == [str(layer["id"])]


def test_rollback_to_restores_every_dropped_snapshot_last_first(mounted, db):
    ws = mounted
    add_db_provider(ws, db)
    first = ws.json("checkpoint", "--provider", "db")["id"]
    sql(db, "update t set x = 'one'")
    ws.json("checkpoint", "--provider", "db")
    sql(db, "update t set x = 'two'")
    ws.rollback(to=first)
    assert sql(db, "select x from t") == "original"


def test_commit_discards_snapshots_no_longer_needed(mounted, db):
    ws = mounted
    add_db_provider(ws, db)
    first = ws.json("checkpoint", "--provider", "db")["id"]
    sql(db, "update t set x = 'one'")
    second = ws.json("checkpoint", "--provider", "db")["id"]
    sql(db, "update t set x = 'two'")
    ws.commit()                                      # merge second into first
    assert (db.parent / "discarded").read_text().split() == [str(second)]
    ws.rollback()                                    # back to before first
    assert sql(db, "select x from t") == "original"
    assert (db.parent / "discarded").read_text().split() == [str(second), str(first)]


def test_a_failing_capture_fails_the_whole_checkpoint(mounted, db):
    ws = mounted
    add_db_provider(ws, db, "good")
    ws.cowfs("provider", "add", "bad", "--capture", "echo broken >&2; exit 3",
             "--restore", "true")
    layers = ws.log()
    r = ws.cowfs("checkpoint", "--provider", "good", "--provider", "bad", check=False)
    assert r.returncode == DAEMON_ERROR and "provider 'bad'" in r.stderr and "broken" in r.stderr
    assert [x["id"] for x in ws.log()] == [x["id"] for x in layers]   # nothing half-taken
    assert (db.parent / "discarded").exists()                       # good's was discarded


def test_a_failing_restore_is_reported_and_the_rest_still_runs(mounted, db):
    ws = mounted
    ws.cowfs("provider", "add", "flaky", "--capture", "true", "--restore", "exit 7")
    before = ws.snapshot()
    ws.json("checkpoint", "--provider", "flaky")
    (ws / "new").write_text("x")
    r = ws.cowfs("rollback", check=False)
    assert r.returncode == PARTIAL and "restore flaky of layer" in r.stderr
    treesnap.assert_same(before, ws.snapshot())   # the files were still rolled back


def test_provider_registry_and_bad_input(mounted, db):
    ws = mounted
    add_db_provider(ws, db)
    assert [p["name"] for p in ws.json("provider", "list")] == ["db"]
    r = ws.cowfs("checkpoint", "--provider", "nope", check=False)
    assert r.returncode == USAGE and "no provider 'nope'" in r.stderr
    ws.json("checkpoint", "--provider", "db")
    r = ws.cowfs("provider", "remove", "db", check=False)
    assert r.returncode == USAGE and "has snapshots" in r.stderr
    ws.commit()                                    # its snapshot is discarded
    ws.cowfs("provider", "remove", "db")
    assert ws.json("provider", "list") == []
    ws.unmount()                                   # the registry lives in the store
    import tomllib
    assert tomllib.loads((ws / ".cowfs" / "cowfs.toml").read_text()).get("provider") == {}


def test_api_run_with_a_provider(mounted, db):
    ws = Workspace.attach(mounted.path)
    add_db_provider(mounted, db)
    result = ws.run(["sqlite3", str(db), "update t set x = 'broken'; select nope;"],
                    providers=["db"])
    assert not result.ok and result.outcome == "rolled back"
    assert sql(db, "select x from t") == "original"
