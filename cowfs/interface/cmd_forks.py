"""The commands of forks: ``cowfs fork``, ``forks``, ``drop``, and the
global ``--fork NAME`` that points any other command at a fork (see
cowfs/service/forkops.py)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import time
from typing import TYPE_CHECKING, Annotated, Literal

from .. import errors
from ..errors import CowfsError
from ..system.mounts import find_mount
from ..text import ago, human_size, quote
from .client import Client
from .command import Arg, Command, out
from .render import clean

if TYPE_CHECKING:
    from .api import Workspace

CLONE_NEWNS = 0x00020000
MS_REC, MS_SLAVE, MS_BIND = 0x4000, 0x80000, 0x1000


class Fork(Command):
    name = "fork"
    help = (
        "make fork NAME of the workspace as it is now: a private copy at once, whatever "
        "its size, with layers of its own (the workspace gets a layer there)"
    )
    examples = (
        "  cowfs fork try-a -m 'upgrade the parser'\n"
        "  cowfs run --fork try-a -- make test\n"
        "  cowfs --fork try-a status"
    )
    ops = ("fork",)

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument("-m", "--message", default="", help="what the fork is for (forks shows it)")
        s.add_argument(
            "--at",
            metavar="DIR",
            help="also mount the fork at DIR (an empty directory outside the workspace)",
        )
        s.add_argument("name", metavar="NAME", help="the fork's name (letters, digits, . _ -)")

    def tool(
        self,
        ws: Workspace,
        name: Annotated[str, Arg("the fork's name: letters, digits, . _ -")],
        message: Annotated[str, Arg("what the fork is for")] = "",
    ) -> dict:
        """Make a fork of the workspace as it is now: a private copy made at
        once, whatever its size, with its own layers. Run commands in it
        with the run tool's `fork`; keep its changes with adopt, or drop it."""
        return clean(ws.call("fork", name=name, message=message))

    def run(self, args: argparse.Namespace) -> int:
        res = Client.attach(args.path).call(
            "fork",
            name=args.name,
            message=args.message,
            at=os.path.abspath(args.at) if args.at else None,
        )
        out(
            args,
            f"fork {args.name} made from layer {res['layer']}"
            + (f", mounted at {quote(res['at'])}" if args.at else "")
            + f" ('cowfs run --fork {args.name} -- CMD' works in it)",
            res,
        )
        return 0


class Forks(Command):
    name = "forks"
    help = "list the workspace's forks: fork point, message, disk space, processes using each"
    examples = "  cowfs forks\n  cowfs forks --json"
    ops = ("forks",)

    def tool(self, ws: Workspace) -> list:
        """The workspace's forks: name, the layer made for it, its message,
        how many paths it changed, the disk space it takes, processes using it."""
        return clean(ws.forks())

    def run(self, args: argparse.Namespace) -> int:
        ws = Client.find(args.path, args.offline_store)
        res = ws.call("forks", changes=True) if ws.mounted else ws.call("forks")
        rows = res["forks"]
        if args.json:
            out(args, None, rows)
            return 0
        if not rows:
            print("# no forks")
            return 0
        print(
            f"{'NAME':<16} {'LAYER':>5}  {'CREATED':<16} {'CHANGES':>7} {'SIZE':>9}  "
            f"{'USERS':<12} MESSAGE"
        )
        for r in rows:
            users = ",".join(map(str, r["users"][:3])) + ("…" if len(r["users"]) > 3 else "")
            state = (
                ""
                if r["mounted"]
                else f" [{r['state'] if r['state'] != 'live' else 'not mounted'}]"
            )
            print(
                f"{r['name']:<16} {r['layer']:>5}  {ago(r['created'], time.time()):<16} "
                f"{r.get('changes', '-'):>7} {human_size(r['bytes']):>9}  {users or '-':<12} "
                f"{r['message']}{state}"
            )
        return 0


class Drop(Command):
    name = "drop"
    help = "unmount fork NAME and free everything it holds (refused while processes use it)"
    examples = "  cowfs drop try-a\n  cowfs drop --force try-b   # its processes lose it"
    ops = ("drop",)

    def tool(
        self,
        ws: Workspace,
        name: Annotated[str, Arg("the fork")],
        force: Annotated[bool, Arg("even while processes use it")] = False,
    ) -> dict:
        """Drop a fork: unmount it and free everything it holds."""
        return clean(ws.drop(name, force=force))

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "--force",
            action="store_true",
            help="drop it even while processes use it (they lose it)",
        )
        s.add_argument("name", metavar="NAME", help="the fork")

    def run(self, args: argparse.Namespace) -> int:
        res = Client.find(args.path, args.offline_store).call(
            "drop", name=args.name, force=args.force
        )
        out(args, f"dropped fork {args.name}", res)
        return 0


class Adopt(Command):
    name = "adopt"
    help = (
        "make fork NAME's changes since its fork point in the workspace, as one new layer, "
        "and drop the fork (paths both changed: refused unless --prefer says whose to keep)"
    )
    examples = (
        "  cowfs adopt try-a\n"
        "  cowfs adopt --prefer fork try-a\n"
        "  cowfs adopt --prefer parent --prefer src/app.py=fork try-a"
    )
    ops = ("adopt",)

    def tool(
        self,
        ws: Workspace,
        name: Annotated[str, Arg("the fork")],
        prefer: Annotated[
            Literal["fork", "parent"] | None,
            Arg("for paths both changed: keep the fork's change or the workspace's"),
        ] = None,
        paths: Annotated[
            dict[str, Literal["fork", "parent"]],
            Arg("per path (from the workspace's root): whose change to keep"),
        ] = {},  # noqa: B006  (never changed: the tool's schema is its signature)
    ) -> dict:
        """Adopt a fork: make its changes since it was made in the workspace,
        as one new layer (a rollback undoes it), and drop it. Paths changed
        both in the fork and in the workspace are conflicts: without
        `prefer` or `paths` deciding each, nothing changes and the error
        lists them."""
        return clean(ws.adopt(name, prefer=prefer, paths=paths))

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "--prefer",
            action="append",
            default=[],
            metavar="fork|parent|PATH=fork|parent",
            help="for paths both changed: keep the fork's change or the workspace's, "
            "for all of them or for PATH (from the workspace's root); repeatable",
        )
        s.add_argument(
            "--force",
            action="store_true",
            help="adopt even while processes use the fork (they lose it)",
        )
        s.add_argument("name", metavar="NAME", help="the fork")

    def run(self, args: argparse.Namespace) -> int:
        prefer, paths = None, {}
        for choice in args.prefer:
            path, eq, side = choice.rpartition("=")
            if side not in ("fork", "parent"):
                raise CowfsError(
                    f"--prefer {choice!r}: say fork or parent (or PATH=fork|parent)", errors.USAGE
                )
            if eq:
                paths[path.strip("/")] = side
            else:
                prefer = side
        try:
            res = Client.attach(args.path).call(
                "adopt", name=args.name, prefer=prefer, paths=paths, force=args.force
            )
        except CowfsError as e:
            if e.code == errors.CONFLICT and not args.json:
                for c in e.details.get("conflicts", []):
                    print(f"C {quote(c['path'])}\tfork: {c['fork']}\tworkspace: {c['parent']}")
            raise
        changed = len(res["changed"])
        out(
            args,
            f"adopted fork {args.name} as layer {res['layer']} ({changed} path"
            f"{'' if changed == 1 else 's'}; 'cowfs rollback --to {res['layer']}' undoes it)",
            res,
        )
        return 0


class BestOf(Command):
    name = "best-of"
    help = (
        "run each command in a fork of its own, at once; adopt the first that succeeds "
        "(and passes --verify) and drop the others"
    )
    examples = (
        "  cowfs best-of --verify 'pytest -q' -- ./fix-a.sh ::: ./fix-b.sh ::: ./fix-c.sh\n"
        "  cowfs best-of --parallel 2 -- make CC=gcc ::: make CC=clang"
    )
    ops = ("fork", "adopt", "drop")

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument("--verify", metavar="CMD", help="a shell command each must pass too")
        s.add_argument("--parallel", type=int, metavar="N", help="at most N at once (default: all)")
        s.add_argument(
            "--timeout", type=float, metavar="SECONDS", help="a command still running is killed"
        )
        s.add_argument(
            "--prefer",
            choices=("fork", "parent"),
            help="paths the workspace changed meanwhile too: whose change to keep",
        )
        s.add_argument(
            "argv",
            nargs=argparse.REMAINDER,
            metavar="-- CMD [ARG...] ::: CMD [ARG...] ...",
            help="the commands, separated by ::: (one argument each: a shell command line)",
        )

    def run(self, args: argparse.Namespace) -> int:
        from .api import Workspace

        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        commands: list[list[str]] = [[]]
        for token in argv:
            if token == ":::":
                commands.append([])
            else:
                commands[-1].append(token)
        if not all(commands):
            raise CowfsError("best-of takes -- CMD ::: CMD ...: a command is empty", errors.USAGE)
        cmds = [c[0] if len(c) == 1 else c for c in commands]
        ws = Workspace.attach(args.path)
        res = ws.best_of(
            cmds,
            verify=args.verify,
            parallel=args.parallel,
            timeout=args.timeout,
            prefer=args.prefer,
        )
        rows = []
        for c in res.candidates:
            r = c.result
            how = (
                "ok"
                if r.ok
                else (
                    f"failed (exit {r.exit_status})"
                    if r.exit_status
                    else f"failed (the verifier exited {r.verify_status})"
                )
            )
            rows.append(
                f"{'*' if c.index == res.winner else ' '} {c.index + 1} {how:<24} "
                f"{len(r.changes):>6} change{'' if len(r.changes) == 1 else 's'}  {c.command}"
            )
        if res.winner is None:
            rows.append("# no command succeeded: nothing adopted, every fork dropped")
        else:
            rows.append(
                f"# adopted command {res.winner + 1} as layer {res.layer} "
                f"('cowfs rollback --to {res.layer}' undoes it); the other forks dropped"
            )
        out(
            args,
            "\n".join(rows),
            {
                "winner": res.winner,
                "layer": res.layer,
                "candidates": [
                    {
                        "index": c.index,
                        "command": c.command,
                        "fork": c.fork,
                        "ok": c.result.ok,
                        "exit_status": c.result.exit_status,
                        "verify_status": c.result.verify_status,
                        "changes": [x.to_dict() for x in c.result.changes],
                        "stdout": c.result.stdout,
                        "stderr": c.result.stderr,
                    }
                    for c in res.candidates
                ],
            },
        )
        return 0 if res.winner is not None else errors.NOTHING_TO_DO


FORK_COMMANDS = ("fork", "forks", "drop", "adopt", "best-of")


def enter_fork(args: argparse.Namespace) -> None:
    """``--fork NAME``: the command works on fork NAME of the workspace of
    -C PATH: -C becomes the same path in the fork (root: the fork is
    mounted where only root reaches it)."""
    name = args.fork
    rows = Client.attach(args.path).call("forks", brief=True)["forks"]
    row = next((r for r in rows if r["name"] == name), None)
    if row is None:
        known = ", ".join(r["name"] for r in rows) or "no forks"
        raise CowfsError(f"no fork {name} ({known})", errors.UNKNOWN_LAYER)
    if not row["mounted"]:
        raise CowfsError(f"fork {name} is not mounted ({row['state']})", errors.NOT_MOUNTED)
    root = os.path.realpath(find_mount(args.path).mountpoint)
    here = os.path.realpath(args.path)
    rel = os.path.relpath(here, root) if here == root or here.startswith(root + "/") else "."
    target = os.path.normpath(os.path.join(row["path"], rel))
    args.path = target if os.path.exists(target) else row["path"]
    args.fork_root, args.fork_of = row["path"], root


_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        e = ctypes.get_errno()
        raise CowfsError(f"{what}: {os.strerror(e)}", errors.DAEMON_ERROR)


def private_namespace(fork_root: str, workspace: str) -> None:
    """This process moves to a mount namespace of its own in which
    *workspace* shows the fork mounted at *fork_root* (root only); the
    current directory, if it was inside the workspace, is the same path
    in the fork."""
    if os.geteuid() != 0:
        raise CowfsError(
            "run --fork needs root for now (a mount namespace); as another user, "
            "use the fork's own path: cowfs forks --json",
            errors.USAGE,
        )
    cwd = os.getcwd()
    _check(_libc.unshare(CLONE_NEWNS), "unshare")
    _check(_libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None), "making / a slave mount")
    _check(
        _libc.mount(os.fsencode(fork_root), os.fsencode(workspace), None, MS_BIND, None),
        f"binding the fork over {workspace}",
    )
    with contextlib.suppress(OSError):
        os.chdir(cwd)  # (the same path, now in the fork)
