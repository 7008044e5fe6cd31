"""The audit log: an event stream that survives commits (mount,
checkpoint, commit, rollback, restore, and every change with path, kind,
sizes, xxh3 before and after, and its writer)."""

from __future__ import annotations

import json
import subprocess

import xxhash

from cowfs.errors import UNKNOWN_LAYER


def events(ws, *args) -> list[dict]:
    return [json.loads(line) for line in ws.cowfs("audit", "--jsonl", *args).stdout.splitlines()]


def test_audit_records_kept_and_undone_changes_with_hashes_and_writers(mounted):
    ws = mounted
    layer = ws.checkpoint("edit")
    subprocess.run(["sed", "-i", "s/alpha/ALPHA/", "a.txt"], cwd=ws.path, check=True)
    (ws / "new.bin").write_bytes(b"\x00\x01" * 1000)
    ws.commit()  # kept: into the base
    ws.checkpoint("undone")
    (ws / "dir" / "b.txt").unlink()
    ws.rollback()
    ws.commit()  # the base: permanent
    ev = events(ws)
    kinds = [e["event"] for e in ev]
    assert kinds[0] == "mount" and "checkpoint" in kinds and kinds.count("commit") == 2
    commit = next(e for e in ev if e["event"] == "commit" and e["layer"] == layer)
    assert commit["into"] is not None and commit["changes"] == 2
    changes = {e["path"]: e for e in ev if e["event"] == "change" and not e.get("undone")}
    a = changes["a.txt"]
    assert a["kind"] == "M" and a["who"]["cmd"][0] == "sed"
    assert a["before"]["xxh3"] == xxhash.xxh3_128_hexdigest(b"alpha\n")
    assert a["after"]["xxh3"] == xxhash.xxh3_128_hexdigest((ws / "a.txt").read_bytes())
    assert a["before"]["size"] == 6 and a["after"]["size"] == 6
    new = changes["new.bin"]
    assert new["kind"] == "A" and new["before"] is None
    assert new["after"]["xxh3"] == xxhash.xxh3_128_hexdigest(b"\x00\x01" * 1000)
    undone = [e for e in ev if e.get("undone")]
    assert [(e["kind"], e["path"]) for e in undone] == [("D", "dir/b.txt")]
    rollback = next(e for e in ev if e["event"] == "rollback")
    assert rollback["failures"] == []
    # it survives the commits and the unmount, and reads offline
    ws.unmount()
    offline = events(ws)
    assert offline[: len(ev)] == ev and offline[-1]["event"] == "unmount"
    assert ws.cowfs("audit").stdout.count("sed -i") >= 1
    since = events(ws, "--since", str(layer))
    assert since[0]["event"] == "checkpoint" and since[0]["layer"] == layer


def test_restore_is_audited_and_retention_is_separate(mounted):
    ws = mounted
    layer = ws.checkpoint()
    (ws / "a.txt").write_text("changed\n")
    ws.cowfs("restore", "--from", str(layer), "a.txt")
    restore = [e for e in events(ws) if e["event"] == "restore"]
    assert restore and restore[0]["paths"] == ["a.txt"] and restore[0]["restored"] == ["a.txt"]
    before = len(events(ws))
    assert ws.json("audit", "--prune", "1")["pruned"] == 0  # nothing a day old
    assert ws.json("audit", "--prune", "0")["pruned"] == before  # everything so far
    assert events(ws) == []
    ws.checkpoint()  # logging goes on
    assert [e["event"] for e in events(ws)] == ["checkpoint"]


def test_audit_level_is_a_mount_option_kept_in_the_store(workspace):
    ws = workspace
    (ws / "f").write_text("one\n")
    ws.mount("--audit", "changes")
    ws.checkpoint()
    (ws / "f").write_text("two\n")
    ws.commit()
    [change] = [e for e in events(ws) if e["event"] == "change"]
    assert change["path"] == "f" and "before" not in change and "who" in change
    ws.unmount()
    ws.mount("--audit", "events")
    ws.checkpoint()
    (ws / "f").write_text("three\n")
    ws.commit()
    ws.unmount()
    ws.mount()  # kept
    ws.checkpoint()
    (ws / "f").write_text("four\n")
    ws.commit()
    assert len([e for e in events(ws) if e["event"] == "change"]) == 1
    assert [e["event"] for e in events(ws)].count("commit") == 3


def test_audit_since_a_layer_that_never_was_is_an_error(mounted):
    ws = mounted
    gone = ws.checkpoint("rolled back")
    (ws / "a.txt").write_text("x\n")
    ws.rollback()
    r = ws.cowfs("audit", "--since", "99", check=False)
    assert r.returncode == UNKNOWN_LAYER and "no layer 99" in r.stderr, r.stderr
    # a layer that existed once still starts the log at its checkpoint
    assert events(ws, "--since", str(gone))[0]["event"] == "checkpoint"
