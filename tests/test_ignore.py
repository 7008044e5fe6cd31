"""Capture filters: .cowfsignore (gitignore syntax) and --ignore PATTERN.
Changes under matching paths are not captured, status and diff omit them,
rollback leaves them as they are; the filter never hides a change of a
path it does not match."""

from __future__ import annotations

import os
import subprocess
import sys

from cowfs.layers import treesnap

from .helpers import plain

TRICKY = """\
# a comment, then patterns
*.log
!keep.log
/build
tmp/
**/cache/*.bin
\\#literal
"""

IGNORED = ["a.log", "sub/b.log", "build/out", "tmp/t", "sub/tmp/t", "x/cache/c.bin"]
CAPTURED = [
    "keep.log",
    "a.logx",
    "sub/build/out",
    "tmp-file",
    "tmpx/t",
    "x/cache/c.txt",
    "x/cache/deeper/c.bin.txt",
    "#literal.txt",
    "plain.txt",
]


def write_all(root, paths, text):
    for p in paths:
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_text(text)


def test_tricky_patterns_capture_exactly_what_they_do_not_match(workspace):
    ws = workspace
    (ws / ".cowfsignore").write_text(TRICKY)
    (ws / "tmp-file").write_text("a file, not the tmp/ directory\n")
    write_all(ws, IGNORED + CAPTURED, "before\n")
    ws.mount()
    before = ws.snapshot()
    ws.checkpoint()
    write_all(ws, IGNORED + CAPTURED, "after, and longer\n")
    listed = {c["path"] for c in plain(ws.status())}
    assert listed == set(CAPTURED), listed ^ set(CAPTURED)
    assert {c["path"] for c in ws.json("diff")["changes"]} == set(CAPTURED)
    ws.rollback()
    after = ws.snapshot()
    for p in CAPTURED:  # restored exactly
        assert after[os.fsencode(p)] == before[os.fsencode(p)], p
    for p in IGNORED:  # left as they are
        assert (ws / p).read_text() == "after, and longer\n", p


def test_compileall_caches_cost_nothing_and_survive_rollback(workspace):
    ws = workspace
    (ws / ".cowfsignore").write_text("__pycache__/\n")
    pkg = ws / "pkg"
    pkg.mkdir()
    for i in range(20):
        (pkg / f"m{i}.py").write_text(f"VALUE = {i}\n")
    ws.mount()
    ws.checkpoint()
    bytes_before = ws.log()[-1]["bytes"]
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(pkg)], check=True)
    assert (pkg / "__pycache__").is_dir()
    assert ws.status() == [] and ws.log()[-1]["bytes"] == bytes_before
    (pkg / "m3.py").write_text("VALUE = 'changed'\n")
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(pkg)], check=True)
    assert [c["path"] for c in plain(ws.status())] == ["pkg/m3.py"]
    caches = sorted(os.listdir(pkg / "__pycache__"))
    ws.rollback()
    assert (pkg / "m3.py").read_text() == "VALUE = 3\n"
    assert sorted(os.listdir(pkg / "__pycache__")) == caches  # left as they are


def with_scratch(ws):
    """An ignored scratch/ directory and a captured data.txt, mounted."""
    (ws / ".cowfsignore").write_text("scratch/\n")
    (ws / "scratch").mkdir()
    (ws / "data.txt").write_text("precious\n")
    ws.mount()
    return ws


def test_a_tracked_file_moved_into_an_ignored_path_stays_captured(workspace):
    ws = with_scratch(workspace)
    before = ws.snapshot(exclude=(b".cowfs", b"scratch"))
    ws.checkpoint()
    os.rename(ws / "data.txt", ws / "scratch" / "data.txt")
    with open(ws / "scratch" / "data.txt", "a") as f:  # changed at the ignored path
        f.write("scribbled on\n")
    ws.unmount()  # (pinned across mounts too)
    ws.mount()
    with open(ws / "scratch" / "data.txt", "a") as f:
        f.write("more\n")
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot(exclude=(b".cowfs", b"scratch")))
    assert (ws / "data.txt").read_text() == "precious\n"


def test_a_new_directory_goes_with_the_ignored_files_in_it(workspace):
    ws = workspace
    (ws / ".cowfsignore").write_text("*.o\n")
    ws.mount()
    before = ws.snapshot()
    ws.checkpoint()
    (ws / "src").mkdir()
    (ws / "src" / "main.c").write_text("int main;\n")
    (ws / "src" / "main.o").write_bytes(b"\x7fELF")
    (ws / "src" / "deep").mkdir()
    (ws / "src" / "deep" / "x.o").write_bytes(b"obj")
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def test_ignored_files_that_existed_are_not_kept_and_ignore_option(workspace):
    ws = workspace
    (ws / "old.tmp").write_text("scratch\n")
    (ws / "real.txt").write_text("real\n")
    ws.mount("--ignore", "*.tmp")
    ws.checkpoint()
    os.unlink(ws / "old.tmp")
    os.unlink(ws / "real.txt")
    assert [c["path"] for c in plain(ws.status())] == ["real.txt"]
    ws.rollback()
    assert (ws / "real.txt").read_text() == "real\n" and not (ws / "old.tmp").exists()
    ws.unmount()
    ws.mount()  # the pattern was kept
    (ws / "new.tmp").write_text("x\n")
    assert ws.status() == []
    ws.unmount()
    ws.mount("--ignore", "")  # and can be cleared
    (ws / "other.tmp").write_text("x\n")
    assert [c["path"] for c in plain(ws.status())] == ["other.tmp"]


def test_an_ignored_file_renamed_over_a_captured_one_does_not_lose_it(workspace):
    ws = with_scratch(workspace)
    ws.checkpoint()
    os.rename(ws / "data.txt", ws / "scratch" / "data.txt")  # captured: stays so
    (ws / "scratch" / "tmp").write_text("scratch work\n")
    os.rename(ws / "scratch" / "tmp", ws / "scratch" / "data.txt")
    ws.rollback()
    assert (ws / "data.txt").read_text() == "precious\n"


def test_cowfsignore_edited_through_the_mount_applies_to_the_very_next_request(workspace):
    """Written in place, appended to, replaced by a rename (as editors save),
    removed: each edit decides the very next change's capture, with no
    pause in between."""
    ws = workspace
    ws.mount()
    ws.checkpoint()
    ignore = ws / ".cowfsignore"

    def captured(path: str) -> bool:
        (ws / path).parent.mkdir(parents=True, exist_ok=True)
        (ws / path).write_text("x\n")
        return path in {c["path"] for c in plain(ws.status())}

    ignore.write_text("one/\n")  # written in place
    assert not captured("one/a") and captured("two/a")
    with open(ignore, "a") as f:  # appended to
        f.write("two/\n")
    assert not captured("two/b") and captured("three/a")
    (ws / "new-ignore").write_text("three/\n")  # replaced by a rename
    os.rename(ws / "new-ignore", ignore)
    assert not captured("three/b") and captured("one/b")
    ignore.write_text("fours/\n")  # rewritten, same size
    assert not captured("fours/a") and captured("three/c")
    os.unlink(ignore)  # removed
    assert captured("fours/b")
    assert ".cowfsignore" not in {c["path"] for c in plain(ws.status())}  # (made in the layer)


def test_what_a_layer_below_captured_stays_captured_at_an_ignored_path(workspace):
    """A file captured in one layer and moved into the ignored directory
    is still captured in the layers after it: written there, removed there
    (into the grave, its inode number kept, never freed for another file
    to take), and a directory moved there keeps the names in it captured
    -- a rollback to the first layer puts everything back exactly."""
    ws = with_scratch(workspace)
    (ws / "d").mkdir()
    (ws / "d" / "f").write_text("in d\n")
    before = ws.snapshot(exclude=(b".cowfs", b"scratch"))
    first = ws.checkpoint()
    (ws / "data.txt").write_text("changed\n")  # (captured in the first layer)
    ino = os.lstat(ws / "data.txt").st_ino
    os.rename(ws / "data.txt", ws / "scratch" / "data.txt")
    os.rename(ws / "d", ws / "scratch" / "d")
    ws.checkpoint()
    (ws / "scratch" / "data.txt").write_text("changed again\n")
    os.unlink(ws / "scratch" / "data.txt")
    os.rename(ws / "scratch" / "d" / "f", ws / "scratch" / "d" / "g")
    (ws / "scratch" / "d" / "f").write_text("another\n")
    with open(ws / "scratch" / "new", "w") as f:  # (may not take the inode number)
        assert os.fstat(f.fileno()).st_ino != ino
    ws.cowfs("rollback", "--yes", "--to", str(first))
    treesnap.assert_same(before, ws.snapshot(exclude=(b".cowfs", b"scratch")))
    assert os.lstat(ws / "data.txt").st_ino == ino
    assert (ws / "d" / "f").read_text() == "in d\n" and not (ws / "d" / "g").exists()


def test_a_directory_made_before_there_were_patterns_stays_captured_once_they_match(workspace):
    """A directory made while .cowfsignore matched nothing, a file that
    existed before the layer moved into it; then patterns come that match
    the directory, and it is renamed and the file rewritten there: the
    rollback still puts the file back as it was (the directory was pinned
    when it was made, whatever the patterns then)."""
    ws = workspace
    (ws / "b").write_text("precious\n")
    ws.mount()
    before = ws.snapshot(exclude=(b".cowfs",))
    ws.checkpoint()
    (ws / "x.tmp").mkdir()
    os.rename(ws / "b", ws / "x.tmp" / "b")
    (ws / ".cowfsignore").write_text("*.tmp\n")
    os.rename(ws / "x.tmp", ws / "y.tmp")
    (ws / "y.tmp" / "b").write_text("trashed\n")
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot(exclude=(b".cowfs",)))
    assert (ws / "b").read_text() == "precious\n"
