"""The table of every command of ``cowfs`` (as pip's ``commands_dict``).

Each command is declared once, as a class in a ``cmd_*`` module (as borg's
``*_cmd.py``: ``do_X`` beside ``build_parser_X``) holding its options and
help, its handler, the control operations it sends and, for those an agent
may use, its MCP tool (see ``command.Command``).  The parser, the table and
the MCP server's tools are derived from ``COMMANDS``, in the order of the
help; which operations work offline and which cannot stop half-way is
declared with the operations themselves (``operations``).
"""

from __future__ import annotations

import argparse

from .. import __version__
from .cmd_agents import Hook, Hooks, Rewind
from .cmd_forks import Adopt, BestOf, Drop, Fork, Forks
from .cmd_inspect import Audit, Diff, Log, Show, Status
from .cmd_layers import Checkpoint, Commit, Redo, Restore, Rollback
from .cmd_mount import Mount, Unmount, View
from .cmd_run import Policy, Run
from .cmd_store import Check, Doctor, Gc, Provider
from .command import ROOT_HELP, Command, Parser, json_option, root_option, workspace_option


class Mcp(Command):
    name = "mcp"
    help = (
        "serve the workspace's operations as MCP tools over stdio (for agents that speak "
        "the Model Context Protocol)"
    )
    examples = "  cowfs mcp -C ~/project --mount\n  claude mcp add cowfs -- cowfs mcp -C ~/project"

    def add_options(self, s: argparse.ArgumentParser) -> None:
        workspace_option(s)
        s.add_argument(
            "--mount",
            action="store_true",
            help="mount the workspace first if it is not mounted (it stays mounted; "
            "with --as USER, granting USER step)",
        )
        s.add_argument(
            "--as",
            dest="as_user",
            metavar="USER",
            help="serve as USER (the agent's account): every tool, run included, "
            "acts with USER's rights, and the workspace must grant USER what it asks "
            "(cowfs mount --allow USER); required when started as root",
        )

    def run(self, args: argparse.Namespace) -> int:
        from .mcpserver import serve

        return serve(args.path, TOOLS, mount=args.mount, as_user=args.as_user)


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Mount(),
        Unmount(),
        Checkpoint(),
        Rollback(),
        Redo(),
        Diff(),
        Audit(),
        View(),
        Restore(),
        Show(),
        Commit(),
        Run(),
        Policy(),
        Provider(),
        Status(),
        Gc(),
        Check(),
        Doctor(),
        Log(),
        Fork(),
        Forks(),
        Adopt(),
        Drop(),
        BestOf(),
        Mcp(),
        Hooks(),
        Hook(),
        Rewind(),
    )
}

TOOLS = tuple(c for c in COMMANDS.values() if c.tool is not None)  # (what cowfs mcp serves)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; with *only*, just that command's
    (building every command's parser costs more than the rest of a
    command's start)."""
    p = Parser(prog="cowfs", description="Make any directory undoable.")
    p.add_argument(
        "-C",
        dest="path",
        default=".",
        metavar="PATH",
        help="a path inside the workspace (default: the current directory)",
    )
    p.add_argument(
        "--fork",
        metavar="NAME",
        help="work on fork NAME of the workspace (see cowfs fork), at the same path in it",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--root", action="store_true", help=ROOT_HELP)
    p.add_argument(
        "--version",
        action="version",
        version=f"cowfs {__version__}",
        help="print the version and exit",
    )
    p.add_argument(
        "--store",
        dest="offline_store",
        metavar="DIR",
        help="for commands on a workspace that is not mounted: its store (default: the "
        "outermost trusted WORKSPACE/.cowfs above PATH)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS.values():
        if only is not None and command.name != only:
            continue
        s = sub.add_parser(
            command.name,
            help=command.help,
            description=command.help,
            epilog=f"examples:\n{command.examples}" if command.examples else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        json_option(s)
        if command.prints_paths:
            root_option(s)
        if command.name == "diff":  # (twice: two forks compared)
            s.add_argument(
                "--fork",
                metavar="NAME",
                action="append",
                default=argparse.SUPPRESS,
                help="work on fork NAME of the workspace (as the global --fork); "
                "given twice, --fork A --fork B: how fork B differs from fork A",
            )
        elif command.ops and command.name not in ("fork", "forks", "drop", "adopt", "best-of"):
            s.add_argument(
                "--fork",
                metavar="NAME",
                default=argparse.SUPPRESS,
                help="work on fork NAME of the workspace (as the global --fork)",
            )
        command.add_options(s)
    return p
