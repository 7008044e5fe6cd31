"""Errors that reach the user, each with its documented exit code."""

from __future__ import annotations

from collections.abc import Callable

from .text import quote

# Exit codes (documented in README.md, "Exit codes").
OK = 0
NOTHING_TO_DO = 1
USAGE = 2
NOT_MOUNTED = 3
UNKNOWN_LAYER = 4
NO_STORE = 4  # an offline command on a path with no store (none is ever made for it)
ALREADY_MOUNTED = 5
NOT_ANSWERING = 5  # busy: the daemon sent no sign of life within the deadline (stopped?)
STORE_ERROR = 6
BAD_WORKSPACE = 7
NO_FUSE = 8
DAEMON_ERROR = 9
PARTIAL = 10
DRIFT = 11
REFUSED = 12
NOT_OWNER = 13
CONFIRM = 14
CONFLICT = 15
INTERRUPTED = 130


class CowfsError(Exception):
    """An error with a one-line message and an exit code; *path*: the
    workspace path (from the workspace's root, "." the root) it is about,
    which begins the message, quoted ("PATH: no such path, ...") -- lines
    for people name it from the current directory (``shown``)."""

    code = DAEMON_ERROR

    def __init__(self, message: str, code: int | None = None, path: str | None = None):
        self.path = path
        self.detail = message
        self.details: dict = {}  # (more of it, for programs: say the conflicts of an adopt)
        super().__init__(message if path is None else f"{quote(path)}: {message}")
        if code is not None:
            self.code = code

    def shown(self, name: Callable[[str], str]) -> str:
        """The message, with its path as *name* gives it."""
        return str(self) if self.path is None else f"{quote(name(self.path))}: {self.detail}"

    def to_dict(self) -> dict:
        return (
            {"error": str(self), "code": self.code}
            | ({"path": self.path} if self.path is not None else {})
            | self.details
        )


class NothingToDo(CowfsError):
    code = NOTHING_TO_DO


class NotMounted(CowfsError):
    code = NOT_MOUNTED


class UnknownLayer(CowfsError):
    code = UNKNOWN_LAYER


class NoStore(NotMounted):
    """An offline command on a path that is in no workspace with a store
    (or a --store DIR that is none): nothing is created for it."""

    code = NO_STORE


class AlreadyMounted(CowfsError):
    code = ALREADY_MOUNTED


class NotAnswering(CowfsError):
    """The daemon of a mount sent nothing within the deadline (it is
    stopped, or hangs): *pid* and *mountpoint* name it."""

    code = NOT_ANSWERING

    def __init__(self, message: str, pid: int, mountpoint: str):
        super().__init__(message)
        self.pid = pid
        self.mountpoint = mountpoint

    def to_dict(self) -> dict:
        return {**super().to_dict(), "pid": self.pid, "mountpoint": self.mountpoint}


class StoreError(CowfsError):
    code = STORE_ERROR


class BadWorkspace(CowfsError):
    code = BAD_WORKSPACE


class NoFuse(CowfsError):
    code = NO_FUSE


class PartialFailure(CowfsError):
    code = PARTIAL


class Drift(CowfsError):
    code = DRIFT


class Refused(CowfsError):
    """A redo that cannot undo the last rollback exactly (changed since)."""

    code = REFUSED


class PlantedLink(CowfsError):
    """A symlink on a path a user named that another user may have put there."""

    code = USAGE


class NotOwner(CowfsError):
    """The workspace was mounted (or its store made) by another user."""

    code = NOT_OWNER


class NeedsConfirmation(CowfsError):
    """A plain rollback of the base layer (everything since the workspace
    was mounted or last committed), asked for without --yes."""

    code = CONFIRM


def from_dict(d: dict) -> CowfsError:
    message, code = d.get("error", "unknown error"), int(d.get("code", DAEMON_ERROR))
    if code == NOT_ANSWERING and isinstance(d.get("pid"), int):  # (a new daemon's report)
        return NotAnswering(message, d["pid"], str(d.get("mountpoint", "")))
    path = d.get("path")
    if isinstance(path, str) and message.startswith(f"{quote(path)}: "):
        err = CowfsError(message[len(quote(path)) + 2 :], code, path)
    else:
        err = CowfsError(message, code)
    err.details = {k: v for k, v in d.items() if k not in ("ok", "error", "code", "path")}
    return err
