"""Paths as people and programs give them back: lines for people name
workspace paths from the current directory when it is inside the
workspace (as git status does; --root: from the root), so that a line can
be pasted back as a PATH; a PATH that names nothing, now or when the layer
was opened, is an error naming it; and JSON, always from the root, carries
a name that is not UTF-8 as valid Unicode with its bytes beside it
(KEY_bytes, base64), which give the name back as an argument."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess

import pytest

from cowfs.errors import NOTHING_TO_DO, USAGE
from cowfs.interface.api import Workspace
from cowfs.text import lossless, relative

from .helpers import COWFS
from .test_grants import agent, granted  # noqa: F401 (fixture)
from .test_mcp import fails, ok, serve


def cowfs_in(cwd, *args, code: int = 0) -> subprocess.CompletedProcess:
    """The real ``cowfs`` run in *cwd* (arguments as str or bytes), its
    output as bytes; it must exit *code*."""
    argv = [a if isinstance(a, bytes) else str(a) for a in args]
    r = subprocess.run([*COWFS, *argv], cwd=cwd, capture_output=True, timeout=120)
    assert r.returncode == code, f"cowfs {argv} exited {r.returncode}: {r.stderr!r}"
    return r


def lines(out: bytes) -> list[str]:
    return out.decode("utf-8").splitlines()  # (strict: nothing raw that is not UTF-8)


def strict_json(out: bytes):
    """*out* parsed as a strict parser would: UTF-8, and no string that
    holds a lone surrogate (which Python's json would let through)."""
    data = json.loads(out.decode("utf-8"))
    todo = [data]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            todo += list(x) + list(x.values())
        elif isinstance(x, list):
            todo += x
        elif isinstance(x, str):
            x.encode("utf-8")  # (raises on a lone surrogate)
    return data


# -- the rules, without a mount ------------------------------------------------------------


@pytest.mark.parametrize(
    "path, base, shown",
    [
        ("click/src/x.py", "", "click/src/x.py"),
        ("click/src/x.py", "click", "src/x.py"),
        ("other/x", "click", "../other/x"),
        ("other/x", "click/src", "../../other/x"),
        ("click", "click", "."),
        ("click/srcs/y", "click/src", "../srcs/y"),  # a name, not a prefix of one
        (".", "click/src", "../.."),
        ("a", ".", "a"),
    ],
)
def test_a_path_seen_from_a_directory(path, base, shown):
    assert relative(path, base) == shown


def test_json_strings_are_valid_unicode_with_the_bytes_beside_them():
    name = os.fsdecode(b"latin\xe9.txt")
    data = {
        "changes": [{"path": name, "kind": "R", "from": "plain"}, {"path": "ok", "kind": "A"}],
        "restored": ["ok", name],
        "n": 3,
    }
    safe = lossless(data)
    assert safe["changes"][0] == {
        "path": "latin\ufffd.txt",
        "path_bytes": base64.b64encode(b"latin\xe9.txt").decode(),
        "kind": "R",
        "from": "plain",
    }
    assert safe["changes"][1] is data["changes"][1]  # (untouched: not copied)
    assert safe["restored"] == ["ok", "latin\ufffd.txt"]
    assert safe["restored_bytes"] == [None, base64.b64encode(b"latin\xe9.txt").decode()]
    assert lossless({"plain": ["a", "é"]}) == {"plain": ["a", "é"]}
    json.dumps(safe).encode().decode("utf-8")
    assert "\\ud" not in json.dumps(safe)


# -- from the current directory ----------------------------------------------------------


@pytest.fixture
def project(workspace):
    """A mounted workspace (click/src/click/utils.py, click/README,
    other/x, a.txt) whose open layer modifies utils.py and other/x, adds
    click/new.txt and renames a.txt to click/moved.txt."""
    ws = workspace
    (ws / "click" / "src" / "click").mkdir(parents=True)
    (ws / "click" / "src" / "click" / "utils.py").write_text("def f():\n    pass\n")
    (ws / "click" / "README").write_text("click\n")
    (ws / "other").mkdir()
    (ws / "other" / "x").write_text("x\n")
    (ws / "a.txt").write_text("alpha\n")
    ws.mount()
    with open(ws / "click" / "src" / "click" / "utils.py", "a") as f:
        f.write("def g():\n    pass\n")
    with open(ws / "other" / "x", "a") as f:
        f.write("more\n")
    (ws / "click" / "new.txt").write_text("new\n")
    os.rename(ws / "a.txt", ws / "click" / "moved.txt")
    return ws


FROM_CLICK = [
    "R ../a.txt -> moved.txt",
    "A new.txt",
    "M src/click/utils.py",
    "M ../other/x",
]
FROM_ROOT = [
    "R a.txt -> click/moved.txt",
    "A click/new.txt",
    "M click/src/click/utils.py",
    "M other/x",
]


def test_status_names_paths_from_the_current_directory(project):
    ws = project
    click = ws / "click"
    assert lines(cowfs_in(click, "status").stdout)[1:-1] == FROM_CLICK
    assert lines(cowfs_in(click / "src", "status").stdout)[1:-1] == [
        "R ../../a.txt -> ../moved.txt",
        "A ../new.txt",
        "M click/utils.py",
        "M ../../other/x",
    ]
    assert lines(cowfs_in(ws.path, "status").stdout)[1:-1] == FROM_ROOT
    # --root (global, or the command's): from the root, as before
    assert lines(cowfs_in(click, "--root", "status").stdout)[1:-1] == FROM_ROOT
    assert lines(cowfs_in(click, "status", "--root").stdout)[1:-1] == FROM_ROOT
    # outside the workspace (-C PATH): from the root
    assert lines(cowfs_in("/", "-C", click, "status").stdout)[1:-1] == FROM_ROOT
    # JSON: from the root, always
    data = strict_json(cowfs_in(click, "--json", "status").stdout)
    assert [c["path"] for c in data["changes"]] == [
        "click/moved.txt",
        "click/new.txt",
        "click/src/click/utils.py",
        "other/x",
    ]


def test_diff_and_rollback_dry_run_name_paths_from_the_current_directory(project):
    click = project / "click"
    name_status = lines(cowfs_in(click, "diff", "--name-status").stdout)
    assert name_status == [line.replace(" ", "\t", 1) for line in FROM_CLICK]
    stat = lines(cowfs_in(click, "diff", "--stat").stdout)
    assert [row.split("|")[0].strip() for row in stat] == [
        "../a.txt -> moved.txt",
        "new.txt",
        "src/click/utils.py",
        "../other/x",
    ]
    diff = lines(cowfs_in(click, "diff").stdout)
    for header in (
        "diff --cowfs M src/click/utils.py",
        "--- a/src/click/utils.py",
        "+++ b/src/click/utils.py",
        "diff --cowfs M ../other/x",
        "--- a/../other/x",
        "+++ b/../other/x",
        "diff --cowfs A new.txt",
        "+++ b/new.txt",
    ):
        assert header in diff
    assert "+def g():" in diff
    assert "diff --cowfs M click/src/click/utils.py" in lines(
        cowfs_in(click, "diff", "--root").stdout
    )
    # its JSON keeps the diff's own text, from the root
    [entry] = strict_json(cowfs_in(click, "--json", "diff", "--", "../other/x").stdout)["changes"]
    assert entry["diff"].startswith("--- a/other/x\n+++ b/other/x\n")
    assert lines(cowfs_in(click, "rollback", "--dry-run").stdout) == FROM_CLICK


def test_a_line_printed_pastes_back_as_a_path(project):
    ws = project
    click = ws / "click"
    printed = lines(cowfs_in(click, "status").stdout)[1:-1]
    for line in printed:
        kind, path = line.split(" ", 1)
        path = path.split(" -> ")[-1]
        shown = lines(cowfs_in(click, "status", "--", path).stdout)
        assert shown[1:-1] == [line], path
        assert lines(cowfs_in(click, "diff", "--name-status", "--", path).stdout) == [
            line.replace(" ", "\t", 1)
        ]
        assert f"diff --cowfs {line}" in lines(cowfs_in(click, "diff", "--", path).stdout)
    # and restore takes them: the file, and one outside the current directory
    said = lines(cowfs_in(click, "restore", "src/click/utils.py", "../other/x").stdout)
    assert said == ["restored 2 paths: src/click/utils.py, ../other/x"]
    assert (click / "src" / "click" / "utils.py").read_text() == "def f():\n    pass\n"
    assert (ws / "other" / "x").read_text() == "x\n"
    assert lines(cowfs_in(click, "status").stdout)[1:-1] == FROM_CLICK[:2]


def test_a_path_that_names_nothing_is_an_error_naming_it(project):
    ws = project
    click = ws / "click"
    layer = strict_json(cowfs_in(ws.path, "--json", "status").stdout)["id"]
    nothing = f"no such path, now or when layer {layer} was opened"
    # the root's name of a path, pasted in a subdirectory: click/click/...
    for args in (
        ["status", "--", "click/src/click/utils.py"],
        ["diff", "--", "click/src/click/utils.py"],
        ["diff", "--name-status", "--", "click/src/click/utils.py"],
        ["diff", "--stat", "--", "click/src/click/utils.py"],
    ):
        r = cowfs_in(click, *args, code=NOTHING_TO_DO)
        assert r.stdout == b""
        assert lines(r.stderr) == [f"cowfs: click/src/click/utils.py: {nothing}"]
    r = cowfs_in(click, "--json", "status", "--", "click/src/click/utils.py", code=NOTHING_TO_DO)
    assert strict_json(r.stdout) == {
        "error": f"click/click/src/click/utils.py: {nothing}",
        "code": NOTHING_TO_DO,
        "path": "click/click/src/click/utils.py",
    }
    r = cowfs_in(click, "--root", "status", "--", "nothere", code=NOTHING_TO_DO)
    assert lines(r.stderr) == [f"cowfs: click/nothere: {nothing}"]
    # one that matches next to one that does not: still an error
    cowfs_in(click, "status", "--", "new.txt", "nothere", code=NOTHING_TO_DO)

    # a path that exists, now or then, with no change under it
    said = lines(cowfs_in(click, "status", "--", "README").stdout)
    assert said[0] == "# no changes under README" and len(said) == 2
    said = lines(cowfs_in(click, "status", "--", "README", "../other/x").stdout)
    assert said[:2] == ["# 1 change: 1 modified", "M ../other/x"]
    assert cowfs_in(click, "diff", "--", "README").stdout == b""
    assert lines(cowfs_in(click, "status", "--", "../a.txt").stdout)[1] == FROM_CLICK[0]
    (click / "README").unlink()
    assert lines(cowfs_in(click, "status", "--", "README").stdout)[1] == "D README"
    # made and removed again inside the layer: there neither now nor then
    (click / "tmp").write_text("tmp\n")
    (click / "tmp").unlink()
    cowfs_in(click, "status", "--", "tmp", code=NOTHING_TO_DO)
    # the store is no path of the workspace's
    cowfs_in(ws.path, "status", "--", ".cowfs", code=NOTHING_TO_DO)
    # outside the workspace: a usage error, as before
    r = cowfs_in(click, "status", "--", "/etc", code=USAGE)
    assert "/etc: outside the workspace" in r.stderr.decode()


def test_a_path_below_a_directory_one_may_not_search_is_not_told_absent(granted):  # noqa: F811
    """An agent granted `step` learns nothing of what a directory it may
    not search holds: a PATH there that names nothing is "no changes
    under" it, as one that names something is; root is told."""
    ws = granted
    for path in ("private/notes", "private/nothere"):
        code, out, err = agent(ws, "status", "--", path)
        assert (code, out.splitlines()[0]) == (0, f"# no changes under {path}"), err
    code, out, err = agent(ws, "status", "--", "nothere")
    assert code == NOTHING_TO_DO and err.startswith("cowfs: nothere: no such path"), err
    r = cowfs_in(ws.path, "status", "--", "private/nothere", code=NOTHING_TO_DO)
    assert lines(r.stderr)[0].startswith("cowfs: private/nothere: no such path")


def test_errors_name_the_path_from_the_current_directory(project):
    ws = project
    click = ws / "click"
    layer = json.loads(cowfs_in(ws.path, "--json", "status").stdout)["id"]
    nothing = f"no such path, now or when layer {layer} was opened; nothing restored"
    r = cowfs_in(click, "restore", "nothere", code=NOTHING_TO_DO)
    assert lines(r.stderr) == [f"cowfs: nothere: {nothing}"]
    r = cowfs_in(click, "restore", "../nothere", code=NOTHING_TO_DO)
    assert lines(r.stderr) == [f"cowfs: ../nothere: {nothing}"]
    r = cowfs_in(click, "--root", "restore", "nothere", code=NOTHING_TO_DO)
    assert lines(r.stderr) == [f"cowfs: click/nothere: {nothing}"]
    r = cowfs_in(click, "--json", "restore", "nothere", code=NOTHING_TO_DO)
    assert json.loads(r.stdout) == {
        "error": f"click/nothere: {nothing}",
        "code": NOTHING_TO_DO,
        "path": "click/nothere",
    }
    r = cowfs_in(click, "show", f"{layer}:nothere", code=NOTHING_TO_DO)
    assert lines(r.stderr) == [f"cowfs: nothere: did not exist when layer {layer} was opened"]


def test_run_and_log_name_paths_from_the_current_directory(project):
    ws = project
    click = ws / "click"
    r = cowfs_in(click, "run", "--", "sh", "-c", "echo >> ../other/x; echo > made")
    said = lines(r.stderr)
    assert said[:3] == ["2 changes: 1 added, 1 modified", "  A made", "  M ../other/x"]
    r = cowfs_in(click, "--root", "run", "--", "touch", "made2")
    assert lines(r.stderr)[1] == "  A click/made2"
    # drift accepted at mount, in log
    ws.unmount()
    with open(ws / "other" / "x", "a") as f:
        f.write("while not mounted\n")
    ws.mount("--accept-drift")
    log = lines(cowfs_in(click, "log").stdout)
    assert any(line.strip().endswith("while not mounted): ../other/x") for line in log), log
    log = lines(cowfs_in(click, "log", "--root").stdout)
    assert any(line.strip().endswith("while not mounted): other/x") for line in log), log


# -- names that are not UTF-8 ---------------------------------------------------------------

LATIN = b"latin\xe9.txt"


def b64(name: bytes) -> str:
    return base64.b64encode(name).decode()


@pytest.fixture
def latin(workspace):
    """A mounted workspace whose open layer adds LATIN (and dir/a.txt) and
    renames dir/old\\xff to dir/new\\xfe."""
    ws = workspace
    (ws / "dir").mkdir()
    (ws / "dir" / "a.txt").write_text("a\n")
    root = os.fsencode(ws.path)
    with open(root + b"/dir/old\xff", "w") as f:
        f.write("old\n")
    ws.mount()
    with open(root + b"/" + LATIN, "w") as f:
        f.write("latin\n")
    os.rename(root + b"/dir/old\xff", root + b"/dir/new\xfe")
    return ws


def test_a_name_that_is_not_utf8_round_trips_through_json(latin):
    ws = latin
    out = cowfs_in(ws.path, "--json", "status").stdout
    data = strict_json(out)
    by_path = {c["path"]: c for c in data["changes"]}
    assert set(by_path) == {"latin\ufffd.txt", "dir/new\ufffd"}
    added = by_path["latin\ufffd.txt"]
    assert base64.b64decode(added["path_bytes"]) == LATIN
    renamed = by_path["dir/new\ufffd"]
    assert base64.b64decode(renamed["path_bytes"]) == b"dir/new\xfe"
    assert base64.b64decode(renamed["from_bytes"]) == b"dir/old\xff"
    assert renamed["from"] == "dir/old\ufffd"
    if shutil.which("jq"):  # a strict parser: the bytes come through it whole
        jq = subprocess.run(
            ["jq", "-r", '.changes[] | select(.kind == "A") | .path_bytes'],
            input=out,
            capture_output=True,
            check=True,
        )
        assert base64.b64decode(jq.stdout.strip()) == LATIN

    # the bytes, given back as an argument, name the file
    name = base64.b64decode(added["path_bytes"])
    [entry] = strict_json(cowfs_in(ws.path, "--json", "diff", "--", name).stdout)["changes"]
    assert base64.b64decode(entry["path_bytes"]) == LATIN and entry["kind"] == "A"
    assert base64.b64decode(entry["diff_bytes"]).startswith(b"--- /dev/null\n+++ b/" + LATIN)
    human = lines(cowfs_in(ws.path, "diff", "--", name).stdout)
    assert human[:3] == [
        r'diff --cowfs A "latin\351.txt"',
        "--- /dev/null",
        r'+++ "b/latin\351.txt"',
    ]
    assert lines(cowfs_in(ws.path, "status", "--", name).stdout)[1] == r'A "latin\351.txt"'

    dry = strict_json(cowfs_in(ws.path, "--json", "rollback", "--dry-run").stdout)
    assert {base64.b64decode(c["path_bytes"]) for c in dry["changes"]} == {
        LATIN,
        b"dir/new\xfe",
    }
    done = strict_json(cowfs_in(ws.path, "--json", "restore", "--", name).stdout)
    assert [base64.b64decode(b) for b in done["restored_bytes"]] == [LATIN]
    assert not os.path.lexists(os.fsencode(ws.path) + b"/" + LATIN)
    said = lines(cowfs_in(ws.path / "dir", "restore", b"new\xfe", b"old\xff").stdout)
    assert said[0].startswith("restored 2 paths: ")
    assert set(said[0].split(": ", 1)[1].split(", ")) == {r'"new\376"', r'"old\377"'}
    assert sorted(os.listdir(os.fsencode(ws.path / "dir"))) == [b"a.txt", b"old\xff"]
    assert strict_json(cowfs_in(ws.path, "--json", "status").stdout)["changes"] == []


def test_run_and_errors_carry_names_that_are_not_utf8(latin):
    ws = latin
    r = cowfs_in(ws.path, "--json", "run", "--", "touch", b"made\xfe")
    record = strict_json(r.stdout)
    made = [c for c in record["changes"] if c["path"] == "made\ufffd"]
    assert base64.b64decode(made[0]["path_bytes"]) == b"made\xfe"
    assert r'  A "made\376"' in lines(r.stderr)

    r = cowfs_in(ws.path, "status", "--", b"nothere\xe9", code=NOTHING_TO_DO)
    assert lines(r.stderr)[0].startswith(r'cowfs: "nothere\351": no such path')
    r = cowfs_in(ws.path, "--json", "status", "--", b"nothere\xe9", code=NOTHING_TO_DO)
    err = strict_json(r.stdout)
    assert base64.b64decode(err["path_bytes"]) == b"nothere\xe9"
    r = cowfs_in(ws.path, "status", "--", b"/etc/x\xe9", code=USAGE)
    assert r'"/etc/x\351": outside the workspace' in lines(r.stderr)[0]


def test_the_api_and_mcp_take_a_name_that_is_not_utf8_back(latin):
    ws = latin
    api = Workspace.attach(ws.path)
    [added] = [c for c in api.changes() if c.kind == "A"]
    assert os.fsencode(added.path) == LATIN  # (the API's names: os.fsdecode's)
    assert api.restore([LATIN]) == [os.fsdecode(LATIN)]
    assert not os.path.lexists(os.fsencode(ws.path) + b"/" + LATIN)

    with open(os.fsencode(ws.path) + b"/" + LATIN, "w") as f:
        f.write("again\n")

    async def steps(s):
        changes = (await ok(s, "status"))["changes"]
        [added] = [c for c in changes if c["kind"] == "A"]
        assert added["path"] == "latin\ufffd.txt"
        diff = await ok(s, "diff", paths_bytes=[added["path_bytes"]])
        assert diff["text"].startswith('diff --cowfs A "latin\\351.txt"')
        done = await ok(s, "restore", paths_bytes=[added["path_bytes"]])
        assert [base64.b64decode(b) for b in done["restored_bytes"]] == [LATIN]
        code, text = await fails(s, "restore", paths_bytes=["not base64!"])
        assert code == USAGE and "base64" in text
        code, _ = await fails(s, "restore")
        assert code == USAGE

    serve(ws.path, steps)
    assert not os.path.lexists(os.fsencode(ws.path) + b"/" + LATIN)
