"""File names reach no terminal raw: every line for people that names a
path quotes it as git's core.quotePath does (text.quote) -- a name with a
newline cannot forge a line, an escape sequence in a name never reaches the
terminal, a name that is not UTF-8 prints as octal bytes -- while names
with nothing to escape print as they always did and JSON carries every
name exactly (one that is not UTF-8 in KEY_bytes)."""

from __future__ import annotations

import base64
import json
import os
import subprocess

import pytest

from cowfs.text import printable, quote

from .helpers import COWFS

BAD = os.fsdecode(b"bad\xffname")  # not UTF-8: a surrogateescape'd str, as cowfs carries it


@pytest.mark.parametrize(
    "name, shown",
    [
        ("a.txt", "a.txt"),
        ("dir/with space", "dir/with space"),
        ("café/名前", "café/名前"),  # valid UTF-8: as it is
        ("", ""),
        ("x\nM fake", r'"x\nM fake"'),
        ("\x1b[31mred", r'"\033[31mred"'),
        ('q"uote', r'"q\"uote"'),
        ("back\\slash", r'"back\\slash"'),
        ("\a\b\t\n\v\f\r", r'"\a\b\t\n\v\f\r"'),
        ("\x00\x01\x1f\x7f", r'"\000\001\037\177"'),
        ("\x9b2J", r'"\302\2332J"'),  # C1 CSI: its UTF-8 bytes
        ("\u202eevil", r'"\342\200\256evil"'),  # right-to-left override
        ("line\u2028sep", r'"line\342\200\250sep"'),
        (BAD, r'"bad\377name"'),  # the raw byte, not U+DCFF's
        (os.fsdecode(b"\xc3("), r'"\303("'),  # a lone lead byte
        (os.fsdecode("é".encode() + b"\xe9"), r'"é\351"'),  # valid kept, invalid octal
        ("\ud800", r'"\355\240\200"'),  # a surrogate no byte stands for
        (b"bytes\xfe", r'"bytes\376"'),  # bytes as os.fsdecode takes them
        (b"plain", "plain"),
    ],
)
def test_quote(name, shown):
    assert quote(name) == shown


@pytest.mark.parametrize(
    "text, shown",
    [
        ("run: make test", "run: make test"),
        ('say "hi" \\o/', 'say "hi" \\o/'),  # free text: quotes and backslashes as they are
        ("red\x1b[31m\r\nM fake", r"red\033[31m\r\nM fake"),
        ("Write: " + BAD, r"Write: bad\377name"),
    ],
)
def test_printable(text, shown):
    assert printable(text) == shown


def exact(c: dict, key: str = "path") -> str:
    """The name *key* of JSON change *c* exactly: from KEY_bytes when it
    is not UTF-8 (KEY then holds U+FFFD for its bytes that are not)."""
    if f"{key}_bytes" in c:
        return os.fsdecode(base64.b64decode(c[f"{key}_bytes"]))
    return c[key]


def raw(ws, *args) -> subprocess.CompletedProcess:
    """The real ``cowfs`` with its output as bytes (nothing decoded)."""
    r = subprocess.run([*COWFS, "-C", str(ws.path), *args], capture_output=True, timeout=300)
    assert r.returncode == 0, f"cowfs {args} exited {r.returncode}: {r.stderr!r}"
    return r


def clean_lines(out: bytes, tabs: bool = False) -> list[str]:
    """*out* as lines, once it is shown to be UTF-8 with no control
    character but the line ends (and, with *tabs*, tabs) and no C1 control
    or bidirectional override (nothing a terminal would act on)."""
    text = out.decode("utf-8")  # (strict: no byte of a name that is not UTF-8)
    allowed = "\n\t" if tabs else "\n"
    bad = [
        ch
        for ch in text
        if (ord(ch) < 0x20 and ch not in allowed)
        or 0x7F <= ord(ch) <= 0x9F
        or ch in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u2028\u2029"
    ]
    assert not bad, f"raw control characters {bad!r} in {text!r}"
    return text.splitlines()


FORGED = "x\nM fake"
RED = "\x1b[31mred"
QUOTE = 'q"uote'
BACKSLASH = "back\\slash"
CLEARS = "m\x1b[2Jod"  # in the base, then modified
TITLED = "d\x1b]0;owned\x07"  # a directory of 5 files: one collapsed line
RENAMED = "dir/b\tc.txt"


@pytest.fixture
def hostile(workspace):
    """A mounted workspace whose open layer adds, modifies and renames
    files with hostile names (FORGED made by a shell whose command line
    holds the name, for --who)."""
    ws = workspace
    (ws / "a.txt").write_text("alpha\n")
    (ws / "dir").mkdir()
    (ws / "dir" / "b.txt").write_text("beta\n")
    (ws / CLEARS).write_text("before\n")
    ws.mount()
    subprocess.run(["sh", "-c", 'printf "hello\\n" > "$1"', "sh", str(ws / FORGED)], check=True)
    for name in (RED, QUOTE, BACKSLASH, "café"):
        (ws / name).write_text("hello\n")
    fd = os.open(os.fsencode(ws.path) + b"/bad\xffname", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"hello\n")
    os.close(fd)
    (ws / TITLED).mkdir()
    for i in range(5):
        (ws / TITLED / f"f{i}").write_text(f"{i}\n")
    (ws / CLEARS).write_text("after\n")
    os.rename(ws / "dir" / "b.txt", ws / RENAMED)
    with open(ws / RENAMED, "a") as f:
        f.write("gamma\n")
    return ws


# each change as `status -u` shows it, quoted: (kind, name)
EVERY = {
    ("A", r'"x\nM fake"'),
    ("A", r'"\033[31mred"'),
    ("A", r'"q\"uote"'),
    ("A", r'"back\\slash"'),
    ("A", "café"),
    ("A", r'"bad\377name"'),
    ("A", r'"d\033]0;owned\a"'),
    *(("A", f'"d\\033]0;owned\\a/f{i}"') for i in range(5)),
    ("M", r'"m\033[2Jod"'),
    ("R", r'dir/b.txt -> "dir/b\tc.txt"'),
}
EXACT = {FORGED, RED, QUOTE, BACKSLASH, "café", BAD, TITLED, CLEARS, RENAMED} | {
    f"{TITLED}/f{i}" for i in range(5)
}


def test_status_quotes_names_and_its_json_is_exact(hostile):
    ws = hostile
    every = clean_lines(raw(ws, "status", "-u").stdout)
    assert every[0] == "# 14 changes: 12 added, 1 modified, 1 renamed"
    assert every[-1].startswith("# open layer ")
    assert {tuple(line.split(" ", 1)) for line in every[1:-1]} == EVERY
    assert len(every) == 2 + len(EVERY)  # one line each: nothing forged
    assert "M fake" not in every

    default = clean_lines(raw(ws, "status").stdout)  # the directory as one line
    assert r'A "d\033]0;owned\a/"  (5 files)' in default
    assert not any("f3" in line for line in default)

    data = ws.json("status")
    assert {exact(c) for c in data["changes"]} == EXACT
    [renamed] = [c for c in data["changes"] if c["kind"] == "R"]
    assert (renamed["from"], renamed["path"]) == ("dir/b.txt", RENAMED)
    [bad] = [c for c in data["changes"] if c["path"].startswith("bad")]
    assert bad["path"] == "bad\ufffdname"  # (valid Unicode: strict parsers take it)
    assert base64.b64decode(bad["path_bytes"]) == b"bad\xffname"

    who = clean_lines(raw(ws, "status", "-u", "--who").stdout, tabs=True)
    [forged] = [line for line in who if line.startswith('A "x\\nM fake"\t')]
    path = quote(str(ws / FORGED))
    assert forged.endswith(f': sh -c \'printf "hello\\n" > "$1"\' sh {path}')
    assert len(who) == len(every)


def test_diff_quotes_names_in_every_line_that_has_one(hostile):
    ws = hostile
    names = clean_lines(raw(ws, "diff", "--name-status", "-u").stdout, tabs=True)
    assert {tuple(line.split("\t", 1)) for line in names} == EVERY
    assert len(names) == len(EVERY)
    assert {exact(c) for c in ws.json("diff", "--name-status")["changes"]} == EXACT

    out = clean_lines(raw(ws, "diff").stdout)
    headers = [line for line in out if line.startswith(("diff --cowfs ", "--- ", "+++ "))]
    for header in (
        r'diff --cowfs A "x\nM fake"',
        r'+++ "b/x\nM fake"',
        r'diff --cowfs A "bad\377name"',
        r'+++ "b/bad\377name"',
        r'diff --cowfs M "m\033[2Jod"',
        r'--- "a/m\033[2Jod"',
        r'+++ "b/m\033[2Jod"',
        r'diff --cowfs R dir/b.txt -> "dir/b\tc.txt"',
        "--- a/dir/b.txt",
        r'+++ "b/dir/b\tc.txt"',
        "diff --cowfs A café",
        "+++ b/café",
        "--- /dev/null",
    ):
        assert header in headers
    # a header per change and a ---/+++ pair per text diff: no line forged
    assert len([h for h in headers if h.startswith("diff --cowfs ")]) == len(EVERY)
    assert "M fake" not in out and "+++ b/x" not in out
    assert "+gamma" in out and "-before" in out and "+after" in out

    changes = {exact(c): c for c in ws.json("diff")["changes"]}
    assert set(changes) == EXACT
    assert changes[FORGED]["diff"].startswith(f"--- /dev/null\n+++ b/{FORGED}\n@@")
    assert changes[CLEARS]["diff"].startswith(f"--- a/{CLEARS}\n+++ b/{CLEARS}\n@@")
    assert exact(changes[BAD], "diff").startswith(f"--- /dev/null\n+++ b/{BAD}\n@@")

    stat = clean_lines(raw(ws, "diff", "--stat").stdout)
    assert any(line.startswith(r' "x\nM fake" ') and line.endswith("| +1 -0") for line in stat)
    assert len(stat) == len(EVERY)


def test_rollback_dry_run_restore_and_log_quote_names(hostile):
    ws = hostile
    dry = clean_lines(raw(ws, "rollback", "--dry-run").stdout)
    assert {tuple(line.split(" ", 1)) for line in dry} == EVERY
    assert len(dry) == len(EVERY)
    assert {exact(c) for c in ws.json("rollback", "--dry-run")["changes"]} == EXACT

    said = clean_lines(raw(ws, "restore", "--", CLEARS, FORGED).stdout)
    assert said == [r'restored 2 paths: "m\033[2Jod", "x\nM fake"']
    assert (ws / CLEARS).read_text() == "before\n" and not (ws / FORGED).exists()

    ws.checkpoint("evil\x1b[2J\rmessage")
    log = clean_lines(raw(ws, "log").stdout)
    assert log[1].endswith(r"evil\033[2J\rmessage")
    assert ws.json("log")[-1]["message"] == "evil\x1b[2J\rmessage"  # kept exactly


def test_run_summary_quotes_names(mounted):
    ws = mounted
    forged = ws / "r\nM forged"
    r = subprocess.run(
        [*COWFS, "-C", str(ws.path), "run", "--", "touch", str(forged), str(ws / RED)],
        capture_output=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    said = clean_lines(r.stderr)
    layer = ws.json("log")[-1]["id"]
    assert said == [
        "2 changes: 2 added",
        r'  A "\033[31mred"',
        r'  A "r\nM forged"',
        f"cowfs: kept as layer {layer} ('cowfs rollback --to {layer}' undoes it)",
    ] or said == [
        "2 changes: 2 added",
        r'  A "r\nM forged"',
        r'  A "\033[31mred"',
        f"cowfs: kept as layer {layer} ('cowfs rollback --to {layer}' undoes it)",
    ]
    assert forged.exists()
    assert {c["path"] for c in ws.json("status")["changes"]} == {"r\nM forged", RED}


def test_plain_names_print_as_before(mounted):
    ws = mounted
    ws.checkpoint("plain")
    (ws / "a.txt").write_text("changed\n")
    os.rename(ws / "dir" / "b.txt", ws / "dir" / "c d.txt")
    assert clean_lines(raw(ws, "status").stdout)[1:3] == [
        "M a.txt",
        "R dir/b.txt -> dir/c d.txt",
    ]
    assert clean_lines(raw(ws, "diff", "--name-status").stdout, tabs=True) == [
        "M\ta.txt",
        "R\tdir/b.txt -> dir/c d.txt",
    ]
    out = clean_lines(raw(ws, "diff").stdout)
    assert out[:3] == ["diff --cowfs M a.txt", "--- a/a.txt", "+++ b/a.txt"]
    assert json.loads(raw(ws, "--json", "status").stdout)["changes"][0]["path"] == "a.txt"
