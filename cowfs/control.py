"""The control channel: one JSON request line, one JSON response line, over
the daemon's Unix socket (in a 0700 runtime directory; the daemon also checks
SO_PEERCRED and serves only the user who mounted, and root)."""

from __future__ import annotations

import json
import select
import socket
from collections.abc import Callable

from . import errors
from .mounts import MountRecord

MAX_REQUEST = 1 << 20


def encode(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def wait_readable(fd: int, timeout: float) -> bool:
    """Whether *fd* is readable (or hung up) within *timeout* seconds.
    poll(2): unlike select(2), it takes descriptors of any number (a
    daemon holding thousands of files hands out high ones)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout) * 1000))


def call(rec: MountRecord, op: str, timeout: float | None = 600.0,
         on_interrupt: Callable[[], None] | None = None, **args) -> dict:
    """Send one request to the daemon of *rec*; return its result or raise
    the CowfsError it answered with.  *on_interrupt*: a first Ctrl-C once
    the request is sent calls it and goes on waiting for the answer (the
    daemon carries the operation out anyway); a second one is raised."""
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(rec.socket)  # blocking: waits while the daemon's backlog is full
        s.settimeout(timeout)
    except OSError as e:
        raise errors.CowfsError(f"cannot reach the cowfs daemon of {rec.mountpoint}: "
                                f"{e.strerror or e}", errors.DAEMON_ERROR) from None
    with s:
        s.sendall(encode({"op": op, **args}))
        buf = bytearray()
        while not buf.endswith(b"\n"):
            try:
                chunk = s.recv(65536)
            except KeyboardInterrupt:
                if on_interrupt is None:
                    raise
                on_interrupt, then = None, on_interrupt
                then()
                continue
            if not chunk:
                break
            buf += chunk
    if not buf:
        raise errors.CowfsError(f"the cowfs daemon of {rec.mountpoint} closed the "
                                "connection without answering", errors.DAEMON_ERROR)
    resp = json.loads(buf)
    if not resp.get("ok"):
        raise errors.from_dict(resp)
    return resp.get("result") or {}
