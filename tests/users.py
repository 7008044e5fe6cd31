"""Running test code as another user: in a child forked from the test
process and switched to that user.  The interpreter of the test run may
live where other users cannot read it (a root's pyenv), so the child runs
the code already loaded here rather than a new interpreter."""

from __future__ import annotations

import io
import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

from cowfs.interface import cli


def become(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    os.environ.pop("XDG_RUNTIME_DIR", None)
    os.environ["HOME"] = "/"


def run_as(uid: int, gid: int, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a forked child running as *uid*/*gid*: its result (which
    must pickle); its exception becomes an AssertionError here."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.close(r)
            become(uid, gid)
            try:
                result: Any = ("ok", fn(*args))
            except BaseException as e:
                result = ("error", f"{type(e).__name__}: {e}")
            os.write(w, pickle.dumps(result))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        buf = f.read()
    os.waitpid(child, 0)
    kind, value = pickle.loads(buf)
    if kind == "error":
        raise AssertionError(f"as uid {uid}: {value}")
    return value


def cowfs_as(uid: int, gid: int, cwd: str | os.PathLike, args: list[str]) -> tuple[int, str, str]:
    """The cowfs command's main() run by *uid* in *cwd*: (exit code, stdout, stderr)."""

    def main() -> tuple[int, str, str]:
        os.chdir(cwd)
        out, err = io.StringIO(), io.StringIO()
        sys.stdout, sys.stderr = out, err
        try:
            code = cli.main(args)
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        return code, out.getvalue(), err.getvalue()

    return run_as(uid, gid, main)
