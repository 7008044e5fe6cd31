"""The commands that run a command as a step, and classify one: run, policy."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from .. import errors
from ..errors import BadWorkspace, CowfsError
from ..system.mounts import default_store, find_mount, is_cowfs_mount
from ..text import json_text
from .command import (
    RUN_SCOPES,
    Arg,
    Command,
    Limit,
    RunScope,
    ask,
    command_argv,
    out,
    seen_from,
    snapshot_options,
)
from .render import TEXT_LIMIT, clean, format_change, summary

if TYPE_CHECKING:
    from .api import RunResult, Workspace


def approve(result: RunResult, timeout: float, keep: str, base: str = "") -> str:
    """keep / discard / show-diff loop for --approve; *keep*: what keeping
    means (--on-success: "keep" as its own layer, or "commit"); paths
    seen from *base* (render.relative_change)."""
    print(summary(result.changes, base=base, times_only=result.times_only), file=sys.stderr)
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
            print(
                summary(
                    result.changes,
                    limit=None,
                    every=True,
                    base=base,
                    times_only=result.times_only,
                ),
                file=sys.stderr,
            )


def ephemeral_store_is_empty(ws_path: str) -> bool:
    from ..service.session import inspect_offline

    session = inspect_offline(ws_path, None)
    try:
        return not session.holds_changes()
    finally:
        session.close()


class Run(Command):
    name = "run"
    help = "run a command as a step: keep what it changed, or roll it back"
    examples = (
        "  cowfs run --verify 'make test' -- make upgrade\n"
        "  cowfs run --workspace /etc --approve -- apt-get upgrade"
    )
    prints_paths = True
    ops = ("checkpoint", "rollback", "commit", "changes", "annotate", "provider_list", "log")

    def add_options(self, s: argparse.ArgumentParser) -> None:
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
            help="after success, show the changes and ask on the terminal: keep, discard or "
            "show all (no terminal, or no answer within --timeout: discard)",
        )
        s.add_argument(
            "--timeout",
            type=float,
            default=300,
            metavar="SECONDS",
            help="with --approve (and --workspace): no answer in time means discard (default 300)",
        )
        s.add_argument(
            "--workspace",
            metavar="DIR",
            help="mount DIR just for this command, then ask whether to keep the changes "
            "(kept: committed for good; either way DIR is unmounted and the store made "
            "for it removed)",
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

    def run(self, args: argparse.Namespace) -> int:
        from ..storage.store import Store

        cmd = command_argv(args)
        from ..escalation.policy import Policy

        if getattr(args, "fork", None):
            # (CMD sees the fork at the workspace's own path; this process's
            # requests go to the fork's daemon at the fork's path)
            from .cmd_forks import private_namespace

            private_namespace(args.fork_root, args.fork_of)
            here = os.getcwd()
            inside = here == args.fork_of or here.startswith(args.fork_of + "/")
            args.cwd = here if inside else args.fork_of

        policy = Policy.load(args.policy)
        scope = args.scope or policy.settings["run_scope"]
        ws, ephemeral = self.workspace(args)
        args.base = seen_from(args, ws.root)  # (where the summaries name paths from)
        shown: list[bool] = []  # (the changes were shown when deciding)
        try:
            result = ws.run(
                cmd,
                verify=args.verify,
                on_fail=args.on_fail,
                on_success=args.on_success,
                message=args.message,
                decide=self.decider(args, ephemeral is not None, shown),
                providers=args.provider,
                containers=args.container,
                vms=args.vm,
                scope=scope,
                policy=policy,
                cwd=getattr(args, "cwd", None),
            )
            for warning in result.warnings:
                print(f"cowfs: warning: {warning}", file=sys.stderr)
            if ephemeral is not None and result.outcome == "committed":
                ws.commit_down_to(ws.log()[0].id)  # the base too: now permanent
            self.report(args, result, ephemeral is not None, bool(shown))
        finally:
            if ephemeral is not None:
                ws.unmount()
                ws_path, created_store = ephemeral
                if created_store and ephemeral_store_is_empty(ws_path):
                    Store.destroy(default_store(ws_path))
        return result.status

    @staticmethod
    def workspace(args: argparse.Namespace) -> tuple[Workspace, tuple[str, bool] | None]:
        """The workspace to run in and, when --workspace mounted it just for
        this command, its path and whether its store was made for it."""
        from .api import Workspace

        if not args.workspace:
            return Workspace.attach(args.path), None
        ws_path = os.path.realpath(args.workspace)
        if not os.path.isdir(ws_path):
            raise BadWorkspace(f"workspace {args.workspace} does not exist or is not a directory")
        if is_cowfs_mount(ws_path):
            return Workspace.attach(ws_path), None
        created_store = not os.path.exists(default_store(ws_path))
        return Workspace.mount(ws_path), (ws_path, created_store)

    @staticmethod
    def decider(
        args: argparse.Namespace, ephemeral: bool, shown: list[bool]
    ) -> Callable[[Any], str] | None:
        """How a successful step is decided on: asked (--workspace, or
        --approve), or None (--on-success)."""
        if ephemeral:

            def decide(result: Any) -> str:
                shown.append(True)
                print(
                    summary(result.changes, base=args.base, times_only=result.times_only),
                    file=sys.stderr,
                )
                if args.yes or args.no:
                    return "commit" if args.yes else "rollback"
                answer = ask("cowfs: keep these changes? [y/N] ", "yn", args.timeout)
                if answer is None:
                    print("cowfs: no answer (or no terminal): discarding", file=sys.stderr)
                return "commit" if answer == "y" else "rollback"

            return decide
        if args.approve:

            def approved(result: Any) -> str:
                shown.append(True)
                return approve(result, args.timeout, args.on_success, args.base)

            return approved
        return None

    @staticmethod
    def report(args: argparse.Namespace, result: Any, ephemeral: bool, shown: bool) -> None:
        if result.outcome == "no checkpoint":
            print(
                f"cowfs: read-only ({'; '.join(result.reasons)}): no checkpoint taken",
                file=sys.stderr,
            )
        elif not shown:
            print(
                summary(result.changes, base=args.base, times_only=result.times_only),
                file=sys.stderr,
            )
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
            if result.outcome == "kept" and not ephemeral
            else ""
        )
        print(f"cowfs: {result.outcome}{where}{why}", file=sys.stderr)
        if args.json:
            print(json_text(result.record() | {"changes": [c.__dict__ for c in result.changes]}))

    def tool(
        self,
        ws: Workspace,
        command: Annotated[str | list[str], Arg("a shell command line, or an argument list")],
        verify: Annotated[
            str | None, Arg("a shell command that must also succeed afterwards")
        ] = None,
        message: Annotated[str | None, Arg("the step's layer message")] = None,
        on_fail: Literal["rollback", "keep"] = "rollback",
        on_success: Annotated[
            Literal["keep", "commit"],
            Arg(
                "a successful step: keep its layer as an undo point of its own "
                "(default), or merge it into the layer below"
            ),
        ] = "keep",
        cwd: Annotated[str | None, Arg("working directory, relative to the workspace root")] = None,
        scope: Annotated[RunScope, Arg("what to snapshot (see cowfs run)")] = "files",
        timeout: Annotated[float | None, Arg("seconds before the command is killed", gt=0)] = 600,
        max_bytes: Limit = TEXT_LIMIT,
        fork: Annotated[
            str | None,
            Arg("run it in this fork (see the fork tool), seen at the workspace's own path"),
        ] = None,
    ) -> dict:
        """Run a command in the workspace as one step in its own layer: if it
        (or `verify`) fails, everything it changed is rolled back; otherwise
        its layer stays (rollback with `to` that layer undoes it later).
        Returns the exit statuses, what changed (as status lists changes),
        the outcome, the layer that holds the step (none once rolled back)
        and the command's and the verifier's stdout and stderr (stdin is
        empty)."""
        where = os.path.normpath(os.path.join(ws.root, cwd or "."))
        if where != ws.root and not where.startswith(ws.root.rstrip("/") + "/"):
            raise CowfsError(f"cwd {cwd!r} is outside the workspace", errors.USAGE)
        if fork is not None:
            from .api import Fork

            row = next((f for f in ws.forks() if f["name"] == fork), None)
            if row is None:
                raise CowfsError(f"no fork {fork}", errors.UNKNOWN_LAYER)
            ws = Fork.of(ws, fork, row["path"])
        r = ws.run(
            command,
            verify=verify,
            on_fail=on_fail,
            on_success=on_success,
            message=message,
            cwd=where,
            scope=scope,
            capture_output=True,
            timeout=timeout,
            output_limit=max_bytes,
        )
        return r.record() | {
            "ok": r.ok,
            "changes": clean([c.to_dict() for c in r.changes]),
            "stdout": r.stdout,
            "stderr": r.stderr,
            "verify_stdout": r.verify_stdout,
            "verify_stderr": r.verify_stderr,
        }

    def tool_text(self, result: Any) -> str:
        r = result
        why = f" ({r['error']})" if r.get("error") else ""
        head = (
            f"{r['outcome']}{why}: exit {r['exit_status']}"
            + (f", verify exit {r['verify_status']}" if r["verify_status"] is not None else "")
            + f", {len(r['changes'])} change(s)"
            # (a step rolled back, or run without a checkpoint, is in no layer)
            + (f", in layer {r['layer']}" if r["layer"] is not None else "")
        )
        parts = [head, *r["warnings"], *map(format_change, r["changes"][:50])]
        for key in ("stdout", "stderr", "verify_stdout", "verify_stderr"):
            if r[key]:
                parts += [f"--- {key.replace('_', ' ')}", r[key].rstrip("\n")]
        return "\n".join(parts)


class Policy(Command):
    name = "policy"
    help = "show how the escalation policy classifies a command (or which policy files are in use)"
    examples = "  cowfs policy -- pip install requests\n  cowfs policy   # the files in use"

    def add_options(self, s: argparse.ArgumentParser) -> None:
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

    def run(self, args: argparse.Namespace) -> int:
        from ..escalation.policy import Policy, Where

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
