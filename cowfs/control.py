"""The control channel: one JSON request line, one JSON response line, over
the daemon's Unix socket (in a 0700 runtime directory; the daemon also checks
SO_PEERCRED and serves only the user who mounted, and root).  Both sides:
the client (``call``) and the server loop (``serve``) with its request
parsing and argument checking."""

from __future__ import annotations

import itertools
import json
import os
import select
import socket
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

from . import errors
from .access import Requester
from .listing import Encoded
from .mounts import MountRecord, not_owner

MAX_REQUEST = 1 << 20


def encode(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"


# An answer is sent in pieces of about this many bytes, and a list in it
# encoded this many items at a time: a status of 200,000 changes is never
# held as one string (nor twice, as text and as bytes).
PIECE_BYTES = 1 << 16
PIECE_ITEMS = 512


def encode_pieces(obj: dict) -> Iterator[bytes]:
    """``encode(obj)`` in pieces of about PIECE_BYTES."""
    held: list[str] = []
    size = 0
    for text in _pieces(obj):
        held.append(text)
        size += len(text)
        if size >= PIECE_BYTES:
            yield "".join(held).encode()
            held, size = [], 0
    held.append("\n")
    yield "".join(held).encode()


def _pieces(obj: Any) -> Iterator[str]:
    dumps = json.dumps
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        yield "{"
        for i, (k, v) in enumerate(obj.items()):
            yield (", " if i else "") + dumps(k) + ": "
            yield from _pieces(v)
        yield "}"
    elif isinstance(obj, list) or (
        isinstance(obj, Sequence) and not isinstance(obj, (str, bytes, tuple))
    ):
        # (a list, or one made as it is read: listing.Changes; its items
        # may be JSON text already: listing.Encoded)
        items = iter(obj)
        sep = "["
        while batch := list(itertools.islice(items, PIECE_ITEMS)):
            if any(type(x) is Encoded for x in batch):
                yield sep + ", ".join(x if type(x) is Encoded else dumps(x) for x in batch)
            else:
                yield sep + dumps(batch)[1:-1]
            sep = ", "
        yield "[]" if sep == "[" else "]"
    else:
        yield dumps(obj)


def wait_readable(fd: int, timeout: float) -> bool:
    """Whether *fd* is readable (or hung up) within *timeout* seconds.
    poll(2): unlike select(2), it takes descriptors of any number (a
    daemon holding thousands of files hands out high ones)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout) * 1000))


def call(
    rec: MountRecord,
    op: str,
    timeout: float | None = 600.0,
    on_interrupt: Callable[[], None] | None = None,
    **args,
) -> dict:
    """Send one request to the daemon of *rec*; return its result or raise
    the CowfsError it answered with.  *on_interrupt*: a first Ctrl-C once
    the request is sent calls it and goes on waiting for the answer (the
    daemon carries the operation out anyway); a second one is raised."""
    request = encode({"op": op, **args})
    if len(request) > MAX_REQUEST:
        raise errors.CowfsError(
            f"the {op} request is too large ({len(request):,} bytes; the daemon takes at most "
            f"{MAX_REQUEST:,}): shorten what it carries (a message, a record, paths)",
            errors.USAGE,
        )
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(rec.socket)  # blocking: waits while the daemon's backlog is full
        s.settimeout(timeout)
    except OSError as e:
        raise errors.CowfsError(
            f"cannot reach the cowfs daemon of {rec.mountpoint}: {e.strerror or e}",
            errors.DAEMON_ERROR,
        ) from None
    with s:
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # (refused before it read the request: its answer is there to read)
        buf = bytearray()
        while not buf.endswith(b"\n"):
            try:
                chunk = s.recv(65536)
            except KeyboardInterrupt:
                if on_interrupt is None:
                    raise
                then, on_interrupt = on_interrupt, None
                then()
                continue
            if not chunk:
                break
            buf += chunk
    if not buf:
        raise errors.CowfsError(
            f"the cowfs daemon of {rec.mountpoint} closed the connection without answering",
            errors.DAEMON_ERROR,
        )
    resp = json.loads(buf)
    if not resp.get("ok"):
        raise errors.from_dict(resp)
    return resp.get("result") or {}


# -- the server side ------------------------------------------------------------------


class BadRequest(Exception):
    pass


def check_args(op: Callable, args: dict) -> None:
    """Arguments must be the op's parameters, of their annotated types
    (bool is not an int here; None only where allowed)."""
    import inspect
    import typing

    params = inspect.signature(op).parameters
    hints = typing.get_type_hints(op)
    for name, value in args.items():
        if name not in params:
            raise BadRequest(f"unknown argument {name!r}")
        allowed = typing.get_args(hints[name]) or (hints[name],)
        ok = any(
            value is None
            if t is type(None)
            else isinstance(value, t) and not (t is int and isinstance(value, bool))
            for t in allowed
        )
        if not ok:
            raise BadRequest(f"argument {name!r} has the wrong type")
    for name, p in params.items():
        if p.default is inspect.Parameter.empty and name not in args:
            raise BadRequest(f"missing argument {name!r}")


class Host(Protocol):
    """What the server loop serves: the operations of a daemon."""

    owner: int  # the uid served (besides root)
    mountpoint: str
    inflight: int  # requests being answered (an unmount's answer goes out before exit)

    def operation(self, name: str) -> Callable:
        """The operation called *name* (KeyError: no such operation)."""
        ...

    def permits_any(self, who: Requester) -> bool:
        """Whether *who* (not the owner, not root) may ask for anything."""
        ...

    def permits(self, who: Requester, name: str) -> None:
        """*who* may ask for *name* (NotOwner, with why, otherwise)."""
        ...

    def run_request(self, name: str, op: Callable, args: dict, who: Requester) -> Awaitable[dict]:
        """Carry out a checked request for *who*; its result (errors are
        raised)."""
        ...

    def unanswered(self, name: str, result: dict) -> Awaitable[None]:
        """The client left before the answer of a successful *name* reached it."""
        ...


async def serve(path: str, host: Host, mode: int = 0o600, task_status: Any = None) -> None:
    """Serve control requests on a Unix socket at *path* until cancelled;
    *task_status* is told once it listens.  *mode* 0600: only the owner
    (and root) can connect; 0666 for a workspace that grants other users
    operations (each request is checked against the peer's credentials)."""
    import logging

    import trio

    log = logging.getLogger("cowfs.control")  # (here: the client starts without logging)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(path)
    os.chmod(path, mode)
    sock.listen(socket.SOMAXCONN)
    listener = trio.SocketListener(sock)
    if task_status is not None:
        task_status.started()

    async def connection(stream: trio.SocketStream) -> None:
        """Serve one request; nothing a client sends may escape this (an
        exception here would stop the daemon and its mount)."""
        try:
            await _serve_one(stream, host, log)
        except Exception:
            log.exception("control connection failed")

    await trio.serve_listeners(connection, [listener])


async def _serve_one(stream: Any, host: Host, log: Any) -> None:
    import trio

    async with stream:
        who = Requester.of_peer(stream.socket)
        if who.uid not in (0, host.owner) and not host.permits_any(who):
            e = not_owner(f"the cowfs workspace mounted at {host.mountpoint}", host.owner)
            await stream.send_all(encode({"ok": False, **e.to_dict()}))
            return
        buf = bytearray()
        with trio.move_on_after(30):
            while b"\n" not in buf and len(buf) <= MAX_REQUEST:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                buf += chunk
        if b"\n" not in buf:
            if len(buf) > MAX_REQUEST:
                await stream.send_all(
                    encode(
                        {
                            "ok": False,
                            "code": errors.USAGE,
                            "error": f"bad request: larger than {MAX_REQUEST:,} bytes",
                        }
                    )
                )
            return
        try:
            req = json.loads(buf[: buf.index(b"\n")])
            name = req.pop("op")
            op = host.operation(name)
            check_args(op, req)
            host.permits(who, name)
        except errors.CowfsError as e:
            await stream.send_all(encode({"ok": False, **e.to_dict()}))
            return
        except BadRequest as e:
            await stream.send_all(
                encode({"ok": False, "code": errors.USAGE, "error": f"bad request: {e}"})
            )
            return
        except Exception:  # not JSON, not an object, no such op, too deep, ...
            await stream.send_all(
                encode({"ok": False, "code": errors.USAGE, "error": "malformed request"})
            )
            return
        host.inflight += 1  # until answered: an unmount's answer goes out before we exit
        try:
            resp: dict[str, Any]
            try:
                resp = {"ok": True, "result": await host.run_request(name, op, req, who)}
            except errors.CowfsError as e:
                resp = {"ok": False, **e.to_dict()}
            except Exception as e:
                log.exception("control request failed")
                resp = {"ok": False, "code": errors.DAEMON_ERROR, "error": str(e)}
            try:
                for piece in encode_pieces(resp):
                    await stream.send_all(piece)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                if resp["ok"]:
                    await host.unanswered(name, resp["result"])
        finally:
            host.inflight -= 1
