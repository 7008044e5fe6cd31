"""The frame of every command: the declaration a command is (``Command``:
its options, its help and examples, its handler, the operations it sends
and how MCP exposes it), the argument types, and what the handlers share --
the client glue (offline fallback, progress, Ctrl-C), output, questions on
the terminal, and paths relative to the current directory.

Every command starts by importing this module: it must stay cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Annotated, Any, ClassVar, Literal, NoReturn, get_args

from .. import errors
from ..errors import CowfsError, NotMounted
from ..service import control, operations
from ..system.mounts import find_mount, locate
from ..text import count, duration, json_text, quote
from .client import Client

# = policy.RunScope (the policy is loaded by the commands that use it: every
# command starts by importing this module, and it must stay cheap)
RunScope = Literal["auto", "files", "container", "vm"]
RUN_SCOPES = get_args(RunScope)


class Parser(argparse.ArgumentParser):
    json_errors = False  # --json was given: usage errors too are JSON on stdout

    def error(self, message: str) -> NoReturn:  # one line and the documented code, not a usage dump
        if Parser.json_errors:
            print(json_text({"error": message, "code": errors.USAGE}))
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


def workspace_option(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "-C",
        dest="path",
        default=argparse.SUPPRESS,
        metavar="PATH",
        help="a path inside the workspace (as the global -C)",
    )


def json_option(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )


ROOT_HELP = (
    "print paths relative to the workspace's root (default: to the current directory "
    "when it is inside the workspace, as git status does; --json always names them "
    "from the root)"
)


def root_option(s: argparse.ArgumentParser) -> None:
    s.add_argument("--root", action="store_true", default=argparse.SUPPRESS, help=ROOT_HELP)


class Arg:
    """How an MCP tool's argument is described (the tool's method
    annotates it with ``Annotated[type, Arg(...)]``); the MCP server turns
    it into the SDK's ``Field`` (pydantic is loaded only there)."""

    def __init__(self, description: str | None = None, **constraints: Any):
        self.description = description
        self.constraints = constraints


# the MCP tools' common arguments
Layer = Annotated[int | None, Arg("a layer id (from checkpoint or log)")]
PathsBytes = Annotated[
    list[str],
    Arg(
        "more paths, each as the base64 of its bytes: for a name that is not UTF-8 "
        "(a change's path_bytes)"
    ),
]
Limit = Annotated[int, Arg("most bytes of text to return; the rest is cut", ge=256, le=4 << 20)]


class Command:
    """One command, declared once: ``cowfs NAME`` with the options
    ``add_options`` adds, carried out by ``run``; *ops*: the control
    operations it sends (see ``operations``: which work offline, which
    cannot stop half-way); a ``tool`` method (its docstring the
    description, its parameters the arguments) exposes it to MCP as the
    tool *name*, ``tool_text`` saying its result to the model."""

    name: ClassVar[str]
    help: ClassVar[str]
    examples: ClassVar[str] = ""
    ops: ClassVar[tuple[str, ...]] = ()
    paths_after_dashdash: ClassVar[bool] = False  # PATHs may follow "--" (see cli.parse)
    prints_paths: ClassVar[bool] = False  # names workspace paths for people (takes --root)
    tool: ClassVar[Callable[..., Any] | None] = None

    def add_options(self, s: argparse.ArgumentParser) -> None:
        """The command's options and arguments."""

    def run(self, args: argparse.Namespace) -> int:
        raise NotImplementedError

    def tool_text(self, result: Any) -> str:
        from .render import as_text

        return as_text(result)

    @classmethod
    def offline(cls) -> bool:
        """Whether it works on a workspace that is not mounted."""
        return bool(cls.ops) and all(op in operations.OFFLINE_OPS for op in cls.ops)


def out(args: argparse.Namespace, human: str | None, data: object) -> None:
    if args.json:
        print(json_text(data))
    elif human:
        print(human)


def client(args: argparse.Namespace) -> Client:
    """The workspace of -C PATH (and --store), mounted or not."""
    return Client.find(args.path, args.offline_store)


def call(args: argparse.Namespace, op: str, **kw: Any) -> dict:
    """Ask the daemon of the workspace at -C PATH; when it is not mounted
    (and for the operations that work offline), operate on its store
    directly.  An operation that changes the tree or the store cannot stop
    half-way: a first Ctrl-C says so and waits for it, a second stops
    waiting (the daemon finishes it; offline, the next command on the
    workspace does)."""
    ws = client(args)
    what = operations.LONG_OPS.get(op)
    if not ws.mounted:
        if op not in operations.OFFLINE_OPS:
            return ws.call(op, **kw)  # (raises NotMounted)
        with (
            finishing(what, "the next cowfs command on this workspace finishes it"),
            progress_shown(args, op, ws.progress()),
        ):
            result = ws.call(op, **kw)
        for warning in result["warnings"]:
            print(f"cowfs: warning: {warning}", file=sys.stderr)
        return result
    if what is None:
        return ws.call(op, **kw)
    said: list[bool] = []

    def waiting() -> None:
        said.append(True)
        print(
            f"cowfs: the {what} goes on in the daemon (it cannot stop half-way); waiting "
            "for it to finish -- Ctrl-C again to stop waiting",
            file=sys.stderr,
        )

    try:
        with progress_shown(args, op, ws.progress()):
            return ws.call(op, on_interrupt=waiting, **kw)
    except KeyboardInterrupt:
        if not said:
            raise
        raise CowfsError(
            f"stopped waiting; the {what} goes on in the daemon ('cowfs status' "
            "shows the workspace once it is done)",
            errors.INTERRUPTED,
        ) from None


PROGRESS_DELAY = 0.5  # seconds an operation runs before its progress shows


@contextlib.contextmanager
def progress_shown(
    args: argparse.Namespace, op: str, board: Callable[[], tuple[int, int] | None] | None = None
) -> Iterator[None]:
    """While long operation *op* runs (in the daemon or here): on a
    terminal, and never with --json, a spinner on stderr with the time
    elapsed and, where *board* tells it, the steps done -- from
    PROGRESS_DELAY seconds on ($COWFS_PROGRESS_DELAY), so quick ones show
    nothing and pay nothing (not even the import of rich).  With no delay,
    it shows before the operation starts."""
    if op not in operations.DOING or args.json or not sys.stderr.isatty():
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
        return f"cowfs: {operations.DOING[op]} ({duration(time.monotonic() - t0)}{steps})"

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

    def interrupted(signum: int, frame: types.FrameType | None) -> None:
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


def times(args: argparse.Namespace) -> dict:
    """The request's "times" argument for --times (none without it: a
    daemon of an older cowfs takes no such argument)."""
    return {"times": True} if getattr(args, "times", False) else {}


def workspace_paths(args: argparse.Namespace, paths: list[str]) -> list[str]:
    """PATHs as the workspace names them (relative to its root, "." for the
    root), from paths relative to the current directory when it is inside
    the workspace (as git takes pathspecs), to the root otherwise, or
    absolute; a path outside the workspace is an error naming it."""
    if not paths:
        return []
    root = workspace_root(args)
    here = cwd_in(root)
    out = []
    for p in paths:
        full = p if os.path.isabs(p) else os.path.join(root, here or "", p)
        head, tail = os.path.split(os.path.normpath(full))
        full = os.path.join(os.path.realpath(head), tail) if tail else os.path.realpath(head)
        if full == root:
            out.append(".")
        elif full.startswith(root.rstrip("/") + "/"):
            out.append(os.path.relpath(full, root))
        else:
            raise CowfsError(f"{quote(p)}: outside the workspace {quote(root)}", errors.USAGE)
    return out


def cwd_in(root: str) -> str | None:
    """The current directory as a path of the workspace at *root* (its
    real path): "" for the root itself; None when it is outside (or
    gone)."""
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:
        return None
    if cwd == root:
        return ""
    if cwd.startswith(root.rstrip("/") + "/"):
        return os.path.relpath(cwd, root)
    return None


def seen_from(args: argparse.Namespace, root: str | None = None) -> str:
    """The directory that workspace paths printed for people are relative
    to (a workspace path; "" the root): the current directory when it is
    inside the workspace (that of -C PATH, or *root*), as git status names
    paths; the root with --root, or when it is outside.  (JSON names them
    from the root always.)"""
    if getattr(args, "root", False):
        return ""
    if root is None:
        try:
            root = workspace_root(args)
        except (CowfsError, OSError):
            return ""
    return cwd_in(os.path.realpath(root)) or ""


def workspace_root(args: argparse.Namespace) -> str:
    """Where the workspace of -C PATH is, as programs see it: its mount, or
    the directory itself when it is not mounted."""
    try:
        return os.path.realpath(find_mount(args.path).mountpoint)
    except NotMounted:
        if args.offline_store:
            return os.path.realpath(args.path)
        return os.path.realpath(locate(args.path).unmounted(args.path)[0])


def given_paths(paths: list[str], paths_bytes: list[str]) -> list[str]:
    """*paths* and the paths in *paths_bytes* (base64 of their bytes: an MCP
    tool's arguments), as the workspace's names (os.fsdecode's)."""
    import base64
    import binascii

    try:
        raw = [base64.b64decode(p, validate=True) for p in paths_bytes]
    except (binascii.Error, ValueError):
        raise CowfsError("paths_bytes holds base64 strings", errors.USAGE) from None
    return [*paths, *map(os.fsdecode, raw)]


def command_argv(args: argparse.Namespace) -> list[str]:
    cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not cmd:
        raise CowfsError(f"{args.command} needs a command after --", errors.USAGE)
    return cmd
