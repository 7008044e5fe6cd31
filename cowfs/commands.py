"""Every command of ``cowfs``, declared once (as pip's ``commands_dict``
and borg's ``do_X`` beside ``build_parser_X``): one class per command with
its options and help, its handler, the control operations it sends and,
for those an agent may use, its MCP tool.  The parser, the commands' table
and the MCP server's tools are derived from ``COMMANDS``; which operations
work offline and which cannot stop half-way is declared with the
operations themselves (``operations``).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from . import __version__, errors, listing
from .client import Client
from .command import (
    RUN_SCOPES,
    Arg,
    Command,
    Parser,
    RunScope,
    ask,
    call,
    client,
    command_argv,
    json_option,
    layer_id,
    out,
    parse_count,
    parse_limit,
    parse_number,
    parse_size,
    progress_shown,
    snapshot_options,
    workspace_option,
    workspace_paths,
)
from .errors import BadWorkspace, CowfsError, NotMounted
from .mounts import (
    check_answering,
    default_store,
    find_mount,
    is_cowfs_mount,
    locate,
    mount_table,
    processes,
)
from .render import (
    TEXT_LIMIT,
    agent_lines,
    change_lines,
    clean,
    cut,
    diff_rows,
    format_change,
    format_event,
    format_who,
    redo_line,
    summary,
    utf8,
)
from .text import ago, count, duration, human_size, printable, quote

if TYPE_CHECKING:
    from .api import Workspace

# the MCP tools' common arguments
Layer = Annotated[int | None, Arg("a layer id (from checkpoint or log)")]
Limit = Annotated[int, Arg("most bytes of text to return; the rest is cut", ge=256, le=4 << 20)]


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


def rollback_args(args, yes: bool) -> dict:
    extra = {"skip_damaged": True} if args.skip_damaged else {}
    return {"to": args.to, "keep_redo": not args.no_redo, "yes": yes} | extra


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


def ephemeral_store_is_empty(ws_path: str) -> bool:
    from .session import inspect_offline

    session = inspect_offline(ws_path, None)
    try:
        return not session.holds_changes()
    finally:
        session.close()


class Mount(Command):
    name = "mount"
    help = "mount WORKSPACE (over itself, or at MOUNTPOINT) and capture every change"
    examples = (
        "  cowfs mount ~/project\n  cowfs mount --max-store 2G --ignore 'node_modules/.cache/' ."
    )

    def add_options(self, s: argparse.ArgumentParser) -> None:
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

    def run(self, args: argparse.Namespace) -> int:
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


class Unmount(Command):
    name = "unmount"
    help = "flush and unmount a workspace"
    examples = (
        "  cowfs unmount ~/project\n  cowfs unmount --lazy ~/project   # a shell is still in it"
    )

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument("--lazy", action="store_true", help="detach even while busy")
        s.add_argument(
            "target",
            nargs="?",
            metavar="PATH",
            help="the workspace or a view (default: -C PATH, the current directory)",
        )

    def run(self, args: argparse.Namespace) -> int:
        check_answering(args.target or args.path)
        target = os.path.realpath(args.target or args.path)
        if unmount_view(target):
            out(args, f"unmounted the view at {target}", {"unmounted": target})
            return 0
        ws = Client.attach(args.target or args.path)
        rec = ws.record
        users = ws.unmount(lazy=args.lazy)
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

    def run(self, args: argparse.Namespace) -> int:
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

    def tool(
        self,
        ws: Workspace,
        to: Layer = None,
        dry_run: Annotated[bool, Arg("only list what would be undone; change nothing")] = False,
        no_redo: Annotated[bool, Arg("keep nothing for redo (faster)")] = False,
        skip_damaged: Annotated[
            bool,
            Arg(
                "give up the steps whose undo data is damaged (their objects "
                "stay as they are) and drop the layers; without it such layers stay"
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

    def add_options(self, s: argparse.ArgumentParser) -> None:
        pass

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


class Diff(Command):
    name = "diff"
    help = (
        "changes since layer ID was opened (default: the open layer), with their content: "
        "unified diff for text, sizes and xxh3 for binary"
    )
    examples = "  cowfs diff --stat\n  cowfs diff 2 --name-status -- src/"
    paths_after_dashdash = True  # (the rest of the line is parsed as usual)
    ops = ("diff", "changes")

    def add_options(self, s: argparse.ArgumentParser) -> None:
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

    def run(self, args: argparse.Namespace) -> int:
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

    # (B006: the default list is never changed; the tool's schema is its signature)
    def tool(
        self,
        ws: Workspace,
        layer: Layer = None,
        paths: Annotated[list[str], Arg("only these paths (relative to the workspace root)")] = [],  # noqa: B006
        stat: Annotated[bool, Arg("lines added and removed per file instead of the diff")] = False,
        name_status: Annotated[bool, Arg("only the kind and path of each change")] = False,
        max_bytes: Limit = TEXT_LIMIT,
    ) -> dict:
        """Changes since a layer was opened (default: the open layer, i.e. since
        the last checkpoint) with their content: a unified diff for text files,
        sizes and hashes for binary ones. Large output is cut at max_bytes:
        narrow it with paths, or use stat or name_status."""
        res = ws.call("diff", since=layer, paths=list(paths))
        text = "\n".join(diff_rows(res["changes"], name_status, stat, False))
        text, cut_ = cut(
            text or "no changes", max_bytes, "ask for fewer paths, or use stat or name_status"
        )
        names = [
            {k: c.get(k) for k in ("path", "kind", "from") if c.get(k) is not None}
            for c in res["changes"]
        ]
        return {"since": res["since"], "changes": names, "text": text, "cut": cut_}

    def tool_text(self, result: Any) -> str:
        return result["text"]


class Audit(Command):
    name = "audit"
    help = (
        "the audit log: mounts, checkpoints, commits, rollbacks, restores and every change "
        "kept or undone (kept through commits)"
    )
    examples = "  cowfs audit --since 4\n  cowfs audit --jsonl | jq 'select(.event==\"change\")'"
    ops = ("audit", "audit_prune")

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument("--since", type=int, metavar="ID", help="from layer ID's checkpoint on")
        s.add_argument("--jsonl", action="store_true", help="one JSON event per line")
        s.add_argument(
            "--prune",
            type=float,
            metavar="DAYS",
            help="remove events older than DAYS instead (audit retention is separate "
            "from undo data)",
        )

    def run(self, args: argparse.Namespace) -> int:
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


class View(Command):
    name = "view"
    help = (
        "mount the tree as it was when layer ID was opened, read-only, at DIR ('cowfs "
        "unmount DIR' ends it)"
    )
    examples = "  cowfs view 2 /tmp/before && diff -r /tmp/before . ; cowfs unmount /tmp/before"
    ops = ("view",)

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument("layer", type=int, metavar="ID", help="the layer whose start to show")
        s.add_argument("dir", metavar="DIR", help="an empty directory to mount the view at")

    def run(self, args: argparse.Namespace) -> int:
        res = call(args, "view", layer=args.layer, mountpoint=os.path.abspath(args.dir))
        out(
            args,
            f"layer {args.layer} as it was opened is at {res['mountpoint']} (read-only; "
            f"'cowfs unmount {args.dir}' ends it)",
            res,
        )
        return 0


class Restore(Command):
    name = "restore"
    help = (
        "put PATHs (files or subtrees) back as they were when layer ID was opened, as a "
        "new change of the open layer"
    )
    examples = "  cowfs restore config.yaml\n  cowfs restore --from 2 -- src/"
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

    def tool(
        self,
        ws: Workspace,
        paths: Annotated[
            list[str], Arg("files or directories, relative to the workspace root", min_length=1)
        ],
        from_: Annotated[
            int | None, Arg("the layer (default: the open layer)", alias="from")
        ] = None,
    ) -> dict:
        """Put some paths back as they were when a layer was opened (the rest
        of the workspace stays as it is); the restore is itself a change of
        the open layer."""
        return {"restored": ws.restore(paths, from_)}


class Show(Command):
    name = "show"
    help = (
        "print PATH as it was when layer ID was opened (a file's bytes, a directory's "
        "names, a symlink's target), changing nothing"
    )
    examples = "  cowfs show 2:setup.py\n  cowfs show 1:  # the root's names then"
    ops = ("show",)

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "spec",
            metavar="ID:PATH",
            help="the layer and the path (relative to the current directory inside "
            "the workspace; ID: alone is the root)",
        )

    def run(self, args: argparse.Namespace) -> int:
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

    def tool(
        self,
        ws: Workspace,
        layer: Annotated[int, Arg("the layer: PATH as it was when this layer was opened")],
        path: Annotated[str, Arg("relative to the workspace root")],
        max_bytes: Limit = TEXT_LIMIT,
    ) -> dict:
        """A file, directory or symlink as it was when a layer was opened,
        changing nothing: a file's text (binary files: size only), a
        directory's names, a symlink's target."""
        res = ws.call("show", layer=layer, path=path, size=max_bytes + 1)
        out = {k: res.get(k) for k in ("path", "kind", "layer", "mode", "size")}
        if res["kind"] == "file":
            text = utf8(base64.b64decode(res["data"])[:max_bytes])
            out["binary"] = text is None or "\0" in text
            out["cut"] = res["size"] > max_bytes
            out["text"] = (
                f"(binary, {res['size']} bytes)"
                if out["binary"]
                else (text or "")
                + (f"\n[... cut at {max_bytes} of {res['size']} bytes]" if out["cut"] else "")
            )
        elif res["kind"] == "dir":
            out["entries"] = res["entries"]
            out["text"] = "\n".join(res["entries"]) or "(empty directory)"
        elif res["kind"] == "symlink":
            out["target"] = out["text"] = res["target"]
        else:
            out["text"] = f"{res['kind']} mode {res['mode']:o}"
        return out

    def tool_text(self, result: Any) -> str:
        return result["text"]


class Commit(Command):
    name = "commit"
    help = "merge the top layer into the one below (the base: make permanent)"
    examples = "  cowfs commit   # keep the open layer's changes (merge into the one below)"
    ops = ("commit",)

    def add_options(self, s: argparse.ArgumentParser) -> None:
        pass

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


class Run(Command):
    name = "run"
    help = "run a command as a step: keep what it changed, or roll it back"
    examples = (
        "  cowfs run --verify 'make test' -- make upgrade\n"
        "  cowfs run --workspace /etc --approve -- apt-get upgrade"
    )
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

    def run(self, args: argparse.Namespace) -> int:
        from .store import Store

        cmd = command_argv(args)
        from .policy import Policy

        policy = Policy.load(args.policy)
        scope = args.scope or policy.settings["run_scope"]
        ws, ephemeral = self.workspace(args)
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
                print(summary(result.changes), file=sys.stderr)
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
                return approve(result, args.timeout, args.on_success)

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
            if result.outcome == "kept" and not ephemeral
            else ""
        )
        print(f"cowfs: {result.outcome}{where}{why}", file=sys.stderr)
        if args.json:
            print(json.dumps(result.record() | {"changes": [c.__dict__ for c in result.changes]}))

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
    ) -> dict:
        """Run a command in the workspace as one step in its own layer: if it
        (or `verify`) fails, everything it changed is rolled back; otherwise
        its layer stays (rollback with `to` that layer undoes it later).
        Returns the exit statuses, what changed, the outcome, the layer and
        the command's and the verifier's stdout and stderr (stdin is
        empty)."""
        where = os.path.normpath(os.path.join(ws.root, cwd or "."))
        if where != ws.root and not where.startswith(ws.root.rstrip("/") + "/"):
            raise CowfsError(f"cwd {cwd!r} is outside the workspace", errors.USAGE)
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
            "changes": [str(c) for c in r.changes],
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
            + f", {len(r['changes'])} change(s), layer {r['layer']}"
        )
        parts = [head, *r["warnings"], *r["changes"][:50]]
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


class Provider(Command):
    name = "provider"
    help = "register, list or remove the workspace's providers"
    examples = (
        "  cowfs provider add db --capture 'pg_dump app > \"$COWFS_STATE_DIR/d\"' "
        "--restore 'psql app < \"$COWFS_STATE_DIR/d\"'\n"
        "  cowfs provider list"
    )
    ops = ("provider_add", "provider_remove", "provider_list")

    def add_options(self, s: argparse.ArgumentParser) -> None:
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

    def run(self, args: argparse.Namespace) -> int:
        ws = Client.attach(args.path)
        if args.action == "add":
            res = ws.call(
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
            res = ws.call("provider_remove", name=args.name)
            out(args, f"removed provider {args.name}", res)
        else:
            res = ws.call("provider_list")["providers"]
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


class Status(Command):
    name = "status"
    help = "list the open layer's changes"
    examples = "  cowfs status\n  cowfs --json status | jq '.changes | length'"
    paths_after_dashdash = True  # (the rest of the line is parsed as usual)
    ops = ("status",)

    def add_options(self, s: argparse.ArgumentParser) -> None:
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

    def run(self, args: argparse.Namespace) -> int:
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
            res["changes"],
            args.all,
            args.limit,
            (lambda c: f"\t{format_who(c)}") if args.who else None,
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

    def tool(
        self,
        ws: Workspace,
        who: Annotated[bool, Arg("with the process that first made each change")] = False,
    ) -> dict:
        """What changed in the open layer (since the last checkpoint): each
        change's path and kind (A added, D deleted, M modified, T type changed,
        R renamed, m attributes only), the layer stack's size, and whether the
        last rollback can still be redone."""
        return clean(ws.call("status"), frozenset({"who"}) if who else frozenset())


class Gc(Command):
    name = "gc"
    help = (
        "free store space nothing needs (unused chunks, grave files no record holds); "
        "mounted or not"
    )
    examples = "  cowfs gc"
    ops = ("gc",)

    def add_options(self, s: argparse.ArgumentParser) -> None:
        pass

    def run(self, args: argparse.Namespace) -> int:
        res = call(args, "gc")
        out(
            args,
            f"freed {human_size(res['freed_bytes'])}: "
            + (", ".join(res["done"]) or "nothing to free"),
            res,
        )
        return 0


class Check(Command):
    name = "check"
    help = (
        "verify the store: chunk hashes, reference counts, records, layers, the grave "
        "(read-only; mounted or not)"
    )
    examples = "  cowfs check\n  cowfs check --repair"
    ops = ("check", "repair")

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "--repair",
            action="store_true",
            help="repair what can be repaired without inventing data (asks first)",
        )
        s.add_argument("--yes", action="store_true", help="with --repair: do not ask")

    def run(self, args: argparse.Namespace) -> int:
        """Exit 0 when the store is consistent, 6 when problems remain."""
        ws = client(args)
        with progress_shown(args, "check"):
            res = ws.check()
        lines = self.found(res)
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
                res = self.repair(args, ws, len(fixable))
                lines += self.repaired(res)
        out(args, "\n".join(lines), res)
        return 0 if res["ok"] else errors.STORE_ERROR

    @staticmethod
    def found(res: dict) -> list[str]:
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
        return lines

    @staticmethod
    def repair(args: argparse.Namespace, ws: Client, fixable: int) -> dict:
        if not args.yes:
            answer = ask(
                f"cowfs: repair {fixable} problem{'s' if fixable > 1 else ''}? [y/N] ",
                "yn",
                300,
            )
            if answer != "y":
                raise CowfsError(
                    "not repaired" + (" (no terminal: use --yes)" if answer is None else ""),
                    errors.STORE_ERROR,
                )
        with progress_shown(args, "repair"):
            return ws.check(repair=True)

    @staticmethod
    def repaired(res: dict) -> list[str]:
        lines = [f"repaired: {d}" for d in res["repaired"]]
        lines.append(
            "now "
            + ("consistent" if res["ok"] else f"{count(len(res['problems']), 'problem')} remain:")
        )
        return lines + [f"  {p['text']}" for p in res["problems"]]


class Doctor(Command):
    name = "doctor"
    help = "check FUSE, the daemon, the store and the providers"
    examples = "  cowfs doctor\n  cowfs doctor ~/project"

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument("target", nargs="?", metavar="PATH", help="a workspace (mounted or not)")
        s.add_argument(
            "--store", metavar="DIR", help="store of an unmounted workspace (default: PATH/.cowfs)"
        )

    def run(self, args: argparse.Namespace) -> int:
        from .doctor import report

        return report(args.target, args.json, store=args.store)


class Log(Command):
    name = "log"
    help = "list the layers, newest first, with their messages and runs"
    examples = "  cowfs log\n  cowfs log -n 5"
    ops = ("log",)

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "-n", type=parse_number, metavar="N", dest="max_count", help="only the N newest layers"
        )

    def run(self, args: argparse.Namespace) -> int:
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

    def tool(self, ws: Workspace) -> dict:
        """All layers, oldest first: id, creation time, message, number of
        changes and bytes of undo data, the runs recorded on it and, for
        layers an agent hook opened, the agent event (a conversation turn)."""
        return clean(ws.call("log"))


def agents_known() -> tuple[str, ...]:
    """The agent CLIs cowfs has hooks for (the agents module is loaded
    only by the commands that name them)."""
    from .agents import AGENTS

    return tuple(AGENTS)


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
            h.add_argument(
                "--json",
                action="store_true",
                default=argparse.SUPPRESS,
                help="machine-readable output",
            )
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
                )
                if res["changed"]
                else f"no cowfs hooks of {a.name} in {res['settings']}",
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
        command.add_options(s)
    return p
