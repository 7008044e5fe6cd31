"""Output that stays readable when a step changes thousands of files:
directories added or deleted as a whole are one line in `status`, `diff
--name-status` and `run`'s summary (every path with -u and in JSON), counts
by kind, --limit and path filters; `log` for people (ages, sizes, newest
first, -n) with its JSON unchanged; the redo note only while it is
current; progress on a terminal only; changes refused by --max-store
counted in `status`, and `df` showing what the limit leaves."""

from __future__ import annotations

import errno
import json
import os
import pty
import select
import subprocess
import sys
import time

from .helpers import COWFS

PACKAGES, FILES = 12, 40  # an npm-like tree: 12 packages of 40 files and a lib/


def npm_like(root, packages: int = PACKAGES, files: int = FILES) -> tuple[int, int]:
    """node_modules/<package>/{package.json, lib/f<i>.js}; returns the files
    and directories made below node_modules."""
    for p in range(packages):
        lib = root / "node_modules" / f"pkg{p}" / "lib"
        lib.mkdir(parents=True)
        (lib.parent / "package.json").write_text(f'{{"name": "pkg{p}"}}\n')
        for i in range(files):
            (lib / f"f{i}.js").write_text(f"module.exports = {i};\n")
    return packages * (files + 1), packages * 2


def lines(ws, *args) -> list[str]:
    return ws.cowfs(*args).stdout.splitlines()


def test_a_directory_added_as_a_whole_is_one_line_with_what_it_holds(mounted):
    ws = mounted
    (ws / "package.json").write_text("{}\n")
    ws.commit()
    ws.checkpoint("npm install")
    files, dirs = npm_like(ws.path)
    (ws / "package.json").write_text('{"dependencies": {}}\n')
    (ws / "small").mkdir()  # fewer than 5 inside: listed in full
    (ws / "small" / "one").write_text("1\n")
    (ws / "fresh").mkdir()  # a new directory with a file moved in
    os.rename(ws / "a.txt", ws / "fresh" / "a.txt")
    total = files + dirs + 6  # + node_modules, small, small/one, fresh, R, M

    out = lines(ws, "status")
    assert out[0] == f"# {total:,} changes: {total - 2:,} added, 1 modified, 1 renamed"
    assert out[1:7] == [
        "A fresh",
        "R a.txt -> fresh/a.txt",
        "M package.json",
        "A small",
        "A small/one",
        f"A node_modules/  ({files:,} files, {dirs} directories)",
    ]
    assert out[7].startswith("# open layer ") and len(out) == 8

    every = lines(ws, "status", "-u")
    assert len(every) == 1 + total + 1 and "A node_modules/pkg3/lib/f7.js" in every

    data = ws.json("status")  # complete: every path
    assert len(data["changes"]) == total
    assert data["counts"] == {"A": total - 2, "M": 1, "R": 1}
    dirs_said = {c["path"] for c in data["changes"] if c.get("dir")}
    assert "node_modules/pkg0/lib" in dirs_said and "package.json" not in dirs_said
    assert len(dirs_said) == dirs + 3  # + node_modules, small, fresh
    collapsed = ws.json("status", "--collapse")["changes"]
    assert [c["path"] for c in collapsed] == [
        "fresh",
        "fresh/a.txt",
        "node_modules",
        "package.json",
        "small",
        "small/one",
    ]
    [nm] = [c for c in collapsed if "collapsed" in c]
    assert nm["collapsed"] == {"files": files, "dirs": dirs} and nm["kind"] == "A"

    limited = lines(ws, "status", "--limit", "3")
    assert limited[1:5] == ["A fresh", "R a.txt -> fresh/a.txt", "M package.json", "... and 3 more"]
    cut = ws.json("status", "--limit", "10")
    assert len(cut["changes"]) == 10 and cut["omitted"] == total - 10
    assert cut["counts"] == data["counts"]

    only = lines(ws, "status", "--", "node_modules/pkg3", "package.json")
    assert only[:3] == [
        f"# {FILES + 4} changes: {FILES + 3} added, 1 modified",
        "M package.json",
        f"A node_modules/pkg3/  ({FILES + 1} files, 1 directory)",
    ]
    assert [c["path"] for c in ws.json("status", "--", "small")["changes"]] == [
        "small",
        "small/one",
    ]

    names = lines(ws, "diff", "--name-status")
    assert names == [
        "A\tfresh",
        "R\ta.txt -> fresh/a.txt",
        "M\tpackage.json",
        "A\tsmall",
        "A\tsmall/one",
        f"A\tnode_modules/  ({files:,} files, {dirs} directories)",
    ]
    assert len(lines(ws, "diff", "--name-status", "-u")) == total
    assert len(ws.json("diff", "--name-status")["changes"]) == total
    ws.unmount()  # the same on an unmounted workspace, which says it is not mounted
    offline = lines(ws, "status")
    assert offline[0].startswith("# not mounted") and offline[1:3] == out[:2]


def test_a_directory_deleted_as_a_whole_is_one_line(mounted):
    ws = mounted
    files, dirs = npm_like(ws.path, packages=3, files=10)
    ws.commit()
    ws.checkpoint("rm -rf node_modules/pkg1, and node_modules/pkg2 but one file")
    subprocess.run(["rm", "-rf", str(ws / "node_modules" / "pkg1")], check=True)
    os.rename(ws / "node_modules" / "pkg2" / "lib" / "f3.js", ws / "kept.js")
    subprocess.run(["rm", "-rf", str(ws / "node_modules" / "pkg2")], check=True)
    out = lines(ws, "status")
    assert out[0] == "# 26 changes: 25 deleted, 1 renamed"
    assert out[1:4] == [
        "R node_modules/pkg2/lib/f3.js -> kept.js",
        "D node_modules/pkg1/  (11 files, 1 directory)",
        "D node_modules/pkg2/  (10 files, 1 directory)",
    ]
    assert len(lines(ws, "status", "--all")) == 1 + 26 + 1
    assert len(ws.json("status")["changes"]) == 26
    [pkg1] = [
        c for c in ws.json("status", "--collapse")["changes"] if c["path"] == "node_modules/pkg1"
    ]
    assert pkg1 == pkg1 | {"kind": "D", "dir": True, "collapsed": {"files": 11, "dirs": 1}}


def test_run_lists_single_changes_first_and_whole_directories_after(mounted):
    ws = mounted
    r = ws.cowfs(
        "run",
        "--",
        "sh",
        "-c",
        "mkdir -p node_modules/left-pad/lib && echo '{}' > package.json && "
        "for i in 1 2 3 4 5 6; do echo $i > node_modules/left-pad/lib/f$i.js; done "
        "&& echo changed > a.txt",
    )
    said = r.stderr.splitlines()
    layer = ws.json("log")[-1]["id"]
    assert said == [
        "11 changes: 10 added, 1 modified",
        "  M a.txt",
        "  A package.json",
        "  A node_modules/  (6 files, 2 directories)",
        f"cowfs: kept as layer {layer} ('cowfs rollback --to {layer}' undoes it)",
    ]
    r = ws.cowfs(
        "run",
        "--on-success",
        "commit",
        "--",
        "sh",
        "-c",
        "mkdir -p vendor/x && for i in 1 2 3 4 5; do echo $i > vendor/x/f$i; done",
    )
    assert r.stderr.splitlines() == [
        "7 changes: 7 added",
        "  A vendor/  (5 files, 1 directory)",
        "cowfs: committed",
    ]


def test_log_for_people_and_its_json_unchanged(mounted):
    ws = mounted
    (ws / "big").write_bytes(os.urandom(3 << 20))
    first = ws.checkpoint("first step")
    (ws / "big").write_bytes(os.urandom(3 << 20))  # its old bytes are kept
    ws.cowfs("run", "--on-success", "keep", "-m", "second step", "--", "touch", "made")
    out = lines(ws, "log")
    assert out[0].split() == ["ID", "CREATED", "CHANGES", "SIZE", "MESSAGE"]
    top, mid, base = out[1], out[3], out[4]
    assert top.startswith(f"* {first + 1:>4}  ") and top.endswith("second step")
    assert "run kept (exit 0, " in out[2] and out[2].endswith(": touch made")
    assert out[2].index("run kept") == top.index("second step")  # under the message
    assert mid.startswith(f"  {first:>4}  ") and mid.endswith("first step")
    assert " ago " in mid or "just now" in mid
    assert " MiB " in mid and "3.0 MiB" in mid  # the 3 MiB file's bytes
    assert base.endswith("base") and len(out) == 5
    newest = lines(ws, "log", "-n", "1")
    assert newest == out[:3]
    layers = ws.json("log")  # unchanged: oldest first
    assert [x["id"] for x in layers] == [1, first, first + 1]
    assert isinstance(layers[1]["created"], float) and isinstance(layers[1]["bytes"], int)
    assert layers[1]["bytes"] >= 3 << 20
    assert [x["id"] for x in ws.json("log", "-n", "2")] == [first, first + 1]
    r = ws.cowfs("log", "-n", "0", check=False)
    assert r.returncode == 2 and "not a positive number" in r.stderr


def test_the_note_that_a_rollback_cannot_be_redone_lasts_until_the_next_checkpoint(mounted):
    ws = mounted
    layer = ws.checkpoint("try")
    (ws / "a.txt").write_text("tried\n")
    ws.rollback()
    assert "can be undone: cowfs redo" in lines(ws, "log")[-1]
    (ws / "b").write_text("a change elsewhere leaves it\n")
    assert "can be undone: cowfs redo" in lines(ws, "status")[-1]
    (ws / "a.txt").write_text("a change where the redo acts ends it\n")
    note = f"# the rollback of layer {layer} cannot be redone: a.txt changed since the rollback"
    assert lines(ws, "log")[-1].startswith(note)
    assert lines(ws, "status")[-1].startswith(note)
    ws.unmount()
    assert lines(ws, "status")[-1].startswith(note)  # offline too
    ws.mount()
    ws.checkpoint("next")  # old news now
    assert not any("redo" in line for line in lines(ws, "log") + lines(ws, "status"))
    redo = ws.json("status")["redo"]
    assert redo["available"] is False and redo["current"] is False  # (JSON: still there)


def test_the_note_after_a_rollback_of_the_base_without_redo(mounted):
    ws = mounted
    (ws / "a.txt").write_text("changed\n")
    ws.cowfs("rollback", "--no-redo", "--yes")
    note = "# the rollback of layer 1 cannot be redone: it was made with --no-redo"
    assert lines(ws, "log")[-1] == note
    (ws / "a.txt").write_text("changed again\n")
    assert lines(ws, "status")[-1] == note
    ws.commit()  # a fresh base: old news
    assert not any("redo" in line for line in lines(ws, "log"))


# -- progress on a terminal ------------------------------------------------------------


def gated_rollback_layer(ws, tmp_path):
    """A layer whose rollback waits, in a provider's restore, for the file
    gate; returns (the file that says it is waiting, the gate)."""
    gate, waiting = tmp_path / "gate", tmp_path / "restoring"
    ws.cowfs(
        "provider",
        "add",
        "slow",
        "--capture",
        "true",
        "--restore",
        f'touch "{waiting}"; while [ ! -e "{gate}" ]; do sleep 0.05; done',
    )
    ws.json("checkpoint", "--provider", "slow")
    (ws / "a.txt").write_text("changed\n")
    return waiting, gate


def on_a_terminal(args: list[str], waiting, gate, env: dict) -> tuple[str, str, int]:
    """Run cowfs on a pseudo-terminal until *waiting* exists; return what
    it wrote by then (everything the terminal has), then open *gate* and
    return the rest and the exit status."""
    pid, fd = pty.fork()
    if pid == 0:
        os.environ.update(env)
        os.execv(sys.executable, [*COWFS, *args])
    before = b""
    deadline = time.monotonic() + 120
    while not waiting.exists():
        assert time.monotonic() < deadline
        if select.select([fd], [], [], 0.05)[0]:
            before += os.read(fd, 4096)
    while select.select([fd], [], [], 0)[0]:  # (written before it waited: all there)
        before += os.read(fd, 4096)
    gate.touch()
    after = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the terminal's other side closed
            break
        if not chunk:
            break
        after += chunk
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return (
        before.decode(errors="replace"),
        after.decode(errors="replace"),
        os.waitstatus_to_exitcode(status),
    )


NOW = {"COWFS_PROGRESS_DELAY": "0"}  # shown before the operation starts


def test_a_long_rollback_shows_progress_on_a_terminal(mounted, tmp_path):
    ws = mounted
    waiting, gate = gated_rollback_layer(ws, tmp_path)
    before, after, code = on_a_terminal(["-C", str(ws.path), "rollback"], waiting, gate, NOW)
    assert code == 0, before + after
    assert "cowfs: rolling back (" in before  # while it waits
    assert "rolled back layer" in after and (ws / "a.txt").read_text() == "alpha\n"


def test_an_offline_rollback_shows_progress_on_a_terminal_too(mounted, tmp_path):
    ws = mounted
    waiting, gate = gated_rollback_layer(ws, tmp_path)
    ws.unmount()
    before, after, code = on_a_terminal(["-C", str(ws.path), "rollback"], waiting, gate, NOW)
    assert code == 0, before + after
    assert "cowfs: rolling back (" in before and "rolled back layer" in after


def test_no_progress_with_json_on_a_terminal(mounted, tmp_path):
    ws = mounted
    waiting, gate = gated_rollback_layer(ws, tmp_path)
    before, after, code = on_a_terminal(
        ["-C", str(ws.path), "--json", "rollback"], waiting, gate, NOW
    )
    assert code == 0, before + after
    assert "rolling back" not in before + after
    assert json.loads(after.strip().splitlines()[-1])["dropped"]


def test_no_progress_without_a_terminal(mounted, tmp_path):
    ws = mounted
    waiting, gate = gated_rollback_layer(ws, tmp_path)
    proc = subprocess.Popen(
        [*COWFS, "-C", str(ws.path), "rollback"],
        env=os.environ | NOW,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not waiting.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    gate.touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert err == "" and out.startswith("rolled back layer")


# -- --max-store: refused changes and df -------------------------------------------------


def test_status_counts_the_changes_max_store_refused_and_df_shows_what_it_leaves(workspace):
    ws = workspace
    chunk = 64 << 10
    (ws / "big").write_bytes(os.urandom(64 * chunk))
    ws.mount("--max-store", "1M")
    assert ws.json("status")["refused"] is None
    assert "refused" not in ws.cowfs("status").stdout
    ws.checkpoint()
    refused = 0
    fd = os.open(ws / "big", os.O_WRONLY)
    try:
        for k in range(64):
            try:
                os.pwrite(fd, os.urandom(chunk), k * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                refused += 1
    finally:
        os.close(fd)
    assert refused > 40
    data = ws.json("status")
    assert data["refused"]["count"] == refused and data["refused"]["path"] == "big"
    assert abs(data["refused"]["time"] - time.time()) < 600
    assert (
        f"# --max-store refused {refused} changes (ENOSPC) since the mount, the last "
        in ws.cowfs("status").stdout
    )
    # df: what the limit still leaves, not the disk's free space
    sv = os.statvfs(ws.path)
    left = (1 << 20) - data["usage"]["data"]
    assert 0 <= sv.f_bavail * sv.f_frsize <= max(left, 0)
    below = os.statvfs(ws.path.parent)  # what df says is used stays true
    assert (
        abs((sv.f_blocks - sv.f_bfree) - (below.f_blocks - below.f_bfree)) < below.f_blocks // 100
    )
    avail = subprocess.run(
        ["df", "-B1", "--output=avail", str(ws.path)], capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    assert int(avail) <= max(left, 0)
    # (doctor's free space is the disk's, not what the limit leaves)
    checks = json.loads(ws.cowfs("--json", "doctor", ws.path, check=False).stdout)
    [space] = [c for c in checks if c["name"] == "free space"]
    assert space["ok"], space
    ws.rollback()
    ws.unmount()
    ws.mount("--max-store", "0")  # no limit: the disk's own figures
    sv, below = os.statvfs(ws.path), os.statvfs(ws.path.parent)
    assert sv.f_blocks == below.f_blocks and ws.json("status")["refused"] is None
