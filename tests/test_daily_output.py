"""What the commands say in cases a user trial found them unclear: a
workspace that is not mounted, text files too large to diff, symlink
targets in diffs, multi-line messages in `log`, `unmount` from inside the
workspace, the directories `hooks uninstall` leaves, and the MCP tools'
`run` result and argument errors."""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest

from cowfs.interface import agents
from cowfs.system.mounts import is_cowfs_mount
from cowfs.text import first_line

from .helpers import COWFS
from .test_mcp import fails, ok, serve

NOT_MOUNTED = "not mounted — changes since the last unmount are not captured"


def test_an_unmounted_workspace_says_so_in_status_log_and_diff(mounted):
    ws = mounted
    ws.unmount()
    (ws / "written-since.txt").write_text("not captured\n")  # (no layer sees it)

    status = ws.cowfs("status").stdout.splitlines()
    assert status[0] == f"# {NOT_MOUNTED}"
    assert status[1] == "# no changes"
    assert ws.json("status")["mounted"] is False

    log = ws.cowfs("log").stdout.splitlines()
    assert log[0] == f"# {NOT_MOUNTED}" and log[1].split() == [
        "ID",
        "CREATED",
        "CHANGES",
        "SIZE",
        "MESSAGE",
    ]

    for args in (["diff"], ["diff", "--stat"], ["diff", "--name-status"]):
        r = ws.cowfs(*args)
        assert r.stdout == "" and r.stderr.strip() == f"cowfs: warning: {NOT_MOUNTED}", args
    diff = ws.cowfs("--json", "diff")
    assert json.loads(diff.stdout)["mounted"] is False and NOT_MOUNTED not in diff.stderr

    ws.mount()  # mounted: not a word of it
    assert ws.cowfs("status").stdout.splitlines()[0] == "# no changes"
    assert NOT_MOUNTED not in ws.cowfs("log").stdout + ws.cowfs("diff").stderr


def test_log_shows_the_first_line_of_a_message_of_many_json_all_of_it(mounted):
    ws = mounted
    message = "fix the build\n\nthe second paragraph\nsays more"
    layer = ws.checkpoint(message)
    rows = ws.cowfs("log").stdout.splitlines()
    (row,) = [r for r in rows if r.split()[1:2] == [str(layer)]]
    assert row.endswith("  fix the build …") and rows.index(row) == 1
    assert not any("second paragraph" in r for r in rows)
    assert ws.log()[-1]["message"] == message
    assert ws.checkpoint("one line") and ws.cowfs("log").stdout.splitlines()[1].endswith(
        "  one line"
    )


def test_first_line_of_a_message():
    assert first_line("one") == "one"
    assert first_line("\n  \nfix it\r\nand more\n") == "fix it …"
    assert first_line("a\rb\x1b[2J") == r"a\rb\033[2J"  # (one line, escaped)
    assert first_line("") == "" and first_line("\n\n") == ""


def test_a_text_file_too_large_to_diff_says_so_and_diff_text_diffs_it(mounted):
    ws = mounted
    line = "line 0 of a large log, long enough to make megabytes of it quickly\n"
    big = "".join(line.replace("0", str(i), 1) for i in range((9 << 20) // len(line) + 1))
    assert len(big) > 9 << 20  # over the 8 MiB limit
    (ws / "big.log").write_text(big)
    (ws / "blob.bin").write_bytes(b"\0\1\2" * (3 << 20))  # binary, as large
    layer = ws.checkpoint("large files")
    (ws / "big.log").write_text(big.replace(line, "an edited line\n", 1))
    (ws / "blob.bin").write_bytes(b"\0\1\3" * (3 << 20))

    r = ws.cowfs("diff")
    rows = r.stdout.splitlines()
    (text,) = [x for x in rows if x.startswith("Text")]
    assert text.startswith("Text, too large to diff (over 8.0 MiB): ") and "xxh3" in text
    (binary,) = [x for x in rows if x.startswith("Binary")]
    assert rows[rows.index(binary) - 1] == "diff --cowfs M blob.bin"
    assert "cowfs diff --text" in r.stderr
    stat = ws.cowfs("diff", "--stat").stdout.splitlines()
    assert stat[0].split("|")[1].strip() == "text too large to diff (over 8.0 MiB)"
    assert stat[1].split("|")[1].strip().startswith("binary ")
    (entry,) = [c for c in ws.json("diff")["changes"] if c["path"] == "big.log"]
    assert (entry["binary"], entry["too_large"], entry["text_limit"]) == (False, True, 8 << 20)
    assert "diff" not in entry

    r = ws.cowfs("diff", "--text")
    assert "-" + line + "+an edited line\n" in r.stdout and "Binary: " in r.stdout
    assert r.stderr == ""
    stat = ws.cowfs("diff", "--text", "--stat").stdout.splitlines()
    assert stat[0].split("|")[1].strip() == "+1 -1"
    assert "--text" in ws.cowfs("diff", "--help").stdout
    assert ws.json("diff", str(layer))["changes"][0]["text_limit"] == 8 << 20

    # past 64 MiB, --text too says it is too large
    (ws / "huge.log").write_text(line * ((65 << 20) // len(line)))
    (huge,) = [x for x in ws.cowfs("diff", "--text").stdout.splitlines() if x.startswith("Text")]
    assert huge.startswith("Text, too large to diff (over 64.0 MiB): (none) -> ")


def test_a_new_text_file_of_many_lines_is_diffed(mounted):
    """(Its diff against nothing is quick whatever its size: it was said to
    have too many lines to diff from some 5,500 lines on.)"""
    ws = mounted
    (ws / "numbers").write_text("".join(f"{i}\n" for i in range(50_000)))
    (ws / "a.txt").unlink()
    stat = ws.cowfs("diff", "--stat").stdout.splitlines()
    assert [x.split("|")[1].strip() for x in stat] == ["+0 -1", "+50000 -0"]


def test_a_symlinks_diff_shows_its_target(mounted):
    ws = mounted
    os.symlink("dir/b.txt", ws / "old-link")
    os.symlink("a.txt", ws / "gone-link")
    (ws / "was-a-file").write_text("text\n")
    ws.checkpoint("links")
    os.symlink("a.txt", ws / "new-link")
    os.symlink("new\nline", ws / "odd-link")
    (ws / "old-link").unlink()
    os.symlink("a.txt", ws / "old-link")
    (ws / "gone-link").unlink()
    (ws / "was-a-file").unlink()
    os.symlink("dir", ws / "was-a-file")

    diff = ws.cowfs("diff").stdout
    assert (
        "diff --cowfs A new-link\nnew symlink mode 120777\n--- /dev/null\n+++ b/new-link\n"
        "@@ -0,0 +1 @@\n+a.txt\n\\ No newline at end of file\n"
    ) in diff
    assert (
        "diff --cowfs M old-link\nold symlink mode 120777\nnew symlink mode 120777\n"
        "--- a/old-link\n+++ b/old-link\n@@ -1 +1 @@\n-dir/b.txt\n"
        "\\ No newline at end of file\n+a.txt\n\\ No newline at end of file\n"
    ) in diff
    assert "+++ /dev/null\n@@ -1 +0,0 @@\n-a.txt\n" in diff  # gone-link
    assert '+"new\\nline"\n' in diff  # (quoted in the lines; exact in JSON)
    assert "new symlink mode 120777 -> dir\n" in diff  # a file became a symlink
    stat = dict(x.split("|") for x in ws.cowfs("diff", "--stat").stdout.splitlines())
    assert {k.strip(): v.strip() for k, v in stat.items() if "link" in k} == {
        "gone-link": "+0 -1",
        "new-link": "+1 -0",
        "odd-link": "+1 -0",
        "old-link": "+1 -1",
    }
    sides = {c["path"]: c for c in ws.json("diff")["changes"]}
    assert sides["odd-link"]["new"]["target"] == "new\nline"
    assert sides["old-link"]["old"]["target"] == "dir/b.txt"
    assert sides["was-a-file"]["new"]["target"] == "dir"


def test_unmount_from_inside_the_workspace_says_to_cd_out(mounted):
    ws = mounted
    cowfs = shlex.join(COWFS)

    def from_a_shell(where, script: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["sh", "-c", script], cwd=where, capture_output=True, text=True, timeout=120
        )

    for where, script in (
        (ws.path, f"{cowfs} unmount ."),  # the shell and cowfs in its root
        (ws / "dir", f"{cowfs} unmount {ws.path}"),  # in a directory below it
        (ws.path, f"sh -c 'cd / && {cowfs} unmount {ws.path}'"),  # only the shell above
    ):
        r = from_a_shell(where, f"echo $$; {script}; exit $?")  # (the shell stays)
        shell = r.stdout.split()[0]
        assert r.returncode == 5, r
        assert r.stderr == (
            f"cowfs: you are inside the workspace {ws.path}: cd out of it first "
            f"({shell} (sh) has its working directory there)\n"
        )
        assert is_cowfs_mount(str(ws.path))

    # another process in it is still named as what keeps it busy
    other = subprocess.Popen(["sleep", "600"], cwd=ws.path)
    try:
        r = from_a_shell("/", f"{cowfs} unmount {ws.path}")
        assert r.returncode == 5 and f"used by {other.pid} (sleep)" in r.stderr
        assert "you are inside" not in r.stderr
    finally:
        other.kill()
        other.wait()
    r = from_a_shell(ws.path, f"cd / && exec {cowfs} unmount {ws.path}")  # (the shell left)
    assert r.returncode == 0, r.stderr
    ws.mounted = False
    assert not is_cowfs_mount(str(ws.path))


@pytest.mark.parametrize("agent", sorted(agents.AGENTS))
def test_hooks_uninstall_removes_the_directory_install_made_and_only_that(mounted, agent):
    ws = mounted
    settings = ws / agents.AGENTS[agent].settings
    folder = settings.parent
    ws.cowfs("hooks", "install", agent)
    assert settings.exists()
    res = ws.json("hooks", "uninstall", agent)
    assert res["removed"] and res["removed_dir"] == str(folder)
    assert not folder.exists()

    # a directory that was there before stays, empty as it was
    folder.mkdir()
    ws.cowfs("hooks", "install", agent)
    r = ws.cowfs("hooks", "uninstall", agent)
    assert "which install made" not in r.stdout
    assert folder.is_dir() and not any(folder.iterdir())
    folder.rmdir()

    # one it made stays while the user keeps something in it
    ws.cowfs("hooks", "install", "--per-tool", agent)
    (folder / "notes.md").write_text("mine\n")
    ws.cowfs("hooks", "uninstall", agent)
    assert not settings.exists() and [p.name for p in folder.iterdir()] == ["notes.md"]
    (folder / "notes.md").unlink()  # ... and goes with the next uninstall, once empty
    assert "which install made" in ws.cowfs("hooks", "uninstall", agent).stdout
    assert not folder.exists()


def test_mcp_run_gives_changes_as_status_does_and_names_no_layer_it_has_not(mounted):
    ws = mounted

    async def steps(s):
        r = await s.call_tool("run", {"command": "echo x > new.txt; exit 3"})
        assert not r.is_error
        head = r.content[0].text.splitlines()[0]
        assert head == "rolled back: exit 3, 1 change(s)"  # (was "..., layer None")
        assert r.structured_content["layer"] is None
        assert r.structured_content["changes"] == [{"path": "new.txt", "kind": "A"}]

        kept = await ok(s, "run", command="echo y >> a.txt; mkdir d; touch d/f", message="k")
        layer = kept["layer"]
        status = await ok(s, "status")
        assert status["id"] == layer and kept["changes"] == status["changes"]
        assert {"path": "a.txt", "kind": "M"} in kept["changes"]
        text = (await s.call_tool("run", {"command": "true"})).content[0].text
        assert text.startswith("kept: exit 0, 0 change(s), in layer ")

    serve(ws.path, steps)


def test_mcp_arguments_of_the_wrong_type_are_a_one_line_usage_error(mounted):
    ws = mounted

    async def steps(s):
        said = {}
        for tool, args in (
            ("diff", {"layer": "abc"}),
            ("run", {"command": 5}),
            ("show", {"path": "a.txt"}),
            ("diff", {"paths": "a.txt", "max_bytes": 3}),
            ("restore", {"paths": ["a.txt"], "from": "two"}),
        ):
            code, text = await fails(s, tool, **args)
            assert code == 2 and "\n" not in text and "pydantic" not in text, text
            said[tool, *args] = text
        assert said["diff", "layer"] == (
            'cowfs: diff: argument layer should be a valid integer, not "abc" (exit code 2)'
        )
        assert said["run", "command"] == (
            "cowfs: run: argument command should be a valid string or a valid list, "
            "not 5 (exit code 2)"
        )
        assert said["show", "path"] == "cowfs: show: argument layer is required (exit code 2)"
        assert said["diff", "paths", "max_bytes"] == (
            'cowfs: diff: argument paths should be a valid list, not "a.txt"; argument '
            "max_bytes should be greater than or equal to 256, not 3 (exit code 2)"
        )
        assert (
            'argument from should be a valid integer, not "two"' in said["restore", "paths", "from"]
        )
        assert (await ok(s, "checkpoint", message="still serving"))["id"] == 2

    serve(ws.path, steps)
