"""What counts as a change: `status`, `diff`, `rollback --dry-run` and
`run`'s summary list a path only when its state differs from its state at
the layer's start -- bytes, type, mode, owner, xattrs, symlink target --
however many times it changed in between, and whichever objects held it.
Equal bytes with another mode, owner or xattrs is an attribute change
(``m``), not ``M``; one with another mtime only is ``t``, counted and
listed with --times."""

from __future__ import annotations

import os
import subprocess

from cowfs.layers import treesnap


def kinds(ws, *args) -> dict[str, str]:
    return {c["path"]: c["kind"] for c in ws.json(*args)["changes"]}


def test_a_restored_subtree_is_no_change(mounted):
    ws = mounted
    (ws / "dir" / "sub").mkdir()
    for i in range(20):
        (ws / "dir" / "sub" / f"f{i}.txt").write_text(f"file {i}\n" * (i + 1))
    os.setxattr(ws / "dir" / "sub" / "f1.txt", "user.tag", b"kept")
    os.symlink("f1.txt", ws / "dir" / "sub" / "ln")
    ws.commit()
    start = ws.snapshot()
    layer = ws.checkpoint("edit")
    for i in range(0, 20, 2):
        (ws / "dir" / "sub" / f"f{i}.txt").write_text("edited\n")
    os.chmod(ws / "dir" / "sub" / "f3.txt", 0o600)
    os.removexattr(ws / "dir" / "sub" / "f1.txt", "user.tag")
    os.unlink(ws / "dir" / "sub" / "ln")
    os.symlink("elsewhere", ws / "dir" / "sub" / "ln")
    assert len(kinds(ws, "status")) > 10
    ws.cowfs("restore", "--from", str(layer), "dir")
    treesnap.assert_same(start, ws.snapshot())
    assert kinds(ws, "status") == {}
    assert ws.json("diff")["changes"] == []
    assert ws.json("rollback", "--dry-run")["changes"] == []


def test_equal_bytes_with_a_new_time_is_a_time_change_listed_when_asked(mounted):
    ws = mounted
    (ws / "same.txt").write_text("one\ntwo\n")
    (ws / "edited.txt").write_text("one\ntwo\n")
    ws.commit()
    ws.checkpoint()
    # sed -i writes a new file and renames it over the old one, even when
    # nothing matched: same bytes, same mode, a new mtime
    subprocess.run(["sed", "-i", "s/nomatch/x/", str(ws / "same.txt")], check=True)
    subprocess.run(["sed", "-i", "s/one/ONE/", str(ws / "edited.txt")], check=True)
    # written in place with the same bytes again
    (ws / "a.txt").write_text("changed\n")
    (ws / "a.txt").write_text("alpha\n")
    # the same bytes with another mtime: left out, counted, listed with --times
    assert kinds(ws, "status") == {"edited.txt": "M"}
    assert ws.json("status")["times_only"] == 2
    assert kinds(ws, "status", "--times") == {"same.txt": "t", "edited.txt": "M", "a.txt": "t"}
    assert "# 2 paths differ only in their modification times (--times lists them)" in (
        ws.cowfs("status").stdout
    )
    assert {c["path"]: c["kind"] for c in ws.json("diff", "--times")["changes"]} == kinds(
        ws, "status", "--times"
    )
    assert "mtime " in ws.cowfs("diff", "--times", "--", "same.txt").stdout
    assert ws.json("rollback", "--dry-run")["times_only"] == 2
    # another mode with them: an attribute change
    os.chmod(ws / "same.txt", 0o600)
    assert kinds(ws, "status") == {"edited.txt": "M", "same.txt": "m"}


def test_a_path_whose_whole_state_is_back_is_no_change(mounted):
    ws = mounted
    st = os.stat(ws / "a.txt")
    (ws / "big").write_bytes(os.urandom(300_000))
    ws.commit()
    big = (ws / "big").read_bytes()
    bst = os.stat(ws / "big")
    ws.checkpoint()
    # bytes in place, then back, with the times put back too
    (ws / "a.txt").write_text("changed\n")
    (ws / "a.txt").write_text("alpha\n")
    os.utime(ws / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns))
    with open(ws / "big", "r+b") as f:  # chunks in the middle, and a tail
        f.seek(100_000)
        f.write(b"x" * 70_000)
        f.truncate(250_000)
        f.seek(100_000)
        f.write(big[100_000:])
    os.utime(ws / "big", ns=(bst.st_atime_ns, bst.st_mtime_ns))
    # mode and xattrs there and back
    os.chmod(ws / "dir" / "b.txt", 0o600)
    os.chmod(ws / "dir" / "b.txt", 0o644)
    os.setxattr(ws / "dir", "user.x", b"1")
    os.removexattr(ws / "dir", "user.x")
    # removed and made again exactly as it was
    bt = os.stat(ws / "dir" / "b.txt")
    os.unlink(ws / "dir" / "b.txt")
    (ws / "dir" / "b.txt").write_text("beta\n")
    os.utime(ws / "dir" / "b.txt", ns=(bt.st_atime_ns, bt.st_mtime_ns))
    assert kinds(ws, "status") == {}
    # one byte different is a modification, even with the same size and times
    with open(ws / "big", "r+b") as f:
        f.seek(200_000)
        f.write(b"!" if big[200_000:200_001] != b"!" else b"?")
    os.utime(ws / "big", ns=(bst.st_atime_ns, bst.st_mtime_ns))
    assert kinds(ws, "status") == {"big": "M"}


def test_changes_since_an_older_layer_compare_with_that_layers_start(mounted):
    ws = mounted
    first = ws.checkpoint("one")
    os.chmod(ws / "a.txt", 0o600)
    (ws / "dir" / "b.txt").write_text("beta 2\n")
    ws.checkpoint("two")
    os.chmod(ws / "a.txt", 0o644)  # back as it was before "one"
    (ws / "dir" / "b.txt").write_text("beta 3\n")
    since_first = {c["path"]: c["kind"] for c in ws.json("diff", str(first))["changes"]}
    assert since_first == {"dir/b.txt": "M"}
    assert kinds(ws, "status") == {"a.txt": "m", "dir/b.txt": "M"}
    assert {c["path"] for c in ws.json("rollback", "--dry-run", "--to", str(first))["changes"]} == {
        "dir/b.txt"
    }


def _kept_and_fresh(ws) -> list[dict]:
    """`status` from the daemon's kept readings, which must be what a daemon
    that reads the journal afresh (after a remount) says."""
    kept = ws.status()
    ws.unmount()
    ws.mount()
    fresh = ws.status()
    assert kept == fresh
    return kept


def test_status_from_kept_readings_is_status_read_afresh_after_every_operation(mounted):
    """The daemon keeps what it read of the journal and feeds it every
    record written since; a rollback, a redo and a commit delete or move
    records, after which it reads again.  Across them all, with changes
    in between, its `status` is the one a fresh daemon gives."""
    ws = mounted
    (ws / "src" / "pkg").mkdir(parents=True)
    for i in range(20):
        (ws / "src" / "pkg" / f"m{i}.py").write_text(f"x = {i}\n")
    (ws / "elsewhere").mkdir()
    (ws / "elsewhere" / "notes.txt").write_text("notes\n")
    ws.commit()

    def work(tag: str) -> None:
        for i in range(0, 20, 2):
            f = ws / "src" / "pkg" / f"m{i}.py"
            if f.exists():
                subprocess.run(["sed", "-i", f"s/$/ # {tag}/", str(f)], check=True)
        (ws / "src" / f"new-{tag}").mkdir()
        (ws / "src" / f"new-{tag}" / "a.txt").write_text(tag)
        os.rename(ws / "src" / f"new-{tag}", ws / f"moved-{tag}")
        if (ws / "src" / "pkg" / "m3.py").exists():
            os.unlink(ws / "src" / "pkg" / "m3.py")
        os.chmod(ws / "src" / "pkg" / "m5.py", 0o600)

    ws.status()  # (a reading kept from here on)
    ws.checkpoint("one")
    work("one")
    assert _kept_and_fresh(ws)
    ws.status()
    ws.rollback()
    assert _kept_and_fresh(ws) == []
    # changes since the rollback, where the redo does not act
    (ws / "elsewhere" / "t.tmp").write_text("later\n")
    os.rename(ws / "elsewhere" / "t.tmp", ws / "elsewhere" / "t")
    subprocess.run(["sed", "-i", "s/$/ and more/", str(ws / "elsewhere" / "notes.txt")], check=True)
    assert _kept_and_fresh(ws)
    ws.status()
    ws.json("redo")
    redone = _kept_and_fresh(ws)
    assert {"moved-one", "elsewhere/t", "elsewhere/notes.txt"} <= {c["path"] for c in redone}
    ws.status()
    ws.commit()  # (into the base layer, which still shows them)
    assert _kept_and_fresh(ws) == redone
    ws.checkpoint("three")
    work("three")
    ws.status()
    ws.commit()  # (into the base layer)
    assert _kept_and_fresh(ws)


def _tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        os.utime(p, ns=(1_000_000_000, 1_000_000_000))


def _link(ws, target: str) -> None:
    os.symlink(target, ws / "t" / "d" / "ln")
    os.utime(ws / "t" / "d" / "ln", ns=(1_000_000_000, 1_000_000_000), follow_symlinks=False)


def test_a_tree_removed_and_made_again_as_it_was_is_no_change(mounted):
    """Net changes compare what each path holds at the layer's start with
    what it holds now, whatever happened to the objects in between: a
    directory removed with everything in it and made again holding the same
    (the way `rm -rf node_modules && npm ci` does) is no change; where it
    differs, the path is M, T or m; A and D only where the path does not
    exist on one side."""
    ws = mounted
    files = {f"t/d/{n}/f{i}.txt": f"{n} {i}\n" for n in ("x", "y") for i in range(6)}
    files["t/d/g"] = "b\n"
    _tree(ws, files)
    _link(ws, "g")
    ws.commit()
    layer = ws.checkpoint("again")
    subprocess.run(["rm", "-rf", str(ws / "t" / "d")], check=True)
    _tree(ws, files)
    _link(ws, "g")
    assert kinds(ws, "status") == {}
    assert ws.json("diff")["changes"] == []
    assert ws.json("rollback", "--dry-run")["changes"] == []
    assert [x["changes"] for x in ws.json("log") if x["id"] == layer] == [0]
    # now some of it differs
    subprocess.run(["rm", "-rf", str(ws / "t" / "d")], check=True)
    changed = dict(files)
    changed["t/d/x/f1.txt"] = "other\n"  # other bytes
    del changed["t/d/y/f2.txt"]  # gone
    changed["t/d/y/new.txt"] = "new\n"  # new
    _tree(ws, changed)
    os.chmod(ws / "t" / "d" / "x" / "f3.txt", 0o600)  # another mode
    (ws / "t" / "d" / "g").unlink()
    (ws / "t" / "d" / "g").mkdir()  # another type
    _link(ws, "elsewhere")  # another target
    assert kinds(ws, "status") == {
        "t/d/x/f1.txt": "M",
        "t/d/x/f3.txt": "m",
        "t/d/y/f2.txt": "D",
        "t/d/y/new.txt": "A",
        "t/d/g": "T",
        "t/d/ln": "M",
    }
    diff = {c["path"]: c for c in ws.json("diff")["changes"]}
    assert set(diff) == set(kinds(ws, "status"))
    ws.rollback()
    assert kinds(ws, "status") == {}


def test_a_layers_count_in_log_is_what_it_changed_whatever_the_layers_above_do(mounted):
    """`log` counts each layer's own net changes -- its start compared with
    its end, the tree when the layer above was opened -- so what a layer
    above does to the same paths, and rolling it back, leaves the count of
    the layer below as it was."""
    ws = mounted

    def counts() -> dict[int, tuple[int, int]]:
        return {x["id"]: (x["changes"], x["times_only"]) for x in ws.json("log")}

    one = ws.checkpoint("one")
    (ws / "made").mkdir()
    for i in range(12):
        (ws / "made" / f"f{i}").write_text(f"{i}\n")
    (ws / "a.txt").write_text("one\n")
    os.chmod(ws / "dir" / "b.txt", 0o600)
    (ws / "c.txt").write_text("gamma\n")
    two = ws.checkpoint("two")
    after_one = counts()
    assert after_one[one] == (16, 0), after_one  # (made, its 12 files, a, b, c)
    # the layer above changes the same paths every way it can
    subprocess.run(["rm", "-rf", str(ws / "made" / "f1"), str(ws / "made" / "f2")], check=True)
    os.rename(ws / "made", ws / "moved")
    (ws / "a.txt").write_text("two\n")
    os.chmod(ws / "dir" / "b.txt", 0o644)
    os.unlink(ws / "c.txt")
    os.mkdir(ws / "c.txt")
    (ws / "more").write_text("more\n")
    assert counts()[one] == after_one[one]
    assert counts()[two][0] == 7, counts()  # (R, D, D, M, m, T, A)
    ws.checkpoint("three")
    (ws / "moved" / "f3").write_text("three\n")
    assert counts()[one] == after_one[one]
    ws.rollback()  # three
    assert counts()[one] == after_one[one]
    ws.rollback()  # two: one is the open layer again
    assert counts() == {k: v for k, v in after_one.items() if k != two}
    # one grows and is closed again: counted afresh (its end moved), as is a
    # layer a commit merged into one
    (ws / "later").write_text("later\n")
    ws.checkpoint("four")
    assert counts()[one] == (after_one[one][0] + 1, 0)
    (ws / "later2").write_text("later\n")
    ws.checkpoint("five")
    ws.commit()  # five (empty) into four
    ws.commit()  # four into one
    (ws / "later3").write_text("later\n")
    ws.checkpoint("six")
    assert counts()[one] == (after_one[one][0] + 3, 0)


def test_run_says_a_step_that_only_touched_files_changed_nothing_but_their_times(mounted):
    ws = mounted
    r = ws.cowfs("run", "--", "touch", "a.txt", "dir/b.txt")
    assert r.stderr.splitlines()[:2] == [
        "no changes",
        "2 paths differ only in their modification times (--times lists them)",
    ], r.stderr
    r = ws.cowfs("run", "--", "sh", "-c", "touch a.txt && echo x >> dir/b.txt")
    assert r.stderr.splitlines()[:3] == [
        "1 change: 1 modified",
        "1 path differs only in its modification time (--times lists it)",
        "  M dir/b.txt",
    ], r.stderr
    assert ws.json("run", "--", "touch", "a.txt")["times_only"] == 1
