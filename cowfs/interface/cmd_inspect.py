"""The commands that look at a workspace and its past, changing nothing:
status, log, diff, show, audit."""

from __future__ import annotations

import argparse
import base64
import sys
import time
from typing import TYPE_CHECKING, Annotated, Any

from .. import errors
from ..errors import CowfsError
from ..layers import listing
from ..text import (
    ago,
    count,
    duration,
    first_line,
    human_size,
    json_text,
    printable,
    quote,
    relative,
)
from .command import (
    Arg,
    Command,
    Layer,
    Limit,
    PathsBytes,
    call,
    given_paths,
    layer_id,
    out,
    parse_number,
    seen_from,
    times,
    workspace_paths,
)
from .render import (
    TEXT_LIMIT,
    agent_lines,
    change_lines,
    clean,
    cut,
    diff_rows,
    format_event,
    format_who,
    redo_line,
    times_line,
    utf8,
)

if TYPE_CHECKING:
    from .api import Workspace

# what every answer for people says of a workspace that is not mounted (its
# store read directly): what was written there since is in no layer
NOT_MOUNTED = "not mounted — changes since the last unmount are not captured"


def offline_note(res: dict) -> list[str]:
    """The comment line status and log begin with when the workspace is not
    mounted (their JSON says "mounted": false)."""
    return [f"# {NOT_MOUNTED}"] if res.get("mounted") is False else []


def warn_offline(args: argparse.Namespace, res: dict) -> None:
    """The same on stderr, for what prints contents (diff, show)."""
    if res.get("mounted") is False and not args.json:
        print(f"cowfs: warning: {NOT_MOUNTED}", file=sys.stderr)


class Status(Command):
    name = "status"
    help = "list the open layer's changes"
    examples = "  cowfs status\n  cowfs --json status | jq '.changes | length'"
    paths_after_dashdash = True  # (the rest of the line is parsed as usual)
    prints_paths = True
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
            "--times",
            action="store_true",
            help="also list the paths whose modification time alone differs (kind t; "
            "left out by default and counted: a tree made again as it was is no change)",
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
        res = call(args, "status", **({"paths": paths} if paths else {}), **times(args))
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
        base = seen_from(args)
        lines = offline_note(res) + [f"# {listing.headline(res['counts'])}", *times_line(res)]
        if paths and not res["changes"]:  # (a path that names nothing is an error)
            under = ", ".join(quote(relative(p, base)) for p in paths)
            lines = offline_note(res) + [f"# no changes under {under}", *times_line(res)]
        lines += change_lines(
            res["changes"],
            args.all,
            args.limit,
            (lambda c: f"\t{format_who(c)}") if args.who else None,
            base=base,
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
                + (f": {quote(relative(refused['path'], base))}" if refused.get("path") else "")
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


class Log(Command):
    name = "log"
    help = "list the layers, newest first, with their messages and runs"
    examples = "  cowfs log\n  cowfs log -n 5"
    prints_paths = True
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
        base = seen_from(args) if any(layer.get("drift") for layer in res["layers"]) else ""
        rows = offline_note(res)
        rows.append(f"  {'ID':>4}  {'CREATED':<16}  {'CHANGES':>7}  {'SIZE':>10}  MESSAGE")
        below = " " * 47  # (lines under a layer start at its MESSAGE)
        for layer in reversed(res["layers"]):
            rows.append(
                f"{'*' if layer['id'] == top else ' '} {layer['id']:>4}  "
                f"{ago(layer['created'], now):<16}  {layer['changes']:>7,}  "
                f"{human_size(layer['bytes']):>10}  {first_line(layer['message'])}"
            )
            rows += [below + line for line in agent_lines(layer)]
            for d in layer.get("drift", []):
                rows.append(
                    f"{below}drift accepted at mount ({count(len(d['paths']), 'path')} changed "
                    f"while not mounted): "
                    + ", ".join(quote(relative(p, base)) for p in d["paths"][:5])
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


class Diff(Command):
    name = "diff"
    help = (
        "changes since layer ID was opened (default: the open layer), with their content: "
        "unified diff for text (up to 8 MiB a file; --text: 64 MiB), sizes and xxh3 for "
        "binary, a symlink's target"
    )
    examples = (
        "  cowfs diff --stat\n  cowfs diff 2 --name-status -- src/\n  cowfs diff --text -- big.log"
    )
    paths_after_dashdash = True  # (the rest of the line is parsed as usual)
    prints_paths = True
    ops = ("diff", "changes")

    def add_options(self, s: argparse.ArgumentParser) -> None:
        fmt = s.add_mutually_exclusive_group()
        fmt.add_argument("--stat", action="store_true", help="lines added and removed per file")
        fmt.add_argument("--name-status", action="store_true", help="kind and path per change")
        s.add_argument(
            "--text",
            action="store_true",
            help="diff text files larger than 8 MiB too, up to 64 MiB (larger ones, and "
            "files that are not text, are still shown by size and hash)",
        )
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
            "--times",
            action="store_true",
            help="also list the paths whose modification time alone differs (kind t; "
            "left out by default and counted: a tree made again as it was is no change)",
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
        if getattr(args, "fork_pair", None):
            return self.fork_compare(args)
        if getattr(args, "fork", None) and args.layer is None:
            return self.fork_changes(args)
        layer, paths = args.layer, workspace_paths(args, args.paths)
        base = "" if args.json else seen_from(args)
        if args.name_status and not args.json:  # (kinds and paths: no contents to read)
            res = call(
                args, "changes", since=layer, **({"paths": paths} if paths else {}), **times(args)
            )
            rows = change_lines(
                res["changes"],
                args.all,
                suffix=(lambda c: f"\t{format_who(c)}") if args.who else None,
                line=lambda c: listing.line(c).replace(" ", "\t", 1),
                base=base,
            )
            warn_offline(args, res)
            out(args, "\n".join(rows + times_line(res)) or None, res)
            return 0
        limit = {}
        if args.text:
            from ..service.session import MAX_TEXT

            limit["text_limit"] = MAX_TEXT
        res = call(args, "diff", since=layer, paths=paths, **limit, **times(args))
        rows = diff_rows(res["changes"], args.name_status, args.stat, args.who, base)
        warn_offline(args, res)
        large = sum(1 for c in res["changes"] if c.get("text_limit"))
        if large and not args.text and not args.json:
            print(
                f"cowfs: {count(large, 'text file')} too large to diff: cowfs diff --text "
                "diffs text files up to 64 MiB",
                file=sys.stderr,
            )
        out(args, "\n".join(rows + times_line(res)) or None, res)
        return 0

    @staticmethod
    def fork_changes(args: argparse.Namespace) -> int:
        """``diff --fork NAME`` without a layer: what the fork changed since
        its fork point (ignored paths too), a path a line."""
        from .client import Client

        res = Client.attach(args.fork_of).call("fork_changes", name=args.fork)
        shown = [c for c in res["changes"] if args.times or c["kind"] != "t"]
        times_only = len(res["changes"]) - len(shown)
        res["times_only"] = times_only
        rows = [f"{c['kind']}\t{quote(c['path'])}" for c in shown]
        if not rows:
            rows = [f"# fork {args.fork} has no changes since its fork point"]
        out(args, "\n".join(rows + times_line(res)), res)
        return 0

    @staticmethod
    def fork_compare(args: argparse.Namespace) -> int:
        """``diff --fork A --fork B``: how fork B differs from fork A as they
        are now, a path a line."""
        from .client import Client

        if args.layer is not None or args.paths:
            raise CowfsError(
                "diff --fork A --fork B compares the two forks whole: no layer or paths",
                errors.USAGE,
            )
        a, b = args.fork_pair
        res = Client.attach(args.path).call("fork_compare", a=a, b=b)
        shown = [c for c in res["changes"] if args.times or c["kind"] != "t"]
        res["times_only"] = len(res["changes"]) - len(shown)
        rows = [f"{c['kind']}\t{quote(c['path'])}" for c in shown]
        if not rows:
            rows = [f"# forks {a} and {b} hold the same"]
        out(args, "\n".join(rows + times_line(res)), res)
        return 0

    # (B006: the default list is never changed; the tool's schema is its signature)
    def tool(
        self,
        ws: Workspace,
        layer: Layer = None,
        paths: Annotated[list[str], Arg("only these paths (relative to the workspace root)")] = [],  # noqa: B006
        paths_bytes: PathsBytes = [],  # noqa: B006
        stat: Annotated[bool, Arg("lines added and removed per file instead of the diff")] = False,
        name_status: Annotated[bool, Arg("only the kind and path of each change")] = False,
        max_bytes: Limit = TEXT_LIMIT,
    ) -> dict:
        """Changes since a layer was opened (default: the open layer, i.e. since
        the last checkpoint) with their content: a unified diff for text files,
        sizes and hashes for binary ones. Large output is cut at max_bytes:
        narrow it with paths, or use stat or name_status."""
        res = ws.call("diff", since=layer, paths=given_paths(paths, paths_bytes))
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
        warn_offline(args, res)
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
                    print(json_text(e))
                else:
                    print(format_event(e))
            after = events[-1]["n"]
            if args.since is not None:
                args.since = None  # the rest follows in order
