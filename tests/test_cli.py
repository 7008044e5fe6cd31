"""The command line as git users expect it: paths relative to the current
directory inside the workspace, options anywhere, JSON for every error
(usage errors too), help that explains every option with examples, and
messages that say what to do."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import pytest

from cowfs.errors import ALREADY_MOUNTED, NOT_MOUNTED, USAGE
from cowfs.interface import cli

from .helpers import COWFS


def cowfs_in(cwd, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*COWFS, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def edited(mounted):
    """A layer that changed a.txt and dir/b.txt."""
    layer = mounted.checkpoint("edit")
    (mounted / "a.txt").write_text("ALPHA\n")
    (mounted / "dir" / "b.txt").write_text("BETA\n")
    return mounted, layer


def test_paths_are_relative_to_the_current_directory_inside_the_workspace(edited):
    ws, layer = edited
    sub = ws / "dir"
    names = lambda r: [c["path"] for c in json.loads(r.stdout)["changes"]]  # noqa: E731
    assert names(cowfs_in(sub, "--json", "diff", "--", "b.txt")) == ["dir/b.txt"]
    assert names(cowfs_in(sub, "--json", "diff", "--", "../a.txt")) == ["a.txt"]
    assert names(cowfs_in(sub, "--json", "diff", "--", ws / "a.txt")) == ["a.txt"]
    assert names(cowfs_in(sub, "--json", "diff", "--", ".")) == ["dir/b.txt"]
    # outside the workspace: an error naming the path
    r = cowfs_in(sub, "diff", "--", "/etc/passwd")
    assert r.returncode == USAGE and "/etc/passwd: outside the workspace" in r.stderr
    # show and restore take them the same way
    assert cowfs_in(sub, "show", f"{layer}:b.txt").stdout == "beta\n"
    r = cowfs_in(sub, "restore", "b.txt")
    assert r.returncode == 0, r.stderr
    assert (ws / "dir" / "b.txt").read_text() == "beta\n"
    assert (ws / "a.txt").read_text() == "ALPHA\n"  # only what was named
    # outside the workspace, -C PATH: relative to the workspace's root, as before
    assert names(cowfs_in("/", "-C", ws.path, "--json", "diff", "--", "a.txt")) == ["a.txt"]


def test_options_and_positionals_in_any_order(edited):
    ws, layer = edited
    runs = [
        cowfs_in(ws.path, "diff", str(layer), "--stat", "--", "a.txt"),
        cowfs_in(ws.path, "diff", "--stat", str(layer), "--", "a.txt"),
        cowfs_in(ws.path, "--json", "diff", "--stat", str(layer), "--", "a.txt"),
    ]
    assert runs[0].returncode == 0 and runs[0].stdout == runs[1].stdout
    assert "a.txt" in runs[0].stdout and "b.txt" not in runs[0].stdout
    assert json.loads(runs[2].stdout)["changes"][0]["path"] == "a.txt"


@pytest.mark.parametrize(
    "args, says",
    [
        (["--json", "diff", "--bogus"], "unrecognized arguments: --bogus"),
        (["--json", "frobnicate"], "invalid choice: 'frobnicate'"),
        (["--json", "diff", "notanumber"], "not a layer id"),
        (["--json", "rollback", "--to", "x"], "invalid int value"),
    ],
)
def test_usage_errors_are_json_with_json(args, says):
    r = cowfs_in("/", *args)
    assert r.returncode == USAGE
    err = json.loads(r.stdout)
    assert err["code"] == USAGE and says in err["error"]
    assert says in r.stderr  # (and the line for people)


@pytest.mark.parametrize(
    "text, size",
    [
        ("0", 0),
        ("4096", 4096),
        ("64K", 64 << 10),
        ("64k", 64 << 10),
        ("64KB", 64 << 10),
        ("64KiB", 64 << 10),
        ("64kib", 64 << 10),
        (" 500M ", 500 << 20),
        ("2G", 2 << 30),
        ("1.5g", 3 << 29),
        ("1T", 1 << 40),
        ("10b", 10),
    ],
)
def test_sizes_take_a_number_and_a_binary_unit(text, size):
    assert cli.parse_limit(text) == size


@pytest.mark.parametrize("text", ["", "M", "-1", "-1M", "1X", "1.5.2K", "nan", "inf", "1P", "ten"])
def test_what_is_not_a_size_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        cli.parse_limit(text)
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        cli.parse_size(text)


@pytest.mark.parametrize(
    "text, size",
    [("4K", 4096), ("64k", 64 << 10), ("1M", 1 << 20), ("65536", 65536), ("128KiB", 128 << 10)],
)
def test_a_chunk_size_is_a_power_of_two_from_4k_to_1m(text, size):
    assert cli.parse_size(text) == size


@pytest.mark.parametrize("text", ["0", "2K", "1000", "96K", "2M", "1G"])
def test_other_chunk_sizes_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="power of two from 4K to 1M"):
        cli.parse_size(text)


@pytest.mark.parametrize(
    "parse, good, bad, says",
    [
        (
            cli.parse_number,
            ["1", "10", "007"],
            ["0", "", "-1", "+1", "1.0", "x", " 1", "\u0663"],
            "not a positive number",
        ),
        (cli.parse_count, ["0", "3"], ["", "-1", "two", "1e3"], "not a number of layers"),
        (cli.layer_id, ["0", "12"], ["HEAD", "-1", "a.txt"], "not a layer id"),
    ],
)
def test_counts_are_whole_numbers_in_digits(parse, good, bad, says):
    assert [parse(t) for t in good] == [int(t) for t in good]
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            parse(text)


def test_every_command_explains_every_option_and_shows_examples():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        assert p.epilog and p.epilog.startswith("examples:"), name
        for action in p._actions:
            assert action.help, (name, action.dest)
    r = cowfs_in("/", "rollback", "--help")
    assert r.returncode == 0 and "examples:" in r.stdout and "--dry-run" in r.stdout


def test_outside_any_workspace_the_message_says_what_to_do(tmp_path):
    r = cowfs_in(tmp_path, "checkpoint")
    assert r.returncode == NOT_MOUNTED
    assert (
        f"({tmp_path}) is not inside a mounted cowfs workspace; mount one with "
        "'cowfs mount DIR'" in r.stderr
    )


def test_a_busy_unmount_names_the_processes(mounted):
    holder = subprocess.Popen(["sleep", "600"], cwd=mounted / "dir")
    try:
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{holder.pid}/cwd") != str(mounted / "dir"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = mounted.cowfs("unmount", check=False)
        assert r.returncode == ALREADY_MOUNTED
        assert f"is busy: used by {holder.pid} (sleep); close them, or use --lazy" in r.stderr
    finally:
        holder.kill()
        holder.wait()


def test_version_is_said_from_one_place():
    """`cowfs --version` says the package's version, which pyproject.toml
    takes from cowfs.__version__ (the one place it is written)."""
    import tomllib

    import cowfs

    r = subprocess.run([*COWFS, "--version"], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, f"cowfs {cowfs.__version__}\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(cowfs.__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "cowfs.__version__"}
