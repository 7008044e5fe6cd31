"""What the commands say in cases a user trial found them unclear: a
workspace that is not mounted, text files too large to diff, symlink
targets in diffs, multi-line messages in `log`, `unmount` from inside the
workspace, the directories `hooks uninstall` leaves, and the MCP tools'
`run` result and argument errors."""

from __future__ import annotations

import json

from cowfs.text import first_line

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
