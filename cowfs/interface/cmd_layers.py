"""The commands that change the layer stack: checkpoint, rollback, redo,
commit, restore."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Annotated, Any

from .. import errors
from ..errors import CowfsError
from ..text import count, quote, relative
from .client import Client
from .command import (
    Arg,
    Command,
    Layer,
    PathsBytes,
    ask,
    call,
    given_paths,
    out,
    seen_from,
    snapshot_options,
    times,
    workspace_paths,
)
from .render import clean, format_change, times_line

if TYPE_CHECKING:
    from .api import Workspace


def rollback_args(args: argparse.Namespace, yes: bool) -> dict[str, Any]:
    extra = {"skip_damaged": True} if args.skip_damaged else {}
    return {"to": args.to, "keep_redo": not args.no_redo, "yes": yes} | extra


class Checkpoint(Command):
    name = "checkpoint"
    help = "open a new layer; print its id"
    examples = (
        "  cowfs checkpoint -m 'before the upgrade'\n"
        "  cowfs checkpoint -m 'with the database' --provider db"
    )
    ops = ("checkpoint",)

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument("-m", "--message", default="", help="what the layer is for (shown by log)")
        snapshot_options(s)

    def run(self, args: argparse.Namespace) -> int:
        res = Client.attach(args.path).call(
            "checkpoint",
            message=args.message,
            providers=args.provider,
            containers=args.container,
            vms=args.vm,
        )
        out(args, str(res["id"]), res)
        return 0

    def tool(
        self, ws: Workspace, message: Annotated[str, Arg("what the layer is for")] = ""
    ) -> dict:
        """Open a new layer: everything changed from now on can be rolled back
        to this point. Returns the new layer's id."""
        return clean(ws.call("checkpoint", message=message))


class Rollback(Command):
    name = "rollback"
    help = "undo the top layer (or every layer down to and including ID)"
    examples = (
        "  cowfs rollback                 # the open layer\n"
        "  cowfs rollback --to 3 --dry-run   # what undoing layers 3 and up would change"
    )
    prints_paths = True
    ops = ("rollback", "changes")

    def add_options(self, s: argparse.ArgumentParser) -> None:
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
            "--times",
            action="store_true",
            help="with --dry-run: also list the paths whose modification time alone "
            "differs (the rollback puts their times back; counted otherwise)",
        )
        s.add_argument(
            "--no-redo",
            action="store_true",
            help="keep nothing for `cowfs redo` (faster; frees the undo data at once)",
        )
        s.add_argument(
            "--skip-damaged",
            action="store_true",
            help="give up the steps whose undo data is damaged or that failed (their objects "
            "stay as they are) and drop the layers; without it such layers stay, holding "
            "those steps",
        )
        s.add_argument(
            "--yes",
            action="store_true",
            help="roll back the base layer (everything since the mount) without "
            "asking; without a terminal it is refused otherwise (exit 14); --to naming "
            "the base layer needs no --yes",
        )

    def run(self, args: argparse.Namespace) -> int:
        if args.dry_run:
            res = call(args, "changes", since=args.to, **times(args))
            base = seen_from(args)
            rows = [format_change(c, base) for c in res["changes"]] + times_line(res)
            out(args, "\n".join(rows) or None, res)
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

    def tool(
        self,
        ws: Workspace,
        to: Layer = None,
        dry_run: Annotated[bool, Arg("only list what would be undone; change nothing")] = False,
        no_redo: Annotated[bool, Arg("keep nothing for redo (faster)")] = False,
        skip_damaged: Annotated[
            bool,
            Arg(
                "give up the steps whose undo data is damaged or that failed (their "
                "objects stay as they are) and drop the layers; without it such layers stay"
            ),
        ] = False,
        yes: Annotated[
            bool,
            Arg(
                "confirm a rollback of the base layer (everything since the workspace was mounted)"
            ),
        ] = False,
    ) -> dict:
        """Undo the open layer (everything since the last checkpoint), or with
        `to` every layer down to and including that one: the workspace is then
        exactly as it was when that layer was opened. `redo` undoes a rollback
        while nothing that it would put back has changed since. When the open
        layer is the base layer, a rollback without `to` undoes the whole
        session and is refused (exit code 14) unless `yes`."""
        if dry_run:
            return clean(ws.call("changes", since=to))
        extra: dict[str, Any] = {"skip_damaged": True} if skip_damaged else {}
        return clean(ws.call("rollback", to=to, keep_redo=not no_redo, yes=yes, **extra))


class Redo(Command):
    name = "redo"
    help = (
        "undo the last rollback: bring its layers and files back exactly, as long as "
        "nothing changed since (otherwise say why not and change nothing)"
    )
    examples = "  cowfs rollback && cowfs redo   # changed your mind"
    ops = ("redo",)

    def run(self, args: argparse.Namespace) -> int:
        res = call(args, "redo")
        restored = ", ".join(map(str, res["restored"]))
        out(
            args,
            f"redid: layer{'s' if len(res['restored']) > 1 else ''} {restored} back "
            f"({count(res['applied'], 'step')}); open layer is {res['top']}",
            res,
        )
        return 0

    def tool(self, ws: Workspace) -> dict:
        """Undo the last rollback exactly, if nothing has changed since
        (otherwise it says why not and changes nothing)."""
        return clean(ws.call("redo"))


class Commit(Command):
    name = "commit"
    help = "merge the top layer into the one below (the base: make permanent)"
    examples = "  cowfs commit   # keep the open layer's changes (merge into the one below)"
    ops = ("commit",)

    def run(self, args: argparse.Namespace) -> int:
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

    def tool(self, ws: Workspace) -> dict:
        """Keep the open layer's changes: merge it into the layer below (the
        base layer: make them permanent)."""
        return clean(ws.call("commit"))


class Restore(Command):
    name = "restore"
    help = (
        "put PATHs (files or subtrees) back as they were when layer ID was opened, as a "
        "new change of the open layer"
    )
    examples = "  cowfs restore config.yaml\n  cowfs restore --from 2 -- src/"
    prints_paths = True
    ops = ("restore",)

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "--from",
            dest="layer",
            type=int,
            metavar="ID",
            help="the layer (default: the open layer)",
        )
        s.add_argument(
            "paths",
            nargs="+",
            metavar="PATH",
            help="relative to the current directory inside the workspace, like git's "
            "(else to its root)",
        )

    def run(self, args: argparse.Namespace) -> int:
        paths = workspace_paths(args, args.paths)
        res = call(args, "restore", paths=paths, layer=args.layer)
        done, base = res["restored"], seen_from(args)
        out(
            args,
            f"restored {len(done)} path{'s' if len(done) != 1 else ''}"
            + (
                ": "
                + ", ".join(quote(relative(p, base)) for p in done[:10])
                + (" ..." if len(done) > 10 else "")
                if done
                else ""
            ),
            res,
        )
        return 0

    # (B006: the default lists are never changed; the tool's schema is its signature)
    def tool(
        self,
        ws: Workspace,
        paths: Annotated[
            list[str], Arg("files or directories, relative to the workspace root")
        ] = [],  # noqa: B006
        paths_bytes: PathsBytes = [],  # noqa: B006
        from_: Annotated[
            int | None, Arg("the layer (default: the open layer)", alias="from")
        ] = None,
    ) -> dict:
        """Put some paths back as they were when a layer was opened (the rest
        of the workspace stays as it is); the restore is itself a change of
        the open layer."""
        names = given_paths(paths, paths_bytes)
        if not names:
            raise CowfsError("restore needs paths (or paths_bytes)", errors.USAGE)
        return {"restored": ws.restore(names, from_)}
