"""How far a rollback has got, for the progress the `cowfs` command shows on
a terminal while it waits.

The operation notes its steps on a ``Board``: the daemon's board writes them
into a small file beside its control socket (at most ten times a second,
so the rollback does not slow down), which the command reads while it
waits for the answer; on an unmounted workspace the operation runs in the
command itself, on the in-memory board ``LOCAL``.
"""

from __future__ import annotations

import os
import struct
import time

FORMAT = struct.Struct("<QQ")  # steps done, steps in all (0: nothing under way)
INTERVAL = 0.1  # seconds between writes of the file


class Board:
    def __init__(self, path: str | None = None):
        self.path = path
        self.done = self.total = 0
        self._due = 0.0
        self.fd: int | None = None
        if path is not None:
            self.fd = os.open(
                path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
            self._write()

    def start(self, total: int) -> None:
        self.done, self.total, self._due = 0, total, 0.0
        self._write()

    def step(self, n: int = 1) -> None:
        self.done += n
        if self.fd is not None:
            now = time.monotonic()
            if now >= self._due:
                self._due = now + INTERVAL
                self._write()

    def end(self) -> None:
        self.done = self.total = 0
        self._write()

    def read(self) -> tuple[int, int] | None:
        """(done, total) of the operation under way, if any."""
        if self.path is not None:
            return read(self.path)
        return (self.done, self.total) if self.total else None

    def close(self) -> None:
        if self.fd is not None and self.path is not None:  # (an fd only with a path)
            os.close(self.fd)
            self.fd = None
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _write(self) -> None:
        if self.fd is not None:
            try:
                os.pwrite(self.fd, FORMAT.pack(self.done, self.total), 0)
            except OSError:
                pass  # (only a display depends on it)


LOCAL = Board()


def path_for(socket: str) -> str:
    """The board file of the daemon listening on *socket*."""
    return os.path.splitext(socket)[0] + ".progress"


def read(path: str) -> tuple[int, int] | None:
    """(done, total) from the board file at *path*, while an operation is
    under way."""
    try:
        with open(path, "rb") as f:
            data = f.read(FORMAT.size)
    except OSError:
        return None
    if len(data) < FORMAT.size:
        return None
    done, total = FORMAT.unpack(data)
    return (done, total) if total else None
