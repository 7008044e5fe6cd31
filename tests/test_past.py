"""Reading the past without restoring it (diff, show) and undoing
selectively (restore, rollback --dry-run), on real mounts.  The property
that `show` equals what `rollback --to` produces, for every layer and path,
is checked on generated histories in tests/test_model.py (show_past)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import time

import xxhash

from cowfs.errors import NOTHING_TO_DO
from cowfs.fuse.view import FSTYPE as VIEW_FSTYPE
from cowfs.layers import treesnap
from cowfs.system.mounts import mount_table


def test_diff_text_binary_stat_name_status_and_paths(mounted):
    ws = mounted
    (ws / "bin").write_bytes(bytes(range(256)) * 100)
    ws.commit()
    layer = ws.checkpoint()
    subprocess.run(["sed", "-i", "s/alpha/ALPHA/; $a omega", str(ws / "a.txt")], check=True)
    with open(ws / "bin", "r+b") as f:
        f.seek(1000)
        f.write(b"\0\0\0")
    os.rename(ws / "dir", ws / "moved")
    (ws / "moved" / "c.txt").write_text("new file\n")
    os.unlink(ws / "moved" / "b.txt")

    text = ws.cowfs("diff").stdout
    assert "--- a/a.txt\n+++ b/a.txt\n" in text and "-alpha\n+ALPHA\n+omega\n" in text
    assert "--- /dev/null\n+++ b/moved/c.txt\n" in text and "+new file\n" in text
    assert "--- a/dir/b.txt\n+++ /dev/null\n" in text and "-beta\n" in text
    old_hash = xxhash.xxh3_128_hexdigest(bytes(range(256)) * 100)
    new_hash = xxhash.xxh3_128_hexdigest((ws / "bin").read_bytes())
    assert f"Binary: 25600 bytes xxh3 {old_hash} -> 25600 bytes xxh3 {new_hash}" in text

    assert ws.cowfs("diff", "--name-status").stdout.splitlines() == [
        "M\ta.txt",
        "M\tbin",
        "D\tdir/b.txt",
        "R\tdir -> moved",
        "A\tmoved/c.txt",
    ]
    stat_lines = ws.cowfs("diff", "--stat").stdout
    assert "a.txt" in stat_lines and "+2 -1" in stat_lines and "binary 25600 bytes" in stat_lines
    only = ws.cowfs("diff", "--name-status", "--", "moved").stdout.splitlines()
    assert only == ["R\tdir -> moved", "A\tmoved/c.txt"]
    data = ws.json("diff", str(layer), "--", "a.txt")
    [entry] = data["changes"]
    assert entry["old"]["xxh3"] == xxhash.xxh3_128_hexdigest(b"alpha\n")
    assert entry["new"]["size"] == len("ALPHA\nomega\n") and entry["added"] == 2
    ws.unmount()  # the same offline
    assert ws.cowfs("diff", "--name-status").stdout.splitlines()[0] == "M\ta.txt"


def test_show_reads_any_layer_without_changing_anything(mounted):
    ws = mounted
    first = ws.checkpoint("first")
    (ws / "a.txt").write_text("second version\n")
    os.symlink("a.txt", ws / "link")
    second = ws.checkpoint("second")
    (ws / "a.txt").write_text("third version, longer than the others\n")
    os.unlink(ws / "link")
    live = ws.snapshot()
    assert ws.cowfs("show", f"{first}:a.txt").stdout == "alpha\n"
    assert ws.cowfs("show", f"{second}:a.txt").stdout == "second version\n"
    assert ws.cowfs("show", f"{second}:link").stdout == "a.txt\n"
    assert set(ws.cowfs("show", f"{first}:").stdout.split()) == {"a.txt", "dir"}
    assert set(ws.cowfs("show", f"{second}:.").stdout.split()) == {"a.txt", "dir", "link"}
    r = ws.cowfs("show", f"{first}:link", check=False)
    assert r.returncode == NOTHING_TO_DO and "did not exist when layer" in r.stderr
    r = ws.cowfs("show", "a.txt", check=False)
    assert r.returncode == 2 and "ID:PATH" in r.stderr
    r = ws.cowfs("show", f"{first}:../etc/passwd", check=False)
    assert r.returncode == 2
    treesnap.assert_same(live, ws.snapshot())  # nothing changed
    big = os.urandom(9 << 20)  # more than one page
    ws.checkpoint()
    (ws / "big").write_bytes(big)
    third = ws.checkpoint()
    (ws / "big").write_bytes(b"small now")
    out = subprocess.run([*ws_cowfs(ws), "show", f"{third}:big"], capture_output=True).stdout
    assert out == big


def ws_cowfs(ws) -> list[str]:
    from .helpers import COWFS

    return [*COWFS, "-C", str(ws.path)]


def test_restore_a_file_and_a_subtree_as_a_change_that_can_be_undone(mounted):
    ws = mounted
    (ws / "dir" / "sub").mkdir()
    (ws / "dir" / "sub" / "deep.txt").write_text("deep\n")
    os.setxattr(ws / "dir" / "sub" / "deep.txt", "user.tag", b"kept")
    os.symlink("../b.txt", ws / "dir" / "sub" / "ln")
    ws.commit()
    original = ws.snapshot()
    old = ws.checkpoint("old")
    (ws / "a.txt").write_text("edited\n")
    subprocess.run(["rm", "-rf", str(ws / "dir")], check=True)
    (ws / "keep.txt").write_text("unrelated work\n")
    ws.checkpoint("newer")
    (ws / "a.txt").write_text("edited again\n")
    before_restore = ws.snapshot()
    ws.checkpoint("restore")

    res = ws.json("restore", "--from", str(old), "dir", "a.txt")
    assert set(res["restored"]) >= {
        "dir",
        "dir/b.txt",
        "dir/sub",
        "dir/sub/deep.txt",
        "dir/sub/ln",
        "a.txt",
    }
    now = ws.snapshot()
    for path in (b"a.txt", b"dir", b"dir/b.txt", b"dir/sub", b"dir/sub/deep.txt", b"dir/sub/ln"):
        assert now[path] == original[path], path  # bytes, modes, times, xattrs
    assert (ws / "keep.txt").read_text() == "unrelated work\n"
    ws.rollback()  # the restore was a change too
    treesnap.assert_same(before_restore, ws.snapshot())


def test_restore_removes_what_did_not_exist(mounted):
    ws = mounted
    layer = ws.checkpoint()
    (ws / "dir" / "new.txt").write_text("made later\n")
    (ws / "extra").mkdir()
    ws.cowfs("restore", "--from", str(layer), "dir", "extra")
    assert not (ws / "extra").exists() and not (ws / "dir" / "new.txt").exists()
    assert (ws / "dir" / "b.txt").read_text() == "beta\n"


def test_restore_of_a_path_that_names_nothing_is_an_error(mounted):
    ws = mounted
    layer = ws.checkpoint()
    (ws / "a.txt").write_text("edited\n")
    before = ws.snapshot()
    r = ws.cowfs("restore", "--from", str(layer), "a.txt", "no/such/file", check=False)
    assert r.returncode == NOTHING_TO_DO
    assert (
        f"no/such/file: no such path, now or when layer {layer} was opened; nothing "
        "restored" in r.stderr
    )
    treesnap.assert_same(before, ws.snapshot())  # not even a.txt
    r = ws.cowfs("--json", "restore", "typo", check=False)
    assert r.returncode == NOTHING_TO_DO and json.loads(r.stdout)["code"] == NOTHING_TO_DO


def test_dry_run_lists_exactly_what_the_rollback_then_does(mounted):
    ws = mounted
    layer = ws.checkpoint()
    (ws / "a.txt").write_text("changed\n")
    os.rename(ws / "dir" / "b.txt", ws / "renamed.txt")
    (ws / "new").mkdir()
    (ws / "new" / "f").write_text("f\n")
    os.chmod(ws / "dir", 0o700)
    before = ws.snapshot()
    listed = json.loads(ws.cowfs("--json", "rollback", "--dry-run", "--to", str(layer)).stdout)
    assert ws.snapshot() == before  # a dry run changes nothing
    expected_paths = set()
    for c in listed["changes"]:
        expected_paths.add(c["path"])
        if c.get("from"):
            expected_paths.add(c["from"])
    ws.rollback(to=layer)
    after = ws.snapshot()
    changed = {os.fsdecode(p) for p in set(before) | set(after) if before.get(p) != after.get(p)}
    # every path the rollback changed was listed (a directory's mtime moves
    # with its entries, so parents of listed paths count as listed)
    parents = {os.path.dirname(p) or "." for p in expected_paths}
    assert changed <= expected_paths | parents, changed - expected_paths
    assert expected_paths <= changed
    assert {(c["kind"], c["path"]) for c in listed["changes"]} == {
        ("M", "a.txt"),
        ("m", "dir"),
        ("R", "renamed.txt"),
        ("A", "new"),
        ("A", "new/f"),
    }


@contextlib.contextmanager
def view_of(ws, layer: int, where):
    """`cowfs view LAYER WHERE`, always unmounted afterwards."""
    where.mkdir()
    ws.cowfs("view", str(layer), where)
    try:
        yield where
    finally:
        if mount_table().get(str(where)) == VIEW_FSTYPE:
            r = ws.cowfs("unmount", where, check=False)
            if r.returncode != 0 or str(where) in mount_table():
                subprocess.run(["umount", "-l", str(where)], capture_output=True)
        assert str(where) not in mount_table()


def test_view_is_the_past_read_only_and_ends_with_its_layer(mounted, tmp_path):
    ws = mounted
    os.link(ws / "a.txt", ws / "dir" / "hard")
    os.setxattr(ws / "a.txt", "user.k", b"v")
    layer = ws.checkpoint("viewed")
    then = ws.snapshot()
    (ws / "a.txt").write_text("changed after\n")
    subprocess.run(["rm", "-rf", str(ws / "dir")], check=True)
    (ws / "new").mkdir()
    with view_of(ws, layer, tmp_path / "view") as v:
        treesnap.assert_same(then, treesnap.snapshot(v))  # mtimes, links, xattrs
        for attempt in (
            lambda: open(v / "x", "w"),
            lambda: (v / "a.txt").write_text("no"),
            lambda: os.mkdir(v / "d2"),
            lambda: os.unlink(v / "a.txt"),
        ):
            try:
                attempt()
            except OSError as e:
                assert e.errno == errno.EROFS
            else:
                raise AssertionError("the view took a write")
        (ws / "a.txt").write_text("changed again, while viewed\n")  # captured first
        assert (v / "a.txt").read_text() == "alpha\n"
        assert ws.cowfs("unmount", v).returncode == 0
        assert str(v) not in mount_table()
    with view_of(ws, layer, tmp_path / "view2") as v:
        ws.rollback(to=layer)  # its layer is gone
        try:
            os.stat(v / "a.txt")
        except OSError as e:
            assert e.errno == errno.ESTALE
        else:
            raise AssertionError("a view outlived its layer")


def test_a_view_follows_a_busy_workspace_and_stays_its_layers_past(mounted, tmp_path):
    """A view reads the records the daemon appends since it last looked,
    and all of them again only when records it read were deleted or put
    back (a rollback or a commit above its layer): whichever, it shows the
    tree as it was when its layer was opened."""
    ws = mounted
    for i in range(200):
        (ws / "dir" / f"f{i}").write_text(f"file {i}\n")
    os.link(ws / "a.txt", ws / "dir" / "hard")
    layer = ws.checkpoint("viewed")
    then = ws.snapshot()

    def same_as_then(v) -> None:
        time.sleep(1.1)  # (what the kernel holds of the view lasts a second)
        treesnap.assert_same(then, treesnap.snapshot(v))

    with view_of(ws, layer, tmp_path / "view") as v:
        same_as_then(v)
        # records appended: writes, renames, removals, new names
        for i in range(0, 200, 2):
            with open(ws / "dir" / f"f{i}", "a") as f:
                f.write("more\n")
        os.rename(ws / "dir", ws / "moved")
        for i in range(1, 200, 3):
            os.unlink(ws / "moved" / f"f{i}")
        os.rename(ws / "moved" / "f0", ws / "a.txt")
        (ws / "dir").mkdir()
        (ws / "dir" / "b.txt").write_text("another b\n")
        assert (v / "dir" / "f0").read_text() == "file 0\n"
        same_as_then(v)
        # a layer above rolled back: its records are deleted
        above = ws.checkpoint("above")
        (ws / "dir" / "b.txt").write_text("in the layer above\n")
        os.unlink(ws / "a.txt")
        same_as_then(v)  # (the view reads them before they go)
        ws.rollback(to=above)
        same_as_then(v)
        # a layer above committed into the one below it
        ws.checkpoint("to merge")
        os.rename(ws / "dir" / "b.txt", ws / "dir" / "c.txt")
        same_as_then(v)
        ws.commit()
        same_as_then(v)
        (ws / "dir" / "c.txt").write_text("after the commit\n")
        same_as_then(v)


def test_a_view_counts_only_the_names_an_object_had_then(mounted, tmp_path):
    """A hard link made after the viewed layer opened, then replaced by a
    rename over it or removed, is no name the object had then: the view
    shows the link count of that time (found by the model test)."""
    ws = mounted
    (ws / "b.txt").write_text("bravo\n")
    (ws / "c.txt").write_text("charlie\n")
    layer = ws.checkpoint("viewed")
    then = ws.snapshot()
    os.link(ws / "a.txt", ws / "dir" / "to-a")
    os.link(ws / "c.txt", ws / "dir" / "to-c")
    ws.checkpoint("later")
    os.rename(ws / "b.txt", ws / "dir" / "to-a")  # over the link
    os.unlink(ws / "dir" / "to-c")
    with view_of(ws, layer, tmp_path / "view") as v:
        treesnap.assert_same(then, treesnap.snapshot(v))
        assert os.stat(v / "a.txt").st_nlink == os.stat(v / "c.txt").st_nlink == 1
    ws.rollback(to=layer)
    treesnap.assert_same(then, ws.snapshot())


def test_a_view_numbers_each_object_as_the_mount_does_however_often_it_is_forgotten(
    mounted, tmp_path
):
    """A view gives an object its own inode number, as the mount does (the
    number the file had then, which the mount shows too while the object
    lives), and the same number when the kernel has forgotten it and looks
    it up again -- tar, rsync -H, du and find -samefile tell hard links
    apart by it; a directory walked twice sees the same numbers."""
    ws = mounted
    os.link(ws / "a.txt", ws / "dir" / "hard")
    (ws / "dir" / "deep").mkdir()
    (ws / "dir" / "deep" / "f").write_text("f\n")
    layer = ws.checkpoint("viewed")
    names = ["a.txt", "dir/hard", "dir", "dir/deep", "dir/deep/f"]
    live = {n: os.lstat(ws / n).st_ino for n in names}
    (ws / "a.txt").write_text("changed after\n")
    os.rename(ws / "dir" / "deep", ws / "moved")
    with view_of(ws, layer, tmp_path / "view") as v:
        first = {n: os.lstat(v / n).st_ino for n in names}
        assert first == live
        assert first["a.txt"] == first["dir/hard"]
        walked = {
            os.path.relpath(os.path.join(d, n), v) for d, ds, fs in os.walk(v) for n in ds + fs
        }
        assert set(names) <= walked
        for _ in range(2):  # the kernel forgets every entry it can, then looks them up again
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("2")
            assert {n: os.lstat(v / n).st_ino for n in names} == first
            for d, ds, fs in os.walk(v):
                for n in ds + fs:
                    rel = os.path.relpath(os.path.join(d, n), v)
                    if rel in first:
                        assert os.lstat(os.path.join(d, n)).st_ino == first[rel], rel


def test_view_of_an_unmounted_workspace(mounted, tmp_path):
    ws = mounted
    layer = ws.checkpoint()
    then = ws.snapshot()
    (ws / "a.txt").write_text("later\n")
    ws.unmount()
    with view_of(ws, layer, tmp_path / "view") as v:
        treesnap.assert_same(then, treesnap.snapshot(v))


def test_changes_are_attributed_to_the_process_that_first_made_them(mounted):
    ws = mounted
    ws.checkpoint("two programs")
    subprocess.run(["sed", "-i", "s/alpha/ALPHA/", "a.txt"], cwd=ws.path, check=True)
    script = "open('made.py', 'w').write('x = 1\\n'); open('a.txt', 'a').write('more\\n')"
    subprocess.run([sys.executable, "-c", script], cwd=ws.path, check=True)
    os.mkdir(ws / "by-the-test")
    changes = {c["path"]: c["who"] for c in ws.status()}
    assert changes["a.txt"]["cmd"][:2] == ["sed", "-i"]  # the first to change it
    assert changes["made.py"]["cmd"][1:3] == ["-c", script]
    assert changes["by-the-test"]["pid"] == os.getpid()
    assert all(w["uid"] == os.getuid() for w in changes.values())
    assert (
        "\tpid " in ws.cowfs("status", "--who").stdout
        and "sed -i" in ws.cowfs("status", "--who").stdout
    )
    names = ws.cowfs("diff", "--name-status", "--who").stdout
    assert any(line.startswith("M\ta.txt\tpid ") and "sed" in line for line in names.splitlines())
    ws.checkpoint("later")
    subprocess.run(["touch", "a.txt"], cwd=ws.path, check=True)
    ws.commit()  # merged: the older entry wins
    assert {c["path"]: c["who"]["cmd"][0] for c in ws.status()}["a.txt"] == "sed"


def test_restore_links_names_that_were_one_object_and_writes_through_no_other(mounted):
    ws = mounted
    (ws / "dir" / "twin").write_text("twin\n")
    os.link(ws / "dir" / "twin", ws / "dir" / "twin2")  # one object, two names
    ws.commit()
    original = ws.snapshot()
    layer = ws.checkpoint()
    (ws / "dir" / "twin").write_text("changed through one name\n")
    os.unlink(ws / "dir" / "twin2")
    (ws / "dir" / "twin2").write_text("a file of its own now\n")
    os.link(ws / "a.txt", ws / "alias")  # a.txt gets a second name
    with open(ws / "alias", "w") as f:
        f.write("edited through the alias\n")

    ws.cowfs("restore", "--from", str(layer), "dir", "a.txt")
    now = ws.snapshot()
    for path in (b"dir", b"dir/twin", b"dir/twin2", b"a.txt"):
        assert now[path] == original[path], path  # linked again, as then
    assert os.stat(ws / "dir" / "twin").st_ino == os.stat(ws / "dir" / "twin2").st_ino
    assert os.stat(ws / "dir" / "twin").st_nlink == 2
    # the alias made later keeps its content: restoring a.txt wrote nothing through it
    assert (ws / "alias").read_text() == "edited through the alias\n"
    assert os.stat(ws / "alias").st_nlink == 1


def test_diff_of_content_put_back_says_so_and_shows_what_differs(mounted):
    ws = mounted
    os.utime(ws / "a.txt", ns=(10**18, 10**18))
    ws.commit()
    layer = ws.checkpoint()
    (ws / "a.txt").write_text("changed\n")
    (ws / "a.txt").write_text("alpha\n")  # the same bytes again
    os.chmod(ws / "a.txt", 0o600)
    text = ws.cowfs("diff", str(layer)).stdout
    digest = xxhash.xxh3_128_hexdigest(b"alpha\n")
    assert (
        f"diff --cowfs m a.txt\ncontent unchanged (6 bytes xxh3 {digest})\n"
        "mode 100644 -> 100600\nmtime 2001-09-09T01:46:40.000000000Z -> " in text
    )
    assert (
        ws.cowfs("diff", "--stat", str(layer)).stdout.split("|")[1].strip() == "content unchanged"
    )


def test_a_diff_too_large_for_text_says_so_and_a_one_line_edit_is_still_text(mounted):
    """A text diff costs difflib about lines x changed lines: past a bound
    the change is reported by sizes and hashes; a one-line edit of a big
    file is still a text diff."""
    ws = mounted
    (ws / "mid.txt").write_text("".join(f"{i}\n" for i in range(1, 200_001)))
    (ws / "big.txt").write_text("".join(f"{i}\n" for i in range(1, 300_001)))
    layer = ws.checkpoint()
    subprocess.run(["sed", "-i", "s/5$/five/", str(ws / "mid.txt")], check=True)
    subprocess.run(["sed", "-i", "150000s/.*/changed/", str(ws / "big.txt")], check=True)
    t0 = time.monotonic()
    res = ws.json("diff", str(layer))
    assert time.monotonic() - t0 < 60
    by = {c["path"]: c for c in res["changes"]}
    assert by["mid.txt"].get("too_large") and "diff" not in by["mid.txt"]
    assert by["mid.txt"]["old"]["xxh3"] != by["mid.txt"]["new"]["xxh3"]
    assert by["big.txt"]["added"] == 1 and "+changed" in by["big.txt"]["diff"]
    text = ws.cowfs("diff", str(layer), "--", "mid.txt").stdout
    assert "too many lines to diff" in text


def test_an_ended_view_leaves_no_zombie_behind(mounted, view_dir):
    ws = mounted
    layer = ws.checkpoint()
    daemon = ws.daemon_pid()

    def zombies() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "Z" and int(fields[1]) == daemon:
                found.append(int(pid))
        return found

    for _ in range(2):
        ws.cowfs("view", str(layer), view_dir)
        ws.cowfs("unmount", view_dir)
    deadline = time.monotonic() + 15
    while zombies() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert zombies() == []
