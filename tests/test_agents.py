"""Agent CLI hooks: `cowfs hooks install|uninstall AGENT`, `cowfs hook AGENT
EVENT` fed the event payloads each agent documents, and `cowfs rewind`, on
real mounts."""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cowfs.interface import agents, jsonedit
from cowfs.layers import treesnap

from .helpers import COWFS
from .test_run import _run_on_a_terminal

# -- the payloads each agent documents -------------------------------------------------
# Claude Code: code.claude.com/docs/en/hooks as of 2026-08-22 (Claude Code 2.1.240):
# "UserPromptSubmit input" and the PreToolUse example under "Common input fields"; Write's
# tool_input as in "PreToolUse input" (file_path always absolute).
CLAUDE_PROMPT = {
    "session_id": "abc123",
    "transcript_path": "/Users/.../.claude/projects/.../00893aaf-19fa-41d2-8238-13269b9b3ca0.jsonl",
    "cwd": "/Users/...",
    "permission_mode": "default",
    "hook_event_name": "UserPromptSubmit",
    "prompt": "Write a function to calculate the factorial of a number",
}
CLAUDE_BASH = {
    "session_id": "abc123",
    "prompt_id": "550e8400-e29b-41d4-a716-446655440000",
    "transcript_path": "/home/user/.claude/projects/.../transcript.jsonl",
    "cwd": "/home/user/my-project",
    "permission_mode": "default",
    "hook_event_name": "PreToolUse",
    "tool_name": "Bash",
    "tool_input": {
        "command": "npm test",
        "description": "Run test suite",
        "timeout": 120000,
        "run_in_background": False,
    },
    "tool_use_id": "toolu_01ABC123...",
}
CLAUDE_WRITE = {
    "hook_event_name": "PreToolUse",
    "tool_name": "Write",
    "tool_input": {"file_path": "{ws}/src/index.ts", "content": "..."},
}
# Gemini CLI: docs/hooks/reference.md of google-gemini/gemini-cli main, 2026-08-21
# (0.56.0-nightly): the base input schema plus BeforeAgent's prompt; BeforeTool as in
# docs/hooks/best-practices.md ("Test hooks independently").
GEMINI_PROMPT = {
    "session_id": "test-123",
    "transcript_path": "/tmp/test/.gemini/transcript.json",
    "cwd": "/tmp/test",
    "hook_event_name": "BeforeAgent",
    "timestamp": "2026-08-21T16:16:56.000Z",
    "prompt": "Refactor the parser\n\nand keep the tests green",
}
GEMINI_WRITE = {
    "session_id": "test-123",
    "cwd": "/tmp/test",
    "hook_event_name": "BeforeTool",
    "tool_name": "write_file",
    "tool_input": {"file_path": "test.txt", "content": "Test content"},
}
# Codex: the input schemas codex-rs/hooks/schema/generated/user-prompt-submit and
# pre-tool-use .command.input.schema.json (openai/codex; developers.openai.com/codex/hooks
# as of 2026-05-18); apply_patch hands its patch over as tool_input.command.
CODEX_PROMPT = {
    "cwd": "/home/user/proj",
    "hook_event_name": "UserPromptSubmit",
    "model": "gpt-5-codex",
    "permission_mode": "default",
    "prompt": "hello",
    "session_id": "019d036d-c7f9-7000-8000-000000000001",
    "transcript_path": None,
    "turn_id": "019d036d-c7fa-72d2-b6fd-78878bfe34e4",
}
CODEX_BASH = {
    "cwd": "/home/user/proj",
    "hook_event_name": "PreToolUse",
    "model": "gpt-5-codex",
    "permission_mode": "default",
    "session_id": "019d036d-c7f9-7000-8000-000000000001",
    "tool_input": {"command": "cargo test"},
    "tool_name": "Bash",
    "tool_use_id": "call_1",
    "transcript_path": None,
}
CODEX_PATCH = CODEX_BASH | {
    "tool_name": "apply_patch",
    "tool_use_id": "call_2",
    "tool_input": {
        "command": "*** Begin Patch\n*** Update File: src/lib.rs\n@@\n-a\n+b\n"
        "*** Add File: NOTES.md\n+x\n*** End Patch\n"
    },
}


def payload(template: dict, ws) -> bytes:
    """A documented payload, happening in workspace *ws*."""
    d = json.loads(json.dumps(template).replace("{ws}", str(ws.path)))
    if "cwd" in d:
        d["cwd"] = str(ws.path)
    return json.dumps(d).encode()


def hook(agent: str, event: str, data: bytes, *pre: str) -> subprocess.CompletedProcess:
    """Run `cowfs hook` as an agent does: the event JSON on stdin, from
    somewhere else (the workspace comes from -C or the payload's cwd)."""
    return subprocess.run(
        [*COWFS, *pre, "hook", agent, event], input=data, cwd="/", capture_output=True, timeout=120
    )


def agent_layers(ws) -> list[dict]:
    return [x for x in ws.log() if x.get("agent")]


@pytest.mark.parametrize(
    "agent,prompt,tools,messages",
    [
        (
            "claude-code",
            CLAUDE_PROMPT,
            [CLAUDE_BASH, CLAUDE_WRITE],
            [
                "Write a function to calculate the factorial of a number",
                "Bash: npm test",
                "Write: src/index.ts",
            ],
        ),
        ("gemini", GEMINI_PROMPT, [GEMINI_WRITE], ["Refactor the parser", "write_file: test.txt"]),
        (
            "codex",
            CODEX_PROMPT,
            [CODEX_BASH, CODEX_PATCH],
            ["hello", "Bash: cargo test", "apply_patch: src/lib.rs, NOTES.md"],
        ),
    ],
)
def test_documented_events_become_checkpoints(mounted, agent, prompt, tools, messages):
    ws = mounted
    a = agents.AGENTS[agent]
    r = hook(agent, a.prompt_event, payload(prompt, ws))
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")
    (ws / "a.txt").write_text("the agent's first edit\n")
    for tool in tools:
        r = hook(agent, a.tool_event, payload(tool, ws), "-C", str(ws.path / "dir"))
        assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")
    layers = agent_layers(ws)
    assert [x["message"] for x in layers] == messages
    turn = layers[0]["agent"]
    assert (turn["agent"], turn["event"], turn["kind"]) == (agent, a.prompt_event, "prompt")
    assert turn["session"] == prompt["session_id"]
    assert turn.get("turn") == prompt.get("turn_id")
    for layer, tool in zip(layers[1:], tools, strict=False):
        rec = layer["agent"]
        assert (rec["kind"], rec["tool"], rec["event"]) == ("tool", tool["tool_name"], a.tool_event)
    assert layers[0]["changes"] == 1  # the edit belongs to the turn
    text = ws.cowfs("log").stdout
    assert f"{agent} turn ({a.prompt_event}, session {prompt['session_id'][:8]})" in text
    assert f"{agent} before {tools[0]['tool_name']}" in text


@pytest.mark.parametrize("agent", sorted(agents.AGENTS))
def test_a_hook_never_blocks_the_agent(workspace, agent):
    """Not mounted, unreadable input, an unknown agent: exit 0, one line for
    the agent's log, and a systemMessage for the user; no traceback."""
    a = agents.AGENTS[agent]
    for pre, data, why in (
        (
            [],
            payload(CLAUDE_PROMPT | {"hook_event_name": a.prompt_event}, workspace),
            "not inside a mounted cowfs workspace",
        ),
        (["-C", str(workspace.path)], b"{not json", "not valid JSON"),
    ):
        r = hook(agent, a.prompt_event, data, *pre)
        assert r.returncode == 0
        [line] = r.stderr.decode().splitlines()
        assert line.startswith("cowfs: no checkpoint taken: ") and why in line
        assert json.loads(r.stdout) == {"systemMessage": line}
    r = hook("aider", "UserPromptSubmit", b"{}", "-C", str(workspace.path))
    assert r.returncode == 0 and b"unknown agent 'aider'" in r.stderr
    r = hook(agent, "SessionEnd", b"{}", "-C", str(workspace.path))
    assert (r.returncode, r.stdout) == (0, b"")
    assert b"not one cowfs checkpoints at" in r.stderr


def test_an_installed_hook_that_cannot_run_cowfs_still_lets_the_agent_go_on(monkeypatch, tmp_path):
    """cowfs uninstalled, or one too old to know `hook` (argparse's exit 2
    would block Claude Code's prompt): the command still exits 0 and says so."""
    old = tmp_path / "cowfs"
    old.write_text("#!/bin/sh\necho 'cowfs: invalid choice: hook' >&2\nexit 2\n")
    old.chmod(0o755)
    for argv in ([str(old)], [str(tmp_path / "gone" / "cowfs")]):
        monkeypatch.setattr(agents, "cowfs_argv", lambda argv=argv: argv)
        command = agents.hook_command(
            agents.AGENTS["claude-code"], str(tmp_path), "UserPromptSubmit"
        )
        r = subprocess.run(["sh", "-c", command], input=b"{}", capture_output=True, timeout=60)
        assert r.returncode == 0 and json.loads(r.stdout) == agents.FALLBACK


# -- installing ----------------------------------------------------------------------

USER_SETTINGS = {
    "claude-code": """{
    "$schema": "https://json.schemastore.org/claude-code-settings.json",
    "permissions": {"allow": ["Bash(npm run lint)"]},
    "hooks": {
        "UserPromptSubmit": [
            {
                "hooks": [{"type": "command", "command": "~/bin/log-prompt \\u00e9"}]
            }
        ],
        "PostToolUse": [{"matcher": "Write|Edit", "hooks": [{"type": "command",
            "command": "prettier --write \\"$FILE\\""}]}]
    },
    "model": "opus"
}
""",
    "gemini": """// the team's Gemini settings
{
\t"general": {"vimMode": true}, /* keep */
\t"hooks": {
\t\t"BeforeTool": [
\t\t\t{"matcher": "write_file|replace", "hooks": [{"name": "security-check",
\t\t\t  "type": "command", "command": "$GEMINI_PROJECT_DIR/.gemini/hooks/security.sh",
\t\t\t  "timeout": 5000}]}
\t\t]
\t}
}""",
    "codex": """{"hooks": {"SessionStart": [{"matcher": "startup|resume", "hooks": [{"type": "command", "command": "sh .codex/hooks/session-start.sh", "statusMessage": "Loading context"}]}]}}
""",  # noqa: E501 (the user's file as it is, one long line)
}


@pytest.mark.parametrize("agent", sorted(agents.AGENTS))
def test_install_keeps_the_users_settings_byte_for_byte(mounted, agent):
    ws = mounted
    a = agents.AGENTS[agent]
    path = ws.path / a.settings
    path.parent.mkdir()
    original = USER_SETTINGS[agent].encode()
    path.write_bytes(original)
    os.chmod(path, 0o640)
    mine = jsonedit.parse(original.decode(), comments=a.comments).value

    ws.cowfs("hooks", "install", agent, "-C", str(ws.path / "dir"))
    text = path.read_text()
    once = path.read_bytes()
    settings = jsonedit.parse(text, comments=a.comments).value
    for key, value in mine.items():  # everything of the user's is kept
        if key != "hooks":
            assert settings[key] == value
    for event, groups in mine["hooks"].items():
        assert settings["hooks"][event][: len(groups)] == groups
    [ours] = [
        g
        for g in settings["hooks"][a.prompt_event]
        if any(agents.is_ours(h["command"], a) for h in g["hooks"])
    ]
    command = ours["hooks"][0]["command"]
    words = shlex.split(command)
    assert words[-8:-3] == ["-C", str(ws.path), "hook", agent, a.prompt_event]
    assert words[-3:-1] == ["||", "echo"] and json.loads(words[-1]) == agents.FALLBACK
    assert a.tool_event not in settings["hooks"] or a.tool_event in mine["hooks"]
    assert os.stat(path).st_mode & 0o777 == 0o640

    ws.cowfs("hooks", "install", agent)  # again: nothing changes
    assert path.read_bytes() == once
    ws.cowfs("hooks", "install", "--per-tool", agent)
    settings = jsonedit.parse(path.read_text(), comments=a.comments).value
    [tool_group] = [
        g for g in settings["hooks"][a.tool_event] if g.get("matcher") == a.tool_matcher
    ]
    assert agents.is_ours(tool_group["hooks"][0]["command"], a)

    # the installed command, run as the agent runs it (sh -c, the event on stdin)
    r = subprocess.run(
        ["sh", "-c", command],
        input=payload(CLAUDE_PROMPT | {"hook_event_name": a.prompt_event}, ws),
        capture_output=True,
        cwd="/",
        timeout=120,
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")
    assert ws.log()[-1]["message"] == CLAUDE_PROMPT["prompt"]

    r = ws.cowfs("--json", "hooks", "uninstall", agent)
    assert json.loads(r.stdout)["changed"]
    assert path.read_bytes() == original
    assert os.stat(path).st_mode & 0o777 == 0o640
    r = ws.cowfs("hooks", "uninstall", agent)
    assert "no cowfs hooks" in r.stdout and path.read_bytes() == original


@pytest.mark.parametrize("agent", sorted(agents.AGENTS))
def test_install_into_no_settings_and_uninstall_leaves_none(mounted, agent):
    ws = mounted
    a = agents.AGENTS[agent]
    ws.cowfs("hooks", "install", "--per-tool", agent)
    settings = json.loads((ws.path / a.settings).read_text())
    assert set(settings) == {"hooks"}
    assert set(settings["hooks"]) == {a.prompt_event, a.tool_event}
    ws.cowfs("hooks", "uninstall", agent)
    assert not (ws.path / a.settings).exists()


def test_a_users_hook_in_our_group_stays(mounted):
    """A handler the user added next to ours survives uninstall (ours goes)."""
    ws = mounted
    a = agents.AGENTS["claude-code"]
    ws.cowfs("hooks", "install", "claude-code")
    path = ws.path / a.settings
    settings = json.loads(path.read_text())
    settings["hooks"]["UserPromptSubmit"][0]["hooks"].append(
        {"type": "command", "command": "echo mine"}
    )
    path.write_text(json.dumps(settings, indent=2))
    ws.cowfs("hooks", "uninstall", "claude-code")
    assert json.loads(path.read_text()) == {
        "hooks": {"UserPromptSubmit": [{"hooks": [{"type": "command", "command": "echo mine"}]}]}
    }


def test_install_refuses_what_it_cannot_merge(mounted):
    ws = mounted
    path = ws.path / ".claude" / "settings.json"
    path.parent.mkdir()
    for bad, why in (
        ('{"hooks": [1, 2]', "not valid JSON"),
        ('{"hooks": []}', '"hooks" is not an object'),
        ('{"hooks": {"UserPromptSubmit": {}}}', "is not a list"),
        ("[1]", "does not hold a JSON object"),
    ):
        path.write_text(bad)
        r = ws.cowfs("hooks", "install", "claude-code", check=False)
        assert r.returncode == 2 and why in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert path.read_text() == bad


def test_install_needs_the_workspace_mounted_if_it_has_a_store(workspace):
    (workspace / "f").write_text("x\n")
    workspace.mount()
    workspace.unmount()
    r = workspace.cowfs("hooks", "install", "claude-code", check=False)
    assert r.returncode == 3 and "mount it first" in r.stderr
    assert not (workspace.path / ".claude").exists()


# -- rewinding -----------------------------------------------------------------------


def turn(ws, prompt: str, agent: str = "claude-code") -> None:
    a = agents.AGENTS[agent]
    r = hook(
        agent,
        a.prompt_event,
        payload(CLAUDE_PROMPT | {"hook_event_name": a.prompt_event, "prompt": prompt}, ws),
    )
    assert r.returncode == 0 and not r.stdout, r


def test_rewind_undoes_the_last_turns_exactly(mounted):
    ws = mounted
    turn(ws, "first: add a file")
    (ws / "one.txt").write_text("1\n")
    before_second = ws.snapshot()
    turn(ws, "second: rework everything")
    (ws / "a.txt").write_text("rewritten\n")
    r = hook("claude-code", "PreToolUse", payload(CLAUDE_BASH, ws))
    assert r.returncode == 0
    subprocess.run(
        ["sh", "-c", "rm -r dir && mkdir build && echo o > build/out"], cwd=ws.path, check=True
    )
    turn(ws, "third: and a little more", agent="codex")
    (ws / "one.txt").write_text("one\n")
    after = ws.snapshot()

    r = ws.cowfs("rewind", "--dry-run", "2")
    assert "rewinding 2 turns" in r.stdout and "second: rework everything" in r.stdout
    assert "Bash: npm test" in r.stdout and "D dir/b.txt" in r.stdout
    treesnap.assert_same(after, ws.snapshot())

    r = subprocess.run(
        [*COWFS, "-C", str(ws.path), "rewind", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )  # no terminal to ask on
    assert r.returncode == 2 and "pass --yes" in r.stderr
    treesnap.assert_same(after, ws.snapshot())

    r = ws.cowfs("rewind", "5", check=False)
    assert r.returncode == 2 and "3 turns are recorded" in r.stderr

    res = ws.json("rewind", "--yes", "2")
    assert sorted(res["rolled_back"]["dropped"]) == [x["id"] for x in res["layers"]]
    assert [x["message"] for x in res["layers"]] == [
        "second: rework everything",
        "Bash: npm test",
        "third: and a little more",
    ]
    treesnap.assert_same(before_second, ws.snapshot())
    assert [x["message"] for x in agent_layers(ws)] == ["first: add a file"]
    ws.cowfs("redo")  # and back again
    treesnap.assert_same(after, ws.snapshot())


def test_rewind_asks_on_the_terminal(mounted):
    ws = mounted
    before = ws.snapshot()
    turn(ws, "make a mess")
    (ws / "mess").write_text("x\n")
    code, out = _run_on_a_terminal(
        ["-C", str(ws.path), "rewind"], answer=b"n\n", prompt=b"roll back 1 turn?"
    )
    assert code == 1 and "make a mess" in out and "A mess" in out, out
    assert (ws / "mess").exists()
    code, out = _run_on_a_terminal(
        ["-C", str(ws.path), "rewind"], answer=b"y\n", prompt=b"roll back 1 turn?"
    )
    assert code == 0 and "rewound 1 turn" in out, out
    treesnap.assert_same(before, ws.snapshot())


def test_turns_merged_by_a_commit_stay_in_the_log(mounted):
    ws = mounted
    r = ws.cowfs("rewind", check=False)
    assert r.returncode == 1 and "no agent turns" in r.stderr
    turn(ws, "one")
    turn(ws, "two")
    (ws / "two.txt").write_text("2\n")
    ws.commit()  # "two" merges into "one"
    text = ws.cowfs("log").stdout
    assert "layer 3, merged: claude-code turn (UserPromptSubmit, session abc123): two" in text
    [layer] = agent_layers(ws)
    assert layer["message"] == "one" and layer["turns"][0]["message"] == "two"
    ws.json("rewind", "--yes")
    assert not (ws / "two.txt").exists() and agent_layers(ws) == []


# -- the settings editor -----------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)


@given(
    doc=st.dictionaries(
        st.text(max_size=6).filter(lambda k: k != "hooks"), json_values, max_size=4
    ),
    hooks=st.none()
    | st.dictionaries(
        st.sampled_from(["Stop", "UserPromptSubmit", "PreToolUse", "Notification"]),
        st.lists(
            st.fixed_dictionaries(
                {
                    "hooks": st.lists(
                        st.fixed_dictionaries(
                            {"type": st.just("command"), "command": st.text(max_size=10)}
                        ),
                        min_size=1,
                        max_size=2,
                    )
                }
            ),
            min_size=1,
            max_size=2,
        ),
        min_size=1,
        max_size=3,
    ),
    indent=st.sampled_from([None, 2, 4, "\t"]),
    per_tool=st.booleans(),
)
def test_install_then_uninstall_gives_the_text_back(doc, hooks, indent, per_tool):
    a = agents.AGENTS["claude-code"]
    if hooks is not None:
        doc["hooks"] = hooks
    original = json.dumps(doc, indent=indent) + "\n"
    text = agents.strip_ours(a, original, "settings.json")
    assert text == original
    events = [(a.prompt_event, None)] + ([(a.tool_event, a.tool_matcher)] if per_tool else [])
    for event, matcher in events:
        group = {"matcher": matcher} if matcher else {}
        group["hooks"] = [a.handler(agents.hook_command(a, "/w", event), event)]
        text = agents.add_group(a, text, "settings.json", event, group)
    value = json.loads(text)
    assert {k: v for k, v in value.items() if k != "hooks"} == {
        k: v for k, v in doc.items() if k != "hooks"
    }
    assert agents.strip_ours(a, text, "settings.json") == original
