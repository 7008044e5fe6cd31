"""The ``cowfs`` command: one entry point, one function per subcommand.

Exit codes are listed in ``errors`` and documented in README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time

from . import control, errors
from .errors import BadWorkspace, CowfsError
from .mounts import find_mount, is_cowfs_mount, pid_alive


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and the documented code, not a usage dump
        self.exit(errors.USAGE, f"cowfs: {message} (see 'cowfs --help')\n")


def parse_size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        n = int(t[:-1] if t and t[-1] in "KM" else t) * units[t[-1] if t and t[-1] in "KM" else ""]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if n < 4096 or n > (1 << 20) or n & (n - 1):
        raise argparse.ArgumentTypeError(f"chunk size must be a power of two from 4K to 1M: {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="cowfs", description="Make any directory undoable.")
    p.add_argument("-C", dest="path", default=".", metavar="PATH",
                   help="a path inside the workspace (default: the current directory)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=Parser)

    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help, description=help)
        s.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                       help="machine-readable output")
        return s

    s = cmd("mount", "mount WORKSPACE (over itself, or at MOUNTPOINT) and capture every change")
    s.add_argument("--store", metavar="DIR", help="layer store (default: WORKSPACE/.cowfs)")
    s.add_argument("--foreground", action="store_true", help="do not daemonise")
    s.add_argument("--chunk-size", type=parse_size, metavar="SIZE",
                   help="capture granularity for a new store (default 64K; a power of "
                        "two from 4K to 1M)")
    s.add_argument("workspace")
    s.add_argument("mountpoint", nargs="?")

    s = cmd("unmount", "flush and unmount a workspace")
    s.add_argument("--lazy", action="store_true", help="detach even while busy")
    s.add_argument("target", nargs="?", metavar="PATH")

    s = cmd("checkpoint", "open a new layer; print its id")
    s.add_argument("-m", "--message", default="")

    s = cmd("rollback", "undo the top layer (or every layer down to and including ID)")
    s.add_argument("--to", type=int, metavar="ID")

    cmd("commit", "merge the top layer into the one below (the base: make permanent)")
    cmd("status", "list the open layer's changes")
    cmd("log", "list all layers")
    return p


def out(args, human: str | None, data) -> None:
    if args.json:
        print(json.dumps(data))
    elif human:
        print(human)


# -- subcommands -----------------------------------------------------------------


def do_mount(args) -> int:
    from .daemon import check_fuse

    check_fuse()
    ws = os.path.abspath(args.workspace)
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

        return serve(ws, args.mountpoint, args.store, report, foreground=True,
                     chunk_size=args.chunk_size)
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "cowfs.daemon", "--ready-fd", str(w)]
    if args.store:
        cmd += ["--store", args.store]
    if args.chunk_size:
        cmd += ["--chunk-size", str(args.chunk_size)]
    cmd.append(ws)
    if args.mountpoint:
        cmd.append(os.path.abspath(args.mountpoint))
    proc = subprocess.Popen(cmd, pass_fds=(w,), start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    os.close(w)
    buf = b""
    deadline = time.monotonic() + 120
    while not buf.endswith(b"\n") and time.monotonic() < deadline:
        ready, _, _ = select.select([r], [], [], 0.5)
        if ready:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            buf += chunk
    os.close(r)
    if not buf:
        code = proc.poll()
        raise CowfsError(f"the cowfs daemon exited ({code}) without mounting {ws}",
                         errors.DAEMON_ERROR)
    msg = json.loads(buf)
    if not msg.get("ok"):
        proc.wait()
        raise errors.from_dict(msg)
    for warning in msg["warnings"]:
        print(f"cowfs: warning: {warning}", file=sys.stderr)
    out(args, f"mounted {msg['mountpoint']}", msg)
    return 0


def do_unmount(args) -> int:
    rec = find_mount(args.target or args.path)
    control.call(rec, "unmount", lazy=args.lazy)
    deadline = time.monotonic() + 60
    while pid_alive(rec.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    out(args, f"unmounted {rec.mountpoint}", {"unmounted": rec.mountpoint})
    return 0


def do_checkpoint(args) -> int:
    res = control.call(find_mount(args.path), "checkpoint", message=args.message)
    out(args, str(res["id"]), res)
    return 0


def do_rollback(args) -> int:
    res = control.call(find_mount(args.path), "rollback", to=args.to)
    dropped = ", ".join(map(str, res["dropped"]))
    out(args, f"rolled back layer{'s' if len(res['dropped']) > 1 else ''} {dropped} "
              f"({res['applied']} steps); open layer is {res['top']}", res)
    return 0


def do_commit(args) -> int:
    res = control.call(find_mount(args.path), "commit")
    if res["into"] is None:
        human = f"committed base layer {res['committed']}; its changes are permanent; " \
                f"open layer is {res['top']}"
    else:
        human = f"merged layer {res['committed']} into layer {res['into']}"
    out(args, human, res)
    return 0


def format_change(c: dict) -> str:
    if c["kind"] == "R":
        return f"R {c['from']} -> {c['path']}"
    return f"{c['kind']} {c['path']}"


def do_status(args) -> int:
    res = control.call(find_mount(args.path), "status")
    out(args, "\n".join(format_change(c) for c in res["changes"]) or None, res)
    return 0


def do_log(args) -> int:
    res = control.call(find_mount(args.path), "log")
    rows = [f"{'ID':>4}  {'CREATED':>10}  {'CHANGES':>7}  {'BYTES':>10}  MESSAGE"]
    for layer in res["layers"]:
        rows.append(f"{layer['id']:>4}  {int(layer['created']):>10}  {layer['changes']:>7}  "
                    f"{layer['bytes']:>10}  {layer['message']}")
    out(args, "\n".join(rows), res["layers"])
    return 0


COMMANDS = {
    "mount": do_mount, "unmount": do_unmount, "checkpoint": do_checkpoint,
    "rollback": do_rollback, "commit": do_commit, "status": do_status, "log": do_log,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
    except OSError as e:
        print(f"cowfs: {e.filename + ': ' if e.filename else ''}{e.strerror or e}",
              file=sys.stderr)
        return errors.DAEMON_ERROR


if __name__ == "__main__":
    sys.exit(main())
