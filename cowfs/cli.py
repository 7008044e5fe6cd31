"""The ``cowfs`` command: one entry point, one function per subcommand.

Exit codes are listed in ``errors`` and documented in README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

from . import __version__, control, errors, listing, progress
from .errors import BadWorkspace, CowfsError, NotMounted
from .mounts import (
    check_answering,
    default_store,
    find_mount,
    finish_unmount,
    is_cowfs_mount,
    locate,
    mount_table,
    processes,
)
from .text import ago, count, duration, human_size, printable, quote

# = policy.RUN_SCOPES (the policy is loaded by the commands that use it: every
# command starts by importing this module, and it must stay cheap)
RUN_SCOPES = ("auto", "files", "container", "vm")


class Parser(argparse.ArgumentParser):
    json_errors = False  # --json was given: usage errors too are JSON on stdout

    def error(self, message: str):  # one line and the documented code, not a usage dump
        if Parser.json_errors:
            print(json.dumps({"error": message, "code": errors.USAGE}))
        name = self.prog.partition(" ")[2]
        self.exit(
            errors.USAGE, f"cowfs: {message} (see 'cowfs {name + ' ' if name else ''}--help')\n"
        )


SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """A size in bytes: a number, whole or not, with an optional K/M/G/T
    suffix (powers of 1024; "K", "KB", "KiB" alike, any case): "500M",
    "1.5g", "4096"."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = SIZE_UNITS.get(t[-1:], 1)
    try:
        n = float(t[:-1] if scale > 1 else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if not n >= 0 or n == float("inf"):
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(n * scale)


def parse_size(text: str) -> int:
    """--chunk-size: a power of two from 4K to 1M."""
    n = parse_bytes(text)
    if n < 4096 or n > (1 << 20) or n & (n - 1):
        raise argparse.ArgumentTypeError(
            f"chunk size must be a power of two from 4K to 1M: {text!r}"
        )
    return n


def parse_limit(text: str) -> int:
    """--max-store: any size (0: no limit)."""
    return parse_bytes(text)


def whole_number(what: str, least: int = 0, hint: str = "") -> Callable[[str], int]:
    """An argparse type: a whole number in decimal digits, at least *least*;
    anything else is "not *what*"."""

    def parse(text: str) -> int:
        if not (text.isascii() and text.isdigit()) or int(text) < least:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}{hint}")
        return int(text)

    return parse


parse_number = whole_number("a positive number", least=1)  # of lines, layers
parse_count = whole_number("a number of layers")
layer_id = whole_number("a layer id", hint=" (paths go after --)")


def snapshot_options(s: argparse.ArgumentParser) -> None:
    """--provider / --container / --vm: state outside the files to snapshot
    with the new layer (each repeatable)."""
    for flag, meta, what in (
        ("--provider", "NAME", "registered provider"),
        ("--container", "NAME", "docker container"),
        ("--vm", "DOMAIN", "libvirt domain"),
    ):
        s.add_argument(
            flag,
            action="append",
            default=[],
            metavar=meta,
            help=f"also snapshot this {what} (repeatable)",
        )


class _Unused:
    """Stands in for the parsers of the commands not given (building every
    subcommand's parser costs more than the rest of a command's start)."""

    def __getattr__(self, name):
        return lambda *args, **kw: self


EXAMPLES = {
    "mount": "  cowfs mount ~/project\n"
    "  cowfs mount --max-store 2G --ignore 'node_modules/.cache/' .",
    "unmount": "  cowfs unmount ~/project\n"
    "  cowfs unmount --lazy ~/project   # a shell is still in it",
    "checkpoint": "  cowfs checkpoint -m 'before the upgrade'\n"
    "  cowfs checkpoint -m 'with the database' --provider db",
    "rollback": "  cowfs rollback                 # the open layer\n"
    "  cowfs rollback --to 3 --dry-run   # what undoing layers 3 and up would change",
    "redo": "  cowfs rollback && cowfs redo   # changed your mind",
    "diff": "  cowfs diff --stat\n  cowfs diff 2 --name-status -- src/",
    "audit": "  cowfs audit --since 4\n  cowfs audit --jsonl | jq 'select(.event==\"change\")'",
    "view": "  cowfs view 2 /tmp/before && diff -r /tmp/before . ; cowfs unmount /tmp/before",
    "restore": "  cowfs restore config.yaml\n  cowfs restore --from 2 -- src/",
    "show": "  cowfs show 2:setup.py\n  cowfs show 1:  # the root's names then",
    "commit": "  cowfs commit   # keep the open layer's changes (merge into the one below)",
    "run": "  cowfs run --verify 'make test' -- make upgrade\n"
    "  cowfs run --workspace /etc --approve -- apt-get upgrade",
    "policy": "  cowfs policy -- pip install requests\n  cowfs policy   # the files in use",
    "provider": "  cowfs provider add db --capture 'pg_dump app > \"$COWFS_STATE_DIR/d\"' "
    "--restore 'psql app < \"$COWFS_STATE_DIR/d\"'\n  cowfs provider list",
    "status": "  cowfs status\n  cowfs --json status | jq '.changes | length'",
    "gc": "  cowfs gc",
    "check": "  cowfs check\n  cowfs check --repair",
    "doctor": "  cowfs doctor\n  cowfs doctor ~/project",
    "log": "  cowfs log\n  cowfs log -n 5",
    "mcp": "  cowfs mcp -C ~/project --mount\n  claude mcp add cowfs -- cowfs mcp -C ~/project",
    "hooks": "  cowfs hooks install claude-code\n  cowfs hooks install codex --per-tool\n"
    "  cowfs hooks uninstall gemini",
    "hook": '  echo \'{"prompt": "fix the build"}\' | cowfs hook claude-code UserPromptSubmit',
    "rewind": "  cowfs rewind --dry-run 3\n"
    "  cowfs rewind          # the last turn, after a question",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; with *only*, just that command's."""
    p = Parser(prog="cowfs", description="Make any directory undoable.")
    p.add_argument(
        "-C",
        dest="path",
        default=".",
        metavar="PATH",
        help="a path inside the workspace (default: the current directory)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
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
        help="status, log, rollback, commit on a workspace that is not mounted: "
        "its store (default: the outermost trusted WORKSPACE/.cowfs above PATH)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        if only is not None and name != only:
            return _Unused()  # type: ignore[return-value]
        examples = EXAMPLES.get(name, "")
        s = sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=f"examples:\n{examples}" if examples else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        s.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
        )
        return s

    s = cmd("mount", "mount WORKSPACE (over itself, or at MOUNTPOINT) and capture every change")
    s.add_argument("--store", metavar="DIR", help="layer store (default: WORKSPACE/.cowfs)")
    s.add_argument("--foreground", action="store_true", help="do not daemonise")
    s.add_argument(
        "--chunk-size",
        type=parse_size,
        metavar="SIZE",
        help="capture granularity for a new store (default 64K; a power of two from 4K to 1M)",
    )
    s.add_argument(
        "--max-store",
        type=parse_limit,
        metavar="SIZE",
        help="most store space undo data may take (e.g. 500M, 2G; 0: no limit); "
        "a change whose capture would exceed it fails with ENOSPC; kept "
        "in the store for later mounts",
    )
    s.add_argument(
        "--max-layers",
        type=parse_count,
        metavar="N",
        help="most layers above the base (0: no limit); past it the oldest are "
        "merged into the base, so undo back to the base is kept",
    )
    s.add_argument(
        "--ignore",
        action="append",
        metavar="PATTERN",
        help="do not capture changes under paths matching PATTERN (gitignore "
        "syntax, like .cowfsignore; repeatable; kept for later mounts; "
        "--ignore '' clears)",
    )
    s.add_argument(
        "--allow",
        action="append",
        metavar="USER|@GROUP[:OPS]",
        type=allow_spec,
        help="let another user (or a group) ask this workspace's daemon for "
        "OPS: read (status, diff, show, log, view) or step (read, and "
        "checkpoint, rollback, redo, commit, restore, run); default step; "
        "each acts with that user's rights; repeatable; kept for later "
        "mounts; --allow '' clears",
    )
    s.add_argument(
        "--engine",
        choices=("auto", "kernel", "pyfuse3"),
        help="how FUSE requests are served: kernel (the protocol on /dev/fuse, "
        "with the kernel's newer features), pyfuse3 (libfuse, "
        "portable), or auto (kernel where it can run); default: "
        "$COWFS_ENGINE, else auto",
    )
    s.add_argument(
        "--audit",
        choices=("hashes", "changes", "events"),
        help="what the audit log records of each kept change: its path, kind, "
        "writer and both sides' xxh3 (hashes, the default; costs a read of "
        "each changed file at commit), the same without hashes (changes), "
        "or only the stack events (events); kept for later mounts",
    )
    s.add_argument(
        "--accept-drift",
        action="store_true",
        help="mount even though paths the layers changed were changed while "
        "not mounted (recorded in the log)",
    )
    s.add_argument("workspace", help="the directory to make undoable")
    s.add_argument(
        "mountpoint", nargs="?", help="where to mount it (default: over the workspace itself)"
    )

    s = cmd("unmount", "flush and unmount a workspace")
    s.add_argument("--lazy", action="store_true", help="detach even while busy")
    s.add_argument(
        "target",
        nargs="?",
        metavar="PATH",
        help="the workspace or a view (default: -C PATH, the current directory)",
    )

    s = cmd("checkpoint", "open a new layer; print its id")
    s.add_argument("-m", "--message", default="", help="what the layer is for (shown by log)")
    snapshot_options(s)

    s = cmd("rollback", "undo the top layer (or every layer down to and including ID)")
    s.add_argument(
        "--to",
        type=int,
        metavar="ID",
        help="roll back every layer down to and including ID (see log)",
    )
    s.add_argument(
        "--dry-run",
        action="store_true",
        help="list what the rollback would change (path and kind); change nothing",
    )
    s.add_argument(
        "--no-redo",
        action="store_true",
        help="keep nothing for `cowfs redo` (faster; frees the undo data at once)",
    )
    s.add_argument(
        "--skip-damaged",
        action="store_true",
        help="give up the steps whose undo data is damaged (their objects stay as they "
        "are) and drop the layers; without it such layers stay, holding those steps",
    )
    s.add_argument(
        "--yes",
        action="store_true",
        help="roll back the base layer (everything since the mount) without "
        "asking; without a terminal it is refused otherwise (exit 14)",
    )

    cmd(
        "redo",
        "undo the last rollback: bring its layers and files back exactly, as long "
        "as nothing changed since (otherwise say why not and change nothing)",
    )

    s = cmd(
        "diff",
        "changes since layer ID was opened (default: the open layer), with "
        "their content: unified diff for text, sizes and xxh3 for binary",
    )
    fmt = s.add_mutually_exclusive_group()
    fmt.add_argument("--stat", action="store_true", help="lines added and removed per file")
    fmt.add_argument("--name-status", action="store_true", help="kind and path per change")
    s.add_argument(
        "--who",
        action="store_true",
        help="with --name-status: the process that first made each change",
    )
    s.add_argument(
        "-u",
        "--all",
        action="store_true",
        help="with --name-status: list every path, also inside directories "
        "added or deleted as a whole",
    )
    s.add_argument(
        "layer",
        nargs="?",
        type=layer_id,
        metavar="ID",
        help="the layer whose start to compare with (default: the open layer)",
    )
    s.add_argument(
        "paths",
        nargs="*",
        metavar="-- PATH",
        help="only these paths (relative to the current directory inside the "
        "workspace, like git's)",
    )

    s = cmd(
        "audit",
        "the audit log: mounts, checkpoints, commits, rollbacks, restores and "
        "every change kept or undone (kept through commits)",
    )
    s.add_argument("--since", type=int, metavar="ID", help="from layer ID's checkpoint on")
    s.add_argument("--jsonl", action="store_true", help="one JSON event per line")
    s.add_argument(
        "--prune",
        type=float,
        metavar="DAYS",
        help="remove events older than DAYS instead (audit retention is separate from undo data)",
    )

    s = cmd(
        "view",
        "mount the tree as it was when layer ID was opened, read-only, at DIR "
        "('cowfs unmount DIR' ends it)",
    )
    s.add_argument("layer", type=int, metavar="ID", help="the layer whose start to show")
    s.add_argument("dir", metavar="DIR", help="an empty directory to mount the view at")

    s = cmd(
        "restore",
        "put PATHs (files or subtrees) back as they were when layer ID was "
        "opened, as a new change of the open layer",
    )
    s.add_argument(
        "--from", dest="layer", type=int, metavar="ID", help="the layer (default: the open layer)"
    )
    s.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="relative to the current directory inside the workspace, like git's "
        "(else to its root)",
    )

    s = cmd(
        "show",
        "print PATH as it was when layer ID was opened (a file's bytes, a "
        "directory's names, a symlink's target), changing nothing",
    )
    s.add_argument(
        "spec",
        metavar="ID:PATH",
        help="the layer and the path (relative to the current directory inside "
        "the workspace; ID: alone is the root)",
    )

    cmd("commit", "merge the top layer into the one below (the base: make permanent)")

    s = cmd("run", "run a command as a step: keep what it changed, or roll it back")
    s.add_argument("-m", "--message", help="layer message (default: 'run: CMD')")
    s.add_argument("--verify", metavar="CMD", help="a shell command that must succeed too")
    s.add_argument(
        "--on-fail",
        choices=("rollback", "keep"),
        default="rollback",
        help="when CMD or the verifier fails: undo the step (default) or keep it",
    )
    s.add_argument(
        "--on-success",
        choices=("commit", "keep"),
        default="keep",
        help="a successful step: keep its layer as an undo point of its own "
        "(default) or merge it into the layer below",
    )
    s.add_argument(
        "--approve",
        action="store_true",
        help="after success, ask on the terminal whether to keep the changes",
    )
    s.add_argument(
        "--timeout",
        type=float,
        default=300,
        metavar="SECONDS",
        help="with --approve (and --workspace): no answer in time means discard",
    )
    s.add_argument(
        "--workspace",
        metavar="DIR",
        help="mount DIR just for this command, then ask whether to keep",
    )
    yn = s.add_mutually_exclusive_group()
    yn.add_argument("--yes", action="store_true", help="with --workspace: keep the changes")
    yn.add_argument("--no", action="store_true", help="with --workspace: discard the changes")
    snapshot_options(s)
    s.add_argument(
        "--scope",
        choices=RUN_SCOPES,
        help="what to snapshot: auto asks the escalation policy (read-only "
        "commands: no checkpoint; system changes: the configured container "
        "or VM); default: the policy's run_scope, files",
    )
    s.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="FILE",
        help="an escalation policy file read before the others (repeatable)",
    )
    s.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="-- CMD [ARG...]",
        help="the command (one argument: a shell command line)",
    )

    s = cmd(
        "policy",
        "show how the escalation policy classifies a command (or which policy files are in use)",
    )
    s.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="FILE",
        help="a policy file read before the others (repeatable)",
    )
    s.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="-- CMD [ARG...]",
        help="the command to classify (none: list the policy files in use)",
    )

    s = cmd("provider", "register, list or remove the workspace's providers")
    psub = s.add_subparsers(
        dest="action",
        required=True,
        metavar="ACTION",
        parser_class=Parser,
        help="add, list or remove",
    )
    a = psub.add_parser("add", help="register a provider")
    a.add_argument("name", help="the provider's name (used by checkpoint --provider)")
    a.add_argument(
        "--type",
        default="command",
        choices=("command", "docker", "libvirt"),
        help="command (your own capture/restore/discard commands; the default), "
        "docker (a container) or libvirt (a domain)",
    )
    a.add_argument("--capture", default="", metavar="CMD", help="command: take a snapshot")
    a.add_argument("--restore", default="", metavar="CMD", help="command: put it back")
    a.add_argument("--discard", default="", metavar="CMD", help="command: drop it")
    a.add_argument("--container", default="", metavar="NAME", help="docker: the container")
    a.add_argument("--domain", default="", metavar="NAME", help="libvirt: the domain")
    a.add_argument(
        "--diagnostics",
        default="",
        metavar="CMD",
        help="libvirt: run before a revert; its output is kept as a post-mortem",
    )
    a.add_argument(
        "--health",
        default="",
        metavar="CMD",
        help="libvirt: run after a revert; failing is reported",
    )
    psub.add_parser("list", help="list the registered providers")
    r = psub.add_parser("remove", help="unregister a provider")
    r.add_argument("name", help="the provider to unregister")
    s = cmd("status", "list the open layer's changes")
    s.add_argument(
        "--who",
        action="store_true",
        help="with the process (pid, uid, command line) that first made each",
    )
    s.add_argument(
        "-u",
        "--all",
        action="store_true",
        help="list every path, also inside directories added or deleted as a "
        "whole (shown as one line each by default)",
    )
    s.add_argument(
        "--limit", type=parse_number, metavar="N", help="list at most N lines (default: all)"
    )
    s.add_argument(
        "--collapse",
        action="store_true",
        help="with --json: directories added or deleted as a whole as one entry "
        "each (default: every path)",
    )
    s.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="only changes under these paths (relative to the current directory "
        "inside the workspace, like git's; after -- when one could be read "
        "as an option)",
    )
    cmd(
        "gc",
        "free store space nothing needs (unused chunks, grave files no record holds); "
        "mounted or not",
    )
    s = cmd(
        "check",
        "verify the store: chunk hashes, reference counts, records, layers, "
        "the grave (read-only; mounted or not)",
    )
    s.add_argument(
        "--repair",
        action="store_true",
        help="repair what can be repaired without inventing data (asks first)",
    )
    s.add_argument("--yes", action="store_true", help="with --repair: do not ask")
    s = cmd("doctor", "check FUSE, the daemon, the store and the providers")
    s.add_argument("target", nargs="?", metavar="PATH", help="a workspace (mounted or not)")
    s.add_argument(
        "--store", metavar="DIR", help="store of an unmounted workspace (default: PATH/.cowfs)"
    )
    s = cmd("log", "list the layers, newest first, with their messages and runs")
    s.add_argument(
        "-n", type=parse_number, metavar="N", dest="max_count", help="only the N newest layers"
    )

    def workspace_option(s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "-C",
            dest="path",
            default=argparse.SUPPRESS,
            metavar="PATH",
            help="a path inside the workspace (as the global -C)",
        )

    s = cmd(
        "mcp",
        "serve the workspace's operations as MCP tools over stdio (for agents "
        "that speak the Model Context Protocol)",
    )
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

    agent_names: tuple[str, ...] = ()
    if only in (None, "hooks", "hook"):  # (the agents module only for these)
        from .agents import AGENTS

        agent_names = tuple(AGENTS)

    s = cmd("hooks", "install or remove an agent CLI's hooks that make each turn a checkpoint")
    hsub = s.add_subparsers(
        dest="action",
        required=True,
        metavar="ACTION",
        parser_class=Parser,
        help="install or uninstall",
    )
    for action, text in (
        ("install", "write the agent's project hook settings (merged with what is there)"),
        ("uninstall", "remove cowfs's hooks from the agent's project hook settings (nothing else)"),
    ):
        h = hsub.add_parser(action, help=text, description=text)
        h.add_argument(
            "agent", choices=agent_names, metavar="AGENT", help=f"one of {', '.join(agent_names)}"
        )
        workspace_option(h)
        h.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
        )
        if action == "install":
            h.add_argument(
                "--per-tool",
                action="store_true",
                help="also a checkpoint before each shell or file-writing tool call",
            )

    s = cmd(
        "hook",
        "what agent hooks run: take the checkpoint an agent event (JSON on stdin) "
        "asks for; never blocks the agent (exits 0, saying what went wrong)",
    )
    workspace_option(s)
    s.add_argument("agent", metavar="AGENT", help=f"the agent CLI: one of {', '.join(agent_names)}")
    s.add_argument(
        "event",
        metavar="EVENT",
        help="the hook event the agent runs it for (e.g. UserPromptSubmit)",
    )

    s = cmd(
        "rewind",
        "roll back the last N agent turns (recorded by cowfs hooks): lists them and asks first",
    )
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
    return p


def out(args, human: str | None, data) -> None:
    if args.json:
        print(json.dumps(data))
    elif human:
        print(human)


# -- subcommands -----------------------------------------------------------------


def do_mount(args) -> int:
    from .daemon import check_fuse, spawn

    check_fuse()
    ws = os.path.abspath(args.workspace)
    check_answering(ws)  # (a mount whose daemon is stopped would hang isdir)
    if not os.path.isdir(ws) and not is_cowfs_mount(ws):  # a dead mount is recovered
        raise BadWorkspace(f"workspace {args.workspace} does not exist or is not a directory")
    if args.foreground:
        from .daemon import serve

        def report(msg: dict) -> None:
            if msg.get("ok"):
                for w in msg["warnings"]:
                    print(f"cowfs: warning: {w}", file=sys.stderr)
                out(args, f"mounted {msg['mountpoint']} (foreground; Ctrl-C unmounts)", msg)
                sys.stdout.flush()
            else:
                print(f"cowfs: {msg['error']}", file=sys.stderr)

        return serve(
            ws, args.mountpoint, args.store, report, foreground=True, **mount_options(args)
        )
    msg = spawn(ws, args.mountpoint, args.store, **mount_options(args))
    for warning in msg["warnings"]:
        print(f"cowfs: warning: {warning}", file=sys.stderr)
    out(args, f"mounted {msg['mountpoint']}", msg)
    return 0


def allow_spec(spec: str) -> str:
    """--allow: checked here (an unknown user is a usage error before any
    mount), resolved again by the daemon."""
    from .access import BadGrant, parse_grant

    if spec:
        try:
            parse_grant(spec)
        except BadGrant as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def mount_options(args) -> dict:
    return {
        "chunk_size": args.chunk_size,
        "max_store": args.max_store,
        "max_layers": args.max_layers,
        "accept_drift": args.accept_drift,
        "ignore": args.ignore,
        "allow": args.allow,
        "audit": args.audit,
        "engine": engine_choice(args.engine),
    }


def engine_choice(given: str | None) -> str:
    """--engine, else $COWFS_ENGINE, else auto."""
    choice = given or os.environ.get("COWFS_ENGINE") or "auto"
    if choice not in ENGINE_CHOICES:
        raise CowfsError(
            f"COWFS_ENGINE is {choice!r}; it takes one of {', '.join(ENGINE_CHOICES)}", errors.USAGE
        )
    return choice


ENGINE_CHOICES = ("auto", "kernel", "pyfuse3")


def do_audit(args) -> int:
    if args.prune is not None:
        res = call(args, "audit_prune", days=args.prune)
        out(args, f"pruned {res['pruned']} audit events", res)
        return 0
    after, first = 0, True
    while True:
        kw = {"since_layer": args.since} if first and args.since is not None else {}
        events = call(args, "audit", after=after, **kw)["events"]
        first = False
        if not events:
            return 0
        for e in events:
            if args.jsonl or args.json:
                print(json.dumps(e))
            else:
                print(format_event(e))
        after = events[-1]["n"]
        if args.since is not None:
            args.since = None  # the rest follows in order


def format_event(e: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["time"]))
    kind = e["event"]
    if kind == "change":
        what = format_change(e) + (" (undone)" if e.get("undone") else "")
        who = f"  [{format_who(e)}]" if e.get("who") else ""
        return f"{when}  {'':>10}  {what}{who}"
    detail = {k: v for k, v in e.items() if k not in ("n", "time", "event")}
    return f"{when}  {kind:>10}  " + " ".join(
        f"{k}={printable(v) if isinstance(v, str) else v}" for k, v in detail.items()
    )


def do_view(args) -> int:
    res = call(args, "view", layer=args.layer, mountpoint=os.path.abspath(args.dir))
    out(
        args,
        f"layer {args.layer} as it was opened is at {res['mountpoint']} (read-only; "
        f"'cowfs unmount {args.dir}' ends it)",
        res,
    )
    return 0


def unmount_view(path: str) -> bool:
    """`cowfs unmount DIR` of a view: unmount it (its process then ends)."""
    from .view import FSTYPE

    if mount_table().get(path) != FSTYPE:
        return False
    r = subprocess.run(
        ["umount", path] if os.geteuid() == 0 else ["fusermount3", "-u", path],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise CowfsError(
            f"cannot unmount the view at {path}: {r.stderr.strip()}", errors.ALREADY_MOUNTED
        )
    return True


def do_unmount(args) -> int:
    check_answering(args.target or args.path)
    target = os.path.realpath(args.target or args.path)
    if unmount_view(target):
        out(args, f"unmounted the view at {target}", {"unmounted": target})
        return 0
    rec = find_mount(args.target or args.path)
    res = control.call(rec, "unmount", lazy=args.lazy)
    users = finish_unmount(rec, res)
    if not users:
        out(args, f"unmounted {rec.mountpoint}", {"unmounted": rec.mountpoint})
        return 0
    others = [pid for pid in users if pid != os.getpid()]
    who = f"the processes still using it ({processes(others)})" if others else "this command"
    out(
        args,
        f"detached {rec.mountpoint}: its daemon (pid {rec.pid}) goes on serving {who} "
        "and exits, unmounting cleanly, when the last one leaves",
        {"unmounted": rec.mountpoint, "detached": True, "pid": rec.pid, "users": others},
    )
    return 0


def call(args, op: str, **kw) -> dict:
    """Ask the daemon of the workspace at -C PATH; when it is not mounted
    (and for status, log, rollback, commit), operate on its store directly.
    An operation that changes the tree or the store cannot stop half-way:
    a first Ctrl-C says so and waits for it, a second stops waiting (the
    daemon finishes it; offline, the next command on the workspace does)."""
    what = LONG_OPS.get(op)
    try:
        rec = find_mount(args.path)
    except NotMounted:
        if op not in OFFLINE_OPS:
            raise
        from .session import offline

        if args.offline_store:
            workspace, store = os.path.realpath(args.path), args.offline_store
        else:
            workspace, store = locate(args.path).unmounted(args.path)
        with (
            finishing(what, "the next cowfs command on this workspace finishes it"),
            progress_shown(args, op, progress.LOCAL.read),
        ):
            result = offline(workspace, store, op, **kw)
        for warning in result["warnings"]:
            print(f"cowfs: warning: {warning}", file=sys.stderr)
        return result
    if what is None:
        return control.call(rec, op, **kw)
    said: list[bool] = []

    def waiting() -> None:
        said.append(True)
        print(
            f"cowfs: the {what} goes on in the daemon (it cannot stop half-way); waiting "
            "for it to finish -- Ctrl-C again to stop waiting",
            file=sys.stderr,
        )

    try:
        with progress_shown(args, op, lambda: progress.read(progress.path_for(rec.socket))):
            return control.call(rec, op, on_interrupt=waiting, **kw)
    except KeyboardInterrupt:
        if not said:
            raise
        raise CowfsError(
            f"stopped waiting; the {what} goes on in the daemon ('cowfs status' "
            "shows the workspace once it is done)",
            errors.INTERRUPTED,
        ) from None


# operations that change the tree or the store and must not stop half-way
LONG_OPS = {
    "rollback": "rollback",
    "redo": "redo",
    "commit": "commit",
    "gc": "gc",
    "restore": "restore",
}

# what the progress of a long operation says it is doing
DOING = {
    "rollback": "rolling back",
    "redo": "redoing the rollback",
    "commit": "committing",
    "gc": "freeing unused store space",
    "check": "checking the store",
    "repair": "repairing the store",
    "restore": "restoring",
}
PROGRESS_DELAY = 0.5  # seconds an operation runs before its progress shows


@contextlib.contextmanager
def progress_shown(
    args, op: str, board: Callable[[], tuple[int, int] | None] | None = None
) -> Iterator[None]:
    """While long operation *op* runs (in the daemon or here): on a
    terminal, and never with --json, a spinner on stderr with the time
    elapsed and, where *board* tells it, the steps done -- from
    PROGRESS_DELAY seconds on ($COWFS_PROGRESS_DELAY), so quick ones show
    nothing and pay nothing (not even the import of rich).  With no delay,
    it shows before the operation starts."""
    if op not in DOING or args.json or not sys.stderr.isatty():
        yield
        return
    try:
        delay = float(os.environ.get("COWFS_PROGRESS_DELAY") or PROGRESS_DELAY)
    except ValueError:
        delay = PROGRESS_DELAY
    stop, shown = threading.Event(), threading.Event()
    t0 = time.monotonic()

    def text() -> str:
        done = board() if board is not None else None
        steps = f", {done[0]:,} of {count(done[1], 'step')}" if done else ""
        return f"cowfs: {DOING[op]} ({duration(time.monotonic() - t0)}{steps})"

    def show() -> None:
        try:
            if stop.wait(delay):
                return
            from rich.console import Console
            from rich.live import Live
            from rich.spinner import Spinner

            spinner = Spinner("dots", text(), style="status.spinner")
            with Live(
                spinner, console=Console(stderr=True), transient=True, refresh_per_second=12.5
            ):  # (draws the first frame at once)
                shown.set()
                while not stop.wait(0.1):
                    spinner.update(text=text())
        except Exception:
            pass  # (only a display: the operation goes on)
        finally:
            shown.set()

    shower = threading.Thread(target=show, name="progress", daemon=True)
    shower.start()
    if not delay:
        shown.wait()
    try:
        yield
    finally:
        stop.set()
        shower.join()


@contextlib.contextmanager
def finishing(what: str | None, later: str) -> Iterator[None]:
    """Run an operation in this process that must not stop half-way: a
    first Ctrl-C says so and it goes on; a second stops it (*later* says
    what then finishes it)."""
    if what is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    said: list[bool] = []

    def interrupted(signum, frame) -> None:
        if said:
            raise KeyboardInterrupt
        said.append(True)
        print(
            f"cowfs: finishing the {what} first (it cannot stop half-way) -- Ctrl-C again "
            "to stop it",
            file=sys.stderr,
        )

    old = signal.signal(signal.SIGINT, interrupted)
    try:
        yield
    except KeyboardInterrupt:
        raise CowfsError(
            f"stopped in the middle of the {what}; {later}", errors.INTERRUPTED
        ) from None
    finally:
        signal.signal(signal.SIGINT, old)


OFFLINE_OPS = {
    "status",
    "log",
    "rollback",
    "commit",
    "redo",
    "changes",
    "gc",
    "diff",
    "show",
    "view",
    "audit",
    "audit_prune",
    "restore",
}


def do_checkpoint(args) -> int:
    res = control.call(
        find_mount(args.path),
        "checkpoint",
        message=args.message,
        providers=args.provider,
        containers=args.container,
        vms=args.vm,
    )
    out(args, str(res["id"]), res)
    return 0


def rollback_args(args, yes: bool) -> dict:
    extra = {"skip_damaged": True} if args.skip_damaged else {}
    return {"to": args.to, "keep_redo": not args.no_redo, "yes": yes} | extra


def do_rollback(args) -> int:
    if args.dry_run:
        res = call(args, "changes", since=args.to)
        out(args, "\n".join(format_change(c) for c in res["changes"]) or None, res)
        return 0
    try:
        res = call(args, "rollback", **rollback_args(args, args.yes))
    except CowfsError as e:
        # the base layer, without --yes: on a terminal, ask
        if e.code != errors.CONFIRM or not sys.stdin.isatty():
            raise
        answer = ask(f"cowfs: {str(e).split(';')[0]}. Roll it back? [y/N] ", "yn", 300)
        if answer != "y":
            raise CowfsError("not rolled back", errors.CONFIRM) from None
        res = call(args, "rollback", **rollback_args(args, True))
    dropped = ", ".join(map(str, res["dropped"]))
    out(
        args,
        f"rolled back layer{'s' if len(res['dropped']) > 1 else ''} {dropped} "
        f"({count(res['applied'], 'step')}); open layer is {res['top']}",
        res,
    )
    return 0


def do_redo(args) -> int:
    res = call(args, "redo")
    restored = ", ".join(map(str, res["restored"]))
    out(
        args,
        f"redid: layer{'s' if len(res['restored']) > 1 else ''} {restored} back "
        f"({count(res['applied'], 'step')}); open layer is {res['top']}",
        res,
    )
    return 0


def redo_line(info: dict | None) -> list[str]:
    """What status and log say about undoing the last rollback: that it can
    be, or why it cannot -- only while the layers are still those it left
    (a checkpoint, commit or other rollback since makes it old news)."""
    if not info or not (info["available"] or info.get("current", True)):
        return []
    from .redo import layers_text

    what = f"# the rollback of {layers_text(info['layers'])}"
    if info["available"]:
        return [f"{what} can be undone: cowfs redo"]
    return [f"{what} cannot be redone: {info['why']}"]


def do_commit(args) -> int:
    res = call(args, "commit")
    if res["into"] is None:
        human = (
            f"committed base layer {res['committed']}; its changes are permanent; "
            f"open layer is {res['top']}"
        )
    else:
        human = f"merged layer {res['committed']} into layer {res['into']}"
    out(args, human, res)
    return 0


def format_change(c: dict) -> str:
    """'M a.txt', 'R old -> new': names quoted (text.quote), each side of
    a rename on its own."""
    if c["kind"] == "R":
        return f"R {quote(c['from'])} -> {quote(c['path'])}"
    return f"{c['kind']} {quote(c['path'])}"


def format_who(c: dict) -> str:
    """The process that first made a change, for --who (an argument with a
    control character in it quoted as a name is, the others as a shell
    would take them)."""
    w = c.get("who")
    if not w:
        return "(unknown)"
    cmd = " ".join(quote(a) if printable(a) != a else shlex.quote(a) for a in w.get("cmd") or ["?"])
    return f"pid {w.get('pid')} uid {w.get('uid')}: {cmd}"


def do_status(args) -> int:
    paths = workspace_paths(args, args.paths)
    res = call(args, "status", **({"paths": paths} if paths else {}))
    res["counts"] = listing.counts(res["changes"])
    if args.json:
        if args.collapse:
            res["changes"] = listing.collapse(res["changes"])
        if args.limit:
            shown = res["changes"][: args.limit]
            res["omitted"] = len(res["changes"]) - len(shown)
            res["changes"] = shown
        out(args, None, res)
        return 0
    lines = [f"# {listing.headline(res['counts'])}"]
    lines += change_lines(
        res["changes"], args.all, args.limit, (lambda c: f"\t{format_who(c)}") if args.who else None
    )
    u = res["usage"]
    lines.append(
        f"# open layer {res['id']}, {u['layers']} layer{'s' if u['layers'] > 1 else ''}"
        + (f" (at most {u['max_layers']} above the base)" if u["max_layers"] else "")
        + f"; store {human_size(u['bytes'])}"
        + (f" of at most {human_size(u['max_store'])}" if u["max_store"] else "")
        + f" ({human_size(u['data'])} undo data, {human_size(u['grave'])} removed files)"
    )
    refused = res.get("refused")
    if refused:
        lines.append(
            f"# --max-store refused {count(refused['count'], 'change')} (ENOSPC) since "
            f"the mount, the last {ago(refused['time'], time.time())}"
            + (f": {quote(refused['path'])}" if refused.get("path") else "")
        )
    lines += redo_line(res.get("redo"))
    out(args, "\n".join(lines), res)
    return 0


def change_lines(
    changes: list[dict], every: bool, limit: int | None = None, suffix=None, line=listing.line
) -> list[str]:
    """The lines of a list of changes: directories added or deleted as a
    whole as one line each (after the single changes), unless *every*;
    at most *limit* lines; *suffix* adds to each (--who)."""
    shown = changes if every else listing.individual_first(listing.collapse(changes))
    shown, more = listing.cut(shown, limit)
    return [line(c) + (suffix(c) if suffix else "") for c in shown] + ([more] if more else [])


def workspace_paths(args, paths: list[str]) -> list[str]:
    """PATHs as the workspace names them (relative to its root, "." for the
    root), from paths relative to the current directory when it is inside
    the workspace (as git takes pathspecs), to the root otherwise, or
    absolute; a path outside the workspace is an error naming it."""
    if not paths:
        return []
    root = workspace_root(args)
    cwd = os.path.realpath(os.getcwd())
    inside = cwd == root or cwd.startswith(root.rstrip("/") + "/")
    out = []
    for p in paths:
        full = p if os.path.isabs(p) else os.path.join(cwd if inside else root, p)
        head, tail = os.path.split(os.path.normpath(full))
        full = os.path.join(os.path.realpath(head), tail) if tail else os.path.realpath(head)
        if full == root:
            out.append(".")
        elif full.startswith(root.rstrip("/") + "/"):
            out.append(os.path.relpath(full, root))
        else:
            raise CowfsError(f"{p}: outside the workspace {root}", errors.USAGE)
    return out


def workspace_root(args) -> str:
    """Where the workspace of -C PATH is, as programs see it: its mount, or
    the directory itself when it is not mounted."""
    try:
        return os.path.realpath(find_mount(args.path).mountpoint)
    except NotMounted:
        if args.offline_store:
            return os.path.realpath(args.path)
        return os.path.realpath(locate(args.path).unmounted(args.path)[0])


def do_diff(args) -> int:
    layer, paths = args.layer, workspace_paths(args, args.paths)
    if args.name_status and not args.json:  # (kinds and paths: no contents to read)
        res = call(args, "changes", since=layer, **({"paths": paths} if paths else {}))
        rows = change_lines(
            res["changes"],
            args.all,
            suffix=(lambda c: f"\t{format_who(c)}") if args.who else None,
            line=lambda c: listing.line(c).replace(" ", "\t", 1),
        )
        out(args, "\n".join(rows) or None, res)
        return 0
    res = call(args, "diff", since=layer, paths=paths)
    rows = diff_rows(res["changes"], args.name_status, args.stat, args.who)
    out(args, "\n".join(rows) or None, res)
    return 0


def diff_rows(changes: list[dict], name_status: bool, stat: bool, who: bool) -> list[str]:
    """The lines `cowfs diff` prints for *changes* (op diff's)."""
    rows = []
    for c in changes:
        name = format_change(c)
        if name_status:
            rows.append(name.replace(" ", "\t", 1) + (f"\t{format_who(c)}" if who else ""))
        elif stat:
            counts = (
                "not readable by you"
                if c.get("unreadable")
                else "too many lines to diff"
                if c.get("too_large")
                else "content unchanged"
                if same_content(c)
                else f"+{c['added']} -{c['removed']}"
                if "diff" in c
                else f"binary {side_sizes(c)}"
                if c["binary"]
                else c["kind"]
            )
            rows.append(f" {name[2:]:<50} | {counts}")
        else:
            rows.append(f"diff --cowfs {name}")
            for side in ("old", "new"):
                if side in c and c[side]["kind"] != "file":
                    rows.append(f"{side} {c[side]['kind']} mode {c[side]['mode']:o}")
            same = same_content(c)
            if c.get("unreadable"):
                rows.append("(not readable by you: contents not shown)")
            elif c.get("too_large"):
                rows.append(f"Text, too many lines to diff: {side_sizes(c)}")
            elif c.get("diff"):
                rows.append(quoted_headers(c).rstrip("\n"))
            elif c["binary"] and not same:
                rows.append(f"Binary: {side_sizes(c)}")
            elif same:
                rows.append(f"content unchanged ({c['new']['size']} bytes xxh3 {c['new']['xxh3']})")
            rows += attribute_changes(c, mtime=same)
    return rows


def quoted_headers(c: dict) -> str:
    """The unified diff of change *c* with the names in its ---/+++ lines
    quoted as git quotes them ('--- "a/x\\ny"'): they are the one place
    where the diff names a path (op diff's JSON keeps them exact)."""
    old = "a/" + (c.get("from") or (c["path"] if c["path"] != "." else "")) if "old" in c else None
    new = f"b/{c['path']}" if "new" in c else None
    sides = [side or "/dev/null" for side in (old, new)]
    head = f"--- {sides[0]}\n+++ {sides[1]}\n"
    if not c["diff"].startswith(head):  # (past.diff_entry writes it so; else no name raw)
        return "\n".join(map(printable, c["diff"].split("\n")))
    return f"--- {quote(sides[0])}\n+++ {quote(sides[1])}\n" + c["diff"][len(head) :]


def same_content(c: dict) -> bool:
    """A file whose bytes are back as they were (both sides hashed, equal)."""
    return (
        "old" in c
        and "new" in c
        and "xxh3" in c["old"]
        and c["old"].get("xxh3") == c["new"].get("xxh3")
    )


def attribute_changes(c: dict, mtime: bool) -> list[str]:
    """The mode of a changed entry when it differs, and (*mtime*: when the
    content is back as it was) its mtime."""
    old, new = c.get("old"), c.get("new")
    if not old or not new:
        return []
    rows = []
    if old["mode"] != new["mode"]:
        rows.append(f"mode {old['mode']:o} -> {new['mode']:o}")
    if mtime and old["mtime_ns"] != new["mtime_ns"]:
        rows.append(f"mtime {iso_ns(old['mtime_ns'])} -> {iso_ns(new['mtime_ns'])}")
    return rows


def iso_ns(ns: int) -> str:
    t = time.gmtime(ns // 10**9)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{ns % 10**9:09d}Z"


def side_sizes(c: dict) -> str:
    def one(side: str) -> str:
        d = c.get(side)
        if d is None:
            return "(none)"
        if "xxh3" not in d and d.get("sparse"):
            return f"{d['size']} bytes (sparse: not read)"
        return f"{d['size']} bytes xxh3 {d.get('xxh3', '-')}"

    return f"{one('old')} -> {one('new')}"


def do_show(args) -> int:
    layer, sep, path = args.spec.partition(":")
    if not sep or not layer.strip().isdigit():
        raise CowfsError(f"show takes ID:PATH, not {args.spec!r}", errors.USAGE)
    path = workspace_paths(args, [path])[0] if path not in ("", ".") else path
    res = call(args, "show", layer=int(layer), path=path, offset=0)
    if res["kind"] == "file":
        if args.json:
            out(args, None, res | {"data": None})
            return 0
        from .api import show_pages

        sink = sys.stdout.buffer
        for data in show_pages(
            res, lambda offset: call(args, "show", layer=int(layer), path=path, offset=offset)
        ):
            sink.write(data)
        sink.flush()
    elif res["kind"] == "dir":
        out(args, "\n".join(map(quote, res["entries"])) or None, res)
    elif res["kind"] == "symlink":
        out(args, quote(res["target"]), res)
    else:
        out(args, f"{res['kind']} mode {res['mode']:o}", res)
    return 0


def do_restore(args) -> int:
    paths = workspace_paths(args, args.paths)
    res = call(args, "restore", paths=paths, layer=args.layer)
    done = res["restored"]
    out(
        args,
        f"restored {len(done)} path{'s' if len(done) != 1 else ''}"
        + (
            ": " + ", ".join(map(quote, done[:10])) + (" ..." if len(done) > 10 else "")
            if done
            else ""
        ),
        res,
    )
    return 0


def do_gc(args) -> int:
    res = call(args, "gc")
    out(
        args,
        f"freed {human_size(res['freed_bytes'])}: " + (", ".join(res["done"]) or "nothing to free"),
        res,
    )
    return 0


def do_log(args) -> int:
    res = call(args, "log", **({"limit": args.max_count} if args.max_count else {}))
    if args.json:
        out(args, None, res["layers"])
        return 0
    now, top = time.time(), res["layers"][-1]["id"] if res["layers"] else None
    rows = [f"  {'ID':>4}  {'CREATED':<16}  {'CHANGES':>7}  {'SIZE':>10}  MESSAGE"]
    below = " " * 47  # (lines under a layer start at its MESSAGE)
    for layer in reversed(res["layers"]):
        rows.append(
            f"{'*' if layer['id'] == top else ' '} {layer['id']:>4}  "
            f"{ago(layer['created'], now):<16}  {layer['changes']:>7,}  "
            f"{human_size(layer['bytes']):>10}  {printable(layer['message'])}"
        )
        rows += [below + line for line in agent_lines(layer)]
        for d in layer.get("drift", []):
            rows.append(
                f"{below}drift accepted at mount ({count(len(d['paths']), 'path')} changed "
                f"while not mounted): {', '.join(map(quote, d['paths'][:5]))}"
            )
        for pm in layer.get("postmortems", []):
            first = (pm.get("output") or "").strip().splitlines()[:1]
            rows.append(
                f"{below}post-mortem of {pm.get('domain')} before reverting layer "
                f"{pm.get('layer')}: {printable(first[0]) if first else '(no output)'}"
            )
        for run in layer.get("runs", []):
            status = f"exit {run.get('exit_status')}"
            if run.get("verify_status") is not None:
                status += f", verify exit {printable(str(run['verify_status']))}"
            if isinstance(run.get("duration"), (int, float)):
                status += f", {duration(run['duration'])}"
            if isinstance(run.get("started"), (int, float)):
                status += f", {ago(run['started'], now)}"
            rows.append(
                f"{below}run {printable(str(run.get('outcome')))} ({printable(status)}): "
                f"{printable(str(run.get('command')))}"
            )
    rows += redo_line(res.get("redo"))
    out(args, "\n".join(rows), res["layers"])
    return 0


def summary(changes: list, limit: int | None = 10, every: bool = False) -> str:
    """Counts by kind, then the single changes and after them the
    directories added or deleted as a whole, one line each (*every*: each
    path), at most *limit* lines."""
    if not changes:
        return "no changes"
    dicts = [c.to_dict() for c in changes]
    return "\n".join(
        [listing.headline(listing.counts(dicts))]
        + [f"  {line}" for line in change_lines(dicts, every, limit)]
    )


def ask(question: str, choices: str, timeout: float) -> str | None:
    """Ask on the controlling terminal; None without one or without an
    answer in time."""
    try:
        tty = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        os.write(tty, question.encode())
        if not control.wait_readable(tty, timeout):
            os.write(tty, b"\n")
            return None
        answer = os.read(tty, 1024).decode(errors="replace").strip().lower()
    finally:
        os.close(tty)
    return answer[:1] if answer[:1] in choices else ""


def approve(result, timeout: float, keep: str) -> str:
    """keep / discard / show-diff loop for --approve; *keep*: what keeping
    means (--on-success: "keep" as its own layer, or "commit")."""
    print(summary(result.changes), file=sys.stderr)
    while True:
        answer = ask("cowfs: keep these changes? [k]eep, [d]iscard, [s]how all: ", "kds", timeout)
        if answer is None:
            print("cowfs: no answer (or no terminal): discarding", file=sys.stderr)
            return "rollback"
        if answer == "k":
            return keep
        if answer == "d":
            return "rollback"
        if answer == "s":
            print(summary(result.changes, limit=None, every=True), file=sys.stderr)


def do_run(args) -> int:
    from .api import Workspace
    from .store import Store

    cmd = command_argv(args)
    from .policy import Policy

    policy = Policy.load(args.policy)
    scope = args.scope or policy.settings["run_scope"]
    ephemeral = None
    if args.workspace:
        ws_path = os.path.realpath(args.workspace)
        if not os.path.isdir(ws_path):
            raise BadWorkspace(f"workspace {args.workspace} does not exist or is not a directory")
        if is_cowfs_mount(ws_path):
            ws = Workspace.attach(ws_path)
        else:
            created_store = not os.path.exists(default_store(ws_path))
            ws = Workspace.mount(ws_path)
            ephemeral = (ws_path, created_store)
    else:
        ws = Workspace.attach(args.path)
    shown = False
    try:
        decide = None
        if ephemeral is not None:

            def decide(result):
                nonlocal shown
                shown = True
                print(summary(result.changes), file=sys.stderr)
                if args.yes or args.no:
                    return "commit" if args.yes else "rollback"
                answer = ask("cowfs: keep these changes? [y/N] ", "yn", args.timeout)
                if answer is None:
                    print("cowfs: no answer (or no terminal): discarding", file=sys.stderr)
                return "commit" if answer == "y" else "rollback"
        elif args.approve:

            def decide(result):
                nonlocal shown
                shown = True
                return approve(result, args.timeout, args.on_success)

        result = ws.run(
            cmd,
            verify=args.verify,
            on_fail=args.on_fail,
            on_success=args.on_success,
            message=args.message,
            decide=decide,
            providers=args.provider,
            containers=args.container,
            vms=args.vm,
            scope=scope,
            policy=policy,
        )
        for warning in result.warnings:
            print(f"cowfs: warning: {warning}", file=sys.stderr)
        if ephemeral is not None and result.outcome == "committed":
            ws._commit_down_to(ws.log()[0].id)  # the base too: now permanent
        if result.outcome == "no checkpoint":
            print(
                f"cowfs: read-only ({'; '.join(result.reasons)}): no checkpoint taken",
                file=sys.stderr,
            )
        elif not shown:
            print(summary(result.changes), file=sys.stderr)
        why = (
            ""
            if result.ok
            else f" ({result.error})"
            if result.error
            else f" (the command exited {result.exit_status})"
            if result.exit_status
            else f" (the verifier exited {result.verify_status})"
        )
        where = (
            f" as layer {result.layer} ('cowfs rollback --to {result.layer}' undoes it)"
            if result.outcome == "kept" and ephemeral is None
            else ""
        )
        print(f"cowfs: {result.outcome}{where}{why}", file=sys.stderr)
        if args.json:
            print(json.dumps(result.record() | {"changes": [c.__dict__ for c in result.changes]}))
    finally:
        if ephemeral is not None:
            ws.unmount()
            ws_path, created_store = ephemeral
            if created_store and ephemeral_store_is_empty(ws_path):
                Store.destroy(default_store(ws_path))
    return result.status


def command_argv(args) -> list[str]:
    cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not cmd:
        raise CowfsError(f"{args.command} needs a command after --", errors.USAGE)
    return cmd


def do_policy(args) -> int:
    from .policy import Policy, Where

    policy = Policy.load(args.policy)
    if not args.argv:
        out(args, "\n".join(policy.sources), {"sources": policy.sources})
        return 0
    cmd = command_argv(args)
    try:
        root = find_mount(args.path).mountpoint
    except CowfsError:
        root = os.path.realpath(args.path)
    cwd = os.getcwd() if os.path.realpath(os.getcwd()).startswith(root) else root
    # one argument is a shell string, as `sh -c` would take it
    verdict = policy.classify(cmd[0] if len(cmd) == 1 else cmd, Where(cwd, [root]))
    lines = [verdict.scope] + [f"  {r}" for r in verdict.reasons]
    if verdict.containers:
        lines.append(
            f"  runs in container{'s' if len(verdict.containers) > 1 else ''} "
            + ", ".join(verdict.containers)
        )
    out(args, "\n".join(lines), verdict.__dict__)
    return 0


def ephemeral_store_is_empty(ws_path: str) -> bool:
    from .session import inspect_offline

    session = inspect_offline(ws_path, None)
    try:
        return not session.holds_changes()
    finally:
        session.close()


def do_provider(args) -> int:
    rec = find_mount(args.path)
    if args.action == "add":
        res = control.call(
            rec,
            "provider_add",
            name=args.name,
            type=args.type,
            capture=args.capture,
            restore=args.restore,
            discard=args.discard,
            container=args.container,
            domain=args.domain,
            diagnostics=args.diagnostics,
            health=args.health,
        )
        out(args, f"registered provider {args.name}", res)
    elif args.action == "remove":
        res = control.call(rec, "provider_remove", name=args.name)
        out(args, f"removed provider {args.name}", res)
    else:
        res = control.call(rec, "provider_list")["providers"]
        out(
            args,
            "\n".join(
                f"{p['name']}  {p['type']}  "
                + (
                    f"container: {p['container']}"
                    if p["type"] == "docker"
                    else f"domain: {p['domain']}"
                    if p["type"] == "libvirt"
                    else f"capture: {p.get('capture', '')}"
                )
                for p in res
            )
            or None,
            res,
        )
    return 0


def do_check(args) -> int:
    """Exit 0 when the store is consistent, 6 when problems remain."""
    try:
        rec = find_mount(args.path)
    except NotMounted:
        rec = None
        workspace, found = (
            (os.path.realpath(args.path), args.offline_store)
            if args.offline_store
            else locate(args.path).unmounted(args.path)
        )
        store_dir: str = found or default_store(workspace)

    def offline_check(repair: bool) -> dict:
        import functools

        import trio

        from .session import inspect_offline

        session = inspect_offline(workspace, store_dir, readonly=not repair)
        try:
            return (
                trio.run(session.repair)
                if repair
                else trio.run(functools.partial(session.check, full=True))
            )
        finally:
            session.close()

    with progress_shown(args, "check"):
        res = control.call(rec, "check", full=True) if rec else offline_check(False)
    lines = [
        f"checked {count(res['chunks'], 'chunk')} ({count(res['bytes_checked'], 'byte')}), "
        f"{count(res['records'], 'record')}, {count(res['graves'], 'removed object')}"
        + (
            f" ({count(res['graves_hashed'], 'file')} by hash, "
            f"{count(res['grave_bytes_checked'], 'byte')})"
            if res.get("graves_hashed")
            else ""
        )
        + ": "
        + ("consistent" if res["ok"] else count(len(res["problems"]), "problem"))
    ]
    lines += [f"  {p['text']}" for p in res["problems"]]
    if res.get("unsealed"):
        lines.append(
            f"  note: {count(res['unsealed'], 'record')} written by an older cowfs "
            "without a checksum (read as they are)"
        )
    if args.repair and not res["ok"]:
        fixable = [p for p in res["problems"] if p["repairable"]]
        if not fixable:
            lines.append(
                "nothing here can be repaired without inventing data; a rollback "
                "skips the objects named and reports them"
            )
        else:
            if not args.json:
                print("\n".join(lines))
                lines = []
            if not args.yes:
                answer = ask(
                    f"cowfs: repair {len(fixable)} problem"
                    f"{'s' if len(fixable) > 1 else ''}? [y/N] ",
                    "yn",
                    300,
                )
                if answer != "y":
                    raise CowfsError(
                        "not repaired" + (" (no terminal: use --yes)" if answer is None else ""),
                        errors.STORE_ERROR,
                    )
            with progress_shown(args, "repair"):
                res = control.call(rec, "repair") if rec else offline_check(True)
            lines += [f"repaired: {d}" for d in res["repaired"]]
            lines.append(
                "now "
                + (
                    "consistent"
                    if res["ok"]
                    else f"{count(len(res['problems']), 'problem')} remain:"
                )
            )
            lines += [f"  {p['text']}" for p in res["problems"]]
    out(args, "\n".join(lines), res)
    return 0 if res["ok"] else errors.STORE_ERROR


def do_mcp(args) -> int:
    from .mcpserver import serve

    return serve(args.path, mount=args.mount, as_user=args.as_user)


def agent_lines(layer: dict) -> list[str]:
    """The agent events recorded on *layer* (see ``agents.describe``)."""
    if not layer.get("agent") and not layer.get("turns"):
        return []
    from .agents import describe

    return describe(layer)


def do_hooks(args) -> int:
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
            )
            if res["changed"]
            else f"no cowfs hooks of {a.name} in {res['settings']}",
            res,
        )
    return 0


def do_hook(args) -> int:
    """Never blocks or breaks the agent: exit 0 whatever happens; a failure
    is one line on stderr and, for the agent to show, a systemMessage."""
    try:
        from . import agents

        said, layer = agents.handle(args.agent, args.event, None if args.path == "." else args.path)
        if layer is None:
            print(f"cowfs: {said}", file=sys.stderr)
    except BaseException as e:  # (even Ctrl-C: the agent goes on)
        line = f"cowfs: no checkpoint taken: {e or type(e).__name__}"
        print(line, file=sys.stderr)
        print(json.dumps({"systemMessage": line}))
    return 0


def do_rewind(args) -> int:
    from . import agents

    layers = call(args, "log")["layers"]
    target, undone = agents.turns_to_rewind(layers, args.turns)
    changes = call(args, "changes", since=target)["changes"]
    what = count(args.turns, "turn")
    ids = f"{target}" if len(undone) == 1 else f"{target} to {undone[-1]['id']}"
    lines = [f"rewinding {what} rolls back layer{'s' if len(undone) > 1 else ''} {ids}:"]
    for layer in undone:
        lines.append(f"  {layer['id']:>4}  {printable(layer['message'])}")
        lines += [f"        {line}" for line in agent_lines(layer)]
    lines.append(f"and undoes {count(len(changes), 'change')}" + (":" if changes else ""))
    lines += [f"  {format_change(c)}" for c in changes[:50]]
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


def do_doctor(args) -> int:
    from .doctor import report

    return report(args.target, args.json, store=args.store)


COMMANDS = {
    "mount": do_mount,
    "unmount": do_unmount,
    "checkpoint": do_checkpoint,
    "rollback": do_rollback,
    "redo": do_redo,
    "commit": do_commit,
    "status": do_status,
    "log": do_log,
    "run": do_run,
    "doctor": do_doctor,
    "provider": do_provider,
    "policy": do_policy,
    "check": do_check,
    "gc": do_gc,
    "diff": do_diff,
    "show": do_show,
    "restore": do_restore,
    "view": do_view,
    "audit": do_audit,
    "mcp": do_mcp,
    "hooks": do_hooks,
    "hook": do_hook,
    "rewind": do_rewind,
}


# commands whose PATHs come after "--" (the rest of the line is parsed as
# usual, so options may come in any order before it)
PATH_COMMANDS = ("diff", "status")


def command_of(argv: list[str]) -> str | None:
    """The subcommand named in *argv* (skipping the global options)."""
    tokens = iter(argv)
    for token in tokens:
        if token in ("-C", "--store"):
            next(tokens, None)
        elif not token.startswith("-"):
            return token
    return None


def parse(argv: list[str]) -> argparse.Namespace:
    head = argv[: argv.index("--")] if "--" in argv else argv
    Parser.json_errors = "--json" in head
    command = command_of(head)
    parser = build_parser(only=command if command in COMMANDS else None)
    if command in PATH_COMMANDS and "--" in argv:
        args = parser.parse_args(head)
        args.paths = args.paths + argv[len(head) + 1 :]
        return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        return COMMANDS[args.command](args)
    except CowfsError as e:
        if args.json:
            print(json.dumps(e.to_dict()))
        print(f"cowfs: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("cowfs: interrupted", file=sys.stderr)
        return errors.INTERRUPTED
    except BrokenPipeError:  # the reader went away (cowfs audit | head)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        name = quote(os.fsdecode(e.filename)) + ": " if e.filename else ""
        print(f"cowfs: {name}{e.strerror or e}", file=sys.stderr)
        return errors.DAEMON_ERROR
    except Exception as e:  # a bug: still one line, never a traceback
        print(f"cowfs: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        return errors.DAEMON_ERROR


if __name__ == "__main__":
    sys.exit(main())
