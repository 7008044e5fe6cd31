"""The commands for agent CLIs' hooks: hooks, hook, rewind."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .. import errors
from ..errors import BadWorkspace, CowfsError, NotMounted
from ..system.mounts import find_mount, locate
from ..text import count, first_line
from .command import (
    Command,
    Parser,
    ask,
    call,
    json_option,
    out,
    parse_count,
    seen_from,
    workspace_option,
)
from .render import agent_lines, format_change


def agents_known() -> tuple[str, ...]:
    """The agent CLIs cowfs has hooks for (the agents module is loaded
    only by the commands that name them)."""
    from .agents import AGENTS

    return tuple(AGENTS)


class Hooks(Command):
    name = "hooks"
    help = "install or remove an agent CLI's hooks that make each turn a checkpoint"
    examples = (
        "  cowfs hooks install claude-code\n"
        "  cowfs hooks install codex --per-tool\n"
        "  cowfs hooks uninstall gemini"
    )

    def add_options(self, s: argparse.ArgumentParser) -> None:
        agent_names = agents_known()
        hsub = s.add_subparsers(
            dest="action",
            required=True,
            metavar="ACTION",
            parser_class=Parser,
            help="install or uninstall",
        )
        for action, text in (
            ("install", "write the agent's project hook settings (merged with what is there)"),
            (
                "uninstall",
                "remove cowfs's hooks from the agent's project hook settings (nothing else)",
            ),
        ):
            h = hsub.add_parser(action, help=text, description=text)
            h.add_argument(
                "agent",
                choices=agent_names,
                metavar="AGENT",
                help=f"one of {', '.join(agent_names)}",
            )
            workspace_option(h)
            json_option(h)
            if action == "install":
                h.add_argument(
                    "--per-tool",
                    action="store_true",
                    help="also a checkpoint before each shell or file-writing tool call",
                )

    def run(self, args: argparse.Namespace) -> int:
        from . import agents

        a = agents.AGENTS[args.agent]
        try:
            workspace = find_mount(args.path).mountpoint
        except NotMounted:
            workspace = os.path.realpath(args.path)
            if not os.path.isdir(workspace):
                raise BadWorkspace(
                    f"workspace {args.path} does not exist or is not a directory"
                ) from None
            try:
                located, _ = locate(args.path).unmounted(args.path)
            except NotMounted:
                located = None
            if located is not None:
                raise NotMounted(
                    f"{located} is a cowfs workspace that is not mounted: mount it "
                    "first (a change made while it is not mounted counts as drift)"
                ) from None
            print(
                f"cowfs: warning: {workspace} is not mounted: until it is, the hooks say so "
                "and take no checkpoints",
                file=sys.stderr,
            )
        if args.action == "install":
            res = agents.install(a, workspace, per_tool=args.per_tool)
            out(
                args,
                f"{'installed' if res['changed'] else 'already installed'}: "
                f"{', '.join(res['events'])} hooks of {a.name} in {res['settings']}",
                res,
            )
        else:
            res = agents.uninstall(a, workspace)
            out(
                args,
                (
                    f"removed {a.name}'s cowfs hooks from {res['settings']}"
                    + (" (and the file, which only they filled)" if res["removed"] else "")
                    if res["changed"]
                    else f"no cowfs hooks of {a.name} in {res['settings']}"
                )
                + (
                    f"; removed {res['removed_dir']}, which install made"
                    if res["removed_dir"]
                    else ""
                ),
                res,
            )
        return 0


class Hook(Command):
    name = "hook"
    help = (
        "what agent hooks run: take the checkpoint an agent event (JSON on stdin) asks "
        "for; never blocks the agent (exits 0, saying what went wrong)"
    )
    examples = '  echo \'{"prompt": "fix the build"}\' | cowfs hook claude-code UserPromptSubmit'
    ops = ("checkpoint",)

    def add_options(self, s: argparse.ArgumentParser) -> None:
        agent_names = agents_known()
        workspace_option(s)
        s.add_argument(
            "agent", metavar="AGENT", help=f"the agent CLI: one of {', '.join(agent_names)}"
        )
        s.add_argument(
            "event",
            metavar="EVENT",
            help="the hook event the agent runs it for (e.g. UserPromptSubmit)",
        )

    def run(self, args: argparse.Namespace) -> int:
        """Never blocks or breaks the agent: exit 0 whatever happens; a failure
        is one line on stderr and, for the agent to show, a systemMessage."""
        try:
            from . import agents

            said, layer = agents.handle(
                args.agent, args.event, None if args.path == "." else args.path
            )
            if layer is None:
                print(f"cowfs: {said}", file=sys.stderr)
        except BaseException as e:  # (even Ctrl-C: the agent goes on)
            line = f"cowfs: no checkpoint taken: {e or type(e).__name__}"
            print(line, file=sys.stderr)
            print(json.dumps({"systemMessage": line}))
        return 0


class Rewind(Command):
    name = "rewind"
    help = "roll back the last N agent turns (recorded by cowfs hooks): lists them and asks first"
    examples = (
        "  cowfs rewind --dry-run 3\n  cowfs rewind          # the last turn, after a question"
    )
    prints_paths = True
    ops = ("log", "changes", "rollback")

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "turns",
            nargs="?",
            type=parse_count,
            default=1,
            metavar="N",
            help="how many turns (default 1)",
        )
        s.add_argument("--yes", action="store_true", help="do not ask (needed without a terminal)")
        s.add_argument("--dry-run", action="store_true", help="only list what would be undone")

    def run(self, args: argparse.Namespace) -> int:
        from . import agents

        layers = call(args, "log")["layers"]
        target, undone = agents.turns_to_rewind(layers, args.turns)
        changes = call(args, "changes", since=target)["changes"]
        what = count(args.turns, "turn")
        ids = f"{target}" if len(undone) == 1 else f"{target} to {undone[-1]['id']}"
        lines = [f"rewinding {what} rolls back layer{'s' if len(undone) > 1 else ''} {ids}:"]
        for layer in undone:
            lines.append(f"  {layer['id']:>4}  {first_line(layer['message'])}")
            lines += [f"        {line}" for line in agent_lines(layer)]
        lines.append(f"and undoes {count(len(changes), 'change')}" + (":" if changes else ""))
        base = seen_from(args)
        lines += [f"  {format_change(c, base)}" for c in changes[:50]]
        if len(changes) > 50:
            lines.append(f"  ... and {len(changes) - 50} more")
        plan = {"to": target, "layers": undone, "changes": changes}
        if args.dry_run:
            out(args, "\n".join(lines), plan | {"rolled_back": None})
            return 0
        if not args.yes:
            if not args.json:
                print("\n".join(lines))
            answer = ask(f"cowfs: roll back {what}? [y/N] ", "yn", 300)
            if answer is None:
                raise CowfsError(
                    "no terminal to confirm on: pass --yes to rewind without asking "
                    "(--dry-run lists what it would undo)",
                    errors.USAGE,
                )
            if answer != "y":
                raise errors.NothingToDo("not rewound")
        res = call(args, "rollback", to=target, keep_redo=True)
        out(
            args,
            f"rewound {what}: rolled back layer{'s' if len(res['dropped']) > 1 else ''} "
            f"{', '.join(map(str, res['dropped']))} ({count(res['applied'], 'step')}); open "
            f"layer is {res['top']} ('cowfs redo' brings them back while nothing changed)",
            plan | {"rolled_back": res},
        )
        return 0
