"""README.md against cowfs: its console examples are real runs that
tools/readme makes, and must still be what cowfs prints; every command it
names must exist, and have a section of its own; every command's --help
must document each of its options."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cowfs.interface.cli import command_of
from cowfs.interface.commands import COMMANDS, build_parser

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"


def test_examples_are_what_cowfs_prints(fuse):
    """tools/readme --check runs every example for real (mounting its own
    temporary workspaces) and compares the output with README.md."""
    r = subprocess.run(
        [sys.executable, str(REPO / "tools" / "readme"), "--check"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, (
        "README.md's examples differ from what cowfs prints now; if the new output is "
        f"meant, run 'tools/readme --write' and review the diff\n{r.stderr}\n{r.stdout}"
    )


def code_of(text: str) -> list[str]:
    """What README.md shows as code a reader types: inline code spans,
    lines of non-console fenced blocks and of indented blocks, and the
    commands ("$ " lines) of console blocks (their output is cowfs's)."""
    found = re.findall(r"`([^`\n]+)`", text)
    fence = None
    for line in text.splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:]
        elif fence == "console":
            if line.startswith("$ "):
                found.append(line[2:])
        elif fence is not None or line.startswith("    "):
            found.append(line)
    return found


# `cowfs` where a command starts: at the start, or after a pipe, a ; or && or
# a (, or after a "--" (as in `claude mcp add cowfs -- cowfs mcp ...`)
COWFS_WORDS = re.compile(r"(?:^\s*|[;&|(]\s*|--\s+)cowfs((?: +[^\s`|;&)'\"]+)*)", re.M)


def named_commands(text: str) -> list[tuple[str, list[str]]]:
    """Each `cowfs ...` in the README's code: (the command, the words
    after it)."""
    named = []
    for code in code_of(text):
        for m in COWFS_WORDS.finditer(code):
            words = m.group(1).split()
            command = command_of(words)
            if command is not None and not command.startswith(("~", "<", "/", "$")):
                named.append((command, words[words.index(command) + 1 :]))
    return named


def actions(name: str) -> dict[str, argparse.ArgumentParser]:
    """The subcommand's own actions (provider add, hooks install), if any."""
    parser = build_parser(only=name)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = sub.choices[name]
    for action in command._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_every_command_the_readme_names_exists():
    named = named_commands(README.read_text())
    assert {command for command, _ in named} >= {"mount", "checkpoint", "rollback", "status"}
    unknown = sorted({command for command, _ in named if command not in COMMANDS})
    assert not unknown, f"README.md names commands cowfs does not have: {unknown}"
    for command, words in named:
        acts = actions(command)
        if acts and words and not words[0].startswith("-"):
            assert words[0] in acts, f"README.md: 'cowfs {command} {words[0]}' does not exist"


def test_every_command_has_a_section():
    headings = [line for line in README.read_text().splitlines() if line.startswith("#")]
    missing = [
        name
        for name in COMMANDS
        if not any(re.search(rf"\bcowfs {name}\b", heading) for heading in headings)
    ]
    assert not missing, f"README.md has no section (a heading naming 'cowfs NAME') for {missing}"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_documents_every_option(name, capsys):
    """`cowfs NAME --help` works and says what each option is for (the
    README leaves options to --help)."""
    with pytest.raises(SystemExit) as exit:
        build_parser(only=name).parse_args([name, "--help"])
    assert exit.value.code == 0
    assert f"usage: cowfs {name}" in capsys.readouterr().out
    parser = build_parser(only=name)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    todo = [(name, sub.choices[name])]
    while todo:
        what, p = todo.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{what} {n}", s) for n, s in action.choices.items()]
            elif not isinstance(action, argparse._HelpAction):
                label = "/".join(action.option_strings) or action.dest
                assert action.help, f"cowfs {what} --help says nothing of {label}"


def test_every_exit_code_is_documented():
    from cowfs import errors

    text = README.read_text()
    table = text[text.index("## Exit codes") :]
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)}
    codes = {v for k, v in vars(errors).items() if k.isupper() and isinstance(v, int)}
    assert codes == documented, f"errors.py: {sorted(codes)}; README.md: {sorted(documented)}"
