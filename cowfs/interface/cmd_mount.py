"""The commands that mount and unmount workspaces and views: mount, unmount, view."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

from .. import errors
from ..errors import BadWorkspace, CowfsError
from ..system.mounts import (
    VIEW_FSTYPE,
    callers_inside,
    check_answering,
    find_mount,
    is_cowfs_mount,
    mount_table,
    processes,
)
from .client import Client
from .command import Command, call, out, parse_count, parse_limit, parse_size


def allow_spec(spec: str) -> str:
    """--allow: checked here (an unknown user is a usage error before any
    mount), resolved again by the daemon."""
    from ..system.access import BadGrant, parse_grant

    if spec:
        try:
            parse_grant(spec)
        except BadGrant as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def mount_options(args: argparse.Namespace) -> dict[str, Any]:
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
    if mount_table().get(path) != VIEW_FSTYPE:
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


class Mount(Command):
    name = "mount"
    help = "mount WORKSPACE (over itself, or at MOUNTPOINT) and capture every change"
    examples = (
        "  cowfs mount ~/project\n  cowfs mount --max-store 2G --ignore 'node_modules/.cache/' ."
    )

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "--store",
            metavar="DIR",
            help="layer store, on the workspace's filesystem (default: WORKSPACE/.cowfs)",
        )
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
        from ..service.daemon import check_fuse
        from ..service.launch import spawn

        check_fuse()
        ws = os.path.abspath(args.workspace)
        check_answering(ws)  # (a mount whose daemon is stopped would hang isdir)
        if not os.path.isdir(ws) and not is_cowfs_mount(ws):  # a dead mount is recovered
            raise BadWorkspace(f"workspace {args.workspace} does not exist or is not a directory")
        if args.foreground:
            from ..service.daemon import serve

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
        s.add_argument(
            "--lazy",
            action="store_true",
            help="detach even while busy, naming the processes still using it; the "
            "daemon serves them and exits when the last one leaves",
        )
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
        rec = find_mount(args.target or args.path)
        try:
            users = Client(rec).unmount(lazy=args.lazy)
        except CowfsError as e:
            # busy: say so plainly when it is this command, or a shell it
            # descends from, that is in it (asked once the daemon took the
            # request: whoever may not unmount is told that first)
            inside = (
                callers_inside(rec.mountpoint)
                if e.code == errors.ALREADY_MOUNTED and not args.lazy
                else []
            )
            if not inside:
                raise
            shells = [pid for pid in inside if pid != os.getpid()]
            raise errors.AlreadyMounted(
                f"you are inside the workspace {rec.mountpoint}: cd out of it first"
                + (
                    f" ({processes(shells)} {'has its' if len(shells) == 1 else 'have their'} "
                    "working directory there)"
                    if shells
                    else ""
                )
            ) from None
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
