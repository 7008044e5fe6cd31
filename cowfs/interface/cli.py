"""The ``cowfs`` command: one entry point; the commands are declared in
``commands`` (one class each), their frame in ``command``.

Exit codes are listed in ``errors`` and documented in README.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import errors
from ..errors import CowfsError
from ..text import json_text, printable, quote, relative
from .cmd_forks import FORK_COMMANDS, enter_fork
from .command import (  # (the argument types, for their users)
    Parser,
    layer_id,
    parse_bytes,
    parse_count,
    parse_limit,
    parse_number,
    parse_size,
    seen_from,
)
from .commands import COMMANDS, build_parser

__all__ = [
    "build_parser",
    "layer_id",
    "main",
    "parse_bytes",
    "parse_count",
    "parse_limit",
    "parse_number",
    "parse_size",
]


def command_of(argv: list[str]) -> str | None:
    """The subcommand named in *argv* (skipping the global options)."""
    tokens = iter(argv)
    for token in tokens:
        if token in ("-C", "--store", "--fork"):
            next(tokens, None)
        elif not token.startswith("-"):
            return token
    return None


def parse(argv: list[str]) -> argparse.Namespace:
    head = argv[: argv.index("--")] if "--" in argv else argv
    Parser.json_errors = "--json" in head
    command = command_of(head)
    parser = build_parser(only=command if command in COMMANDS else None)
    if command in COMMANDS and COMMANDS[command].paths_after_dashdash and "--" in argv:
        args = parser.parse_args(head)
        args.paths = args.paths + argv[len(head) + 1 :]
        return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        if isinstance(getattr(args, "fork", None), list):  # (diff's --fork, repeatable)
            if len(args.fork) > 2:
                why = "diff compares at most two forks (--fork A --fork B)"
                raise CowfsError(why, errors.USAGE)
            args.fork_pair = args.fork if len(args.fork) == 2 else None
            args.fork = None if args.fork_pair else args.fork[0]
        if getattr(args, "fork", None):
            if args.command in FORK_COMMANDS:
                # (a fork's forks are not made yet: it would be the workspace's)
                raise CowfsError(
                    f"--fork does not apply to 'cowfs {args.command}': "
                    "it works on the workspace's own forks",
                    errors.USAGE,
                )
            enter_fork(args)
        return COMMANDS[args.command].run(args)
    except CowfsError as e:
        if args.json:
            print(json_text(e.to_dict()))
        base = seen_from(args) if e.path is not None else ""
        # (a name the message holds unquoted reaches the terminal escaped all the same)
        message = "\n".join(map(printable, e.shown(lambda p: relative(p, base)).split("\n")))
        print(f"cowfs: {message}", file=sys.stderr)
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
