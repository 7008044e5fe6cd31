"""The control channel: one JSON request line, one JSON response line, over
the daemon's Unix socket (in a 0700 runtime directory; the daemon also checks
SO_PEERCRED and serves only the user who mounted, and root).  Both sides:
the client (``call``) and the server loop (``serve``) with its request
parsing and argument checking.

Deadlines: until a request is answered the daemon sends its client a space
every BEAT seconds (JSON takes whitespace before a value), from a thread
of its own that also accepts the connections -- whatever holds the daemon's
trio loop meanwhile (a long rollback runs there synchronously), so a daemon
that is busy is never taken for a dead one.  The client gives up on a
daemon it hears nothing from for its deadline ($COWFS_DEADLINE, DEADLINE
seconds): NotAnswering, exit 5, naming its pid.  A long operation may take
as long as it takes."""

from __future__ import annotations

import itertools
import json
import math
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

from .. import errors
from ..layers.listing import Encoded
from ..system.access import Requester
from ..system.deadlines import DEADLINE, deadline  # noqa: F401  (the client's deadline)
from ..system.mounts import MountRecord, not_answering, not_owner

MAX_REQUEST = 1 << 20
MAX_CONNECTIONS = 32  # control connections open at once per user (not root)
BEAT = 0.5  # seconds between the signs of life a daemon sends a waiting client


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
    timeout: float | None = None,
    on_interrupt: Callable[[], None] | None = None,
    **args: object,
) -> dict:
    """Send one request to the daemon of *rec*; return its result or raise
    the CowfsError it answered with.  A daemon that sends nothing for the
    deadline (see the module) is NotAnswering; *timeout*: at most that
    many seconds in all, however alive it is (NotAnswering too).
    *on_interrupt*: a first Ctrl-C once the request is sent calls it and
    goes on waiting for the answer (the daemon carries the operation out
    anyway); a second one is raised."""
    request = encode({"op": op, **args})
    if len(request) > MAX_REQUEST:
        raise errors.CowfsError(
            f"the {op} request is too large ({len(request):,} bytes; the daemon takes at most "
            f"{MAX_REQUEST:,}): shorten what it carries (a message, a record, paths)",
            errors.USAGE,
        )
    wait = deadline()
    with _connect(rec, wait if timeout is None else min(wait, timeout)) as s:
        buf = _exchange(s, request, rec, op, wait, timeout, on_interrupt)
    if not buf.strip():
        raise errors.CowfsError(
            f"the cowfs daemon of {rec.mountpoint} closed the connection without answering",
            errors.DAEMON_ERROR,
        )
    resp = json.loads(buf)
    if not resp.get("ok"):
        raise errors.from_dict(resp)
    return resp.get("result") or {}


def _connect(rec: MountRecord, wait: float) -> socket.socket:
    """A connection to the daemon of *rec*.  connect(2) waits while the
    socket's listen queue is full (a stopped daemon accepts nothing); at
    most *wait* seconds (SO_SNDTIMEO bounds that wait: EAGAIN after it)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        # (a zero timeval would mean no limit)
        sec, usec = divmod(max(1, round(wait * 1_000_000)), 1_000_000)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, usec))
        s.connect(rec.socket)
        s.setblocking(False)
    except BlockingIOError:
        s.close()
        raise not_answering(rec, wait, f"its listen queue stayed full for {wait:g} s") from None
    except OSError as e:
        s.close()
        raise errors.CowfsError(
            f"cannot reach the cowfs daemon of {rec.mountpoint}: {e.strerror or e}",
            errors.DAEMON_ERROR,
        ) from None
    except BaseException:
        s.close()
        raise
    return s


def _exchange(
    s: socket.socket,
    request: bytes,
    rec: MountRecord,
    op: str,
    wait: float,
    timeout: float | None,
    on_interrupt: Callable[[], None] | None,
) -> bytearray:
    """Send *request* on *s* and read the answer (with the spaces before
    it): each thing the daemon sends gives it *wait* seconds more, up to
    *timeout* seconds in all."""
    out = memoryview(request)
    buf = bytearray()
    heard = time.monotonic()  # (the connection is the first sign of life)
    end = math.inf if timeout is None else heard + timeout
    poller = select.poll()
    fd = s.fileno()
    poller.register(fd, select.POLLIN | select.POLLOUT)
    while True:
        now = time.monotonic()
        limit = min(heard + wait, end)
        try:
            ready = poller.poll(max(0.0, limit - now) * 1000)
        except KeyboardInterrupt:
            if on_interrupt is None or out:
                raise
            then, on_interrupt = on_interrupt, None
            then()
            continue
        if not ready:
            if timeout is not None and time.monotonic() < heard + wait:  # (alive, past *end*)
                raise not_answering(rec, timeout, f"it is busy: no answer to the {op} yet")
            raise not_answering(rec, wait)
        events = ready[0][1]
        if out and events & (select.POLLOUT | select.POLLERR | select.POLLHUP):
            try:
                out = out[s.send(out[: 1 << 16]) :]
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                out = out[:0]  # (refused before it read the request: its answer is there)
            if not out:
                poller.modify(fd, select.POLLIN)
        if events & (select.POLLIN | select.POLLERR | select.POLLHUP):
            try:
                chunk = s.recv(1 << 16)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return buf
            buf += chunk
            heard = time.monotonic()
            if b"\n" in chunk:  # (the answer is the one line; signs of life are spaces)
                return buf


# -- the server side ------------------------------------------------------------------


class BadRequest(Exception):
    pass


class Gone(Exception):
    """The client left before its request was started: it is not carried
    out (a client that gave up on a stopped daemon was told it does not
    answer, and must not find the request done once the daemon goes on)."""


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

    def run_request(
        self, name: str, op: Callable, args: dict, who: Requester, gone: Callable[[], bool]
    ) -> Awaitable[dict]:
        """Carry out a checked request for *who*; its result (errors are
        raised).  Gone, without starting it, if *gone*() says the client
        has left by the time it would start."""
        ...

    def unanswered(self, name: str, result: dict) -> Awaitable[None]:
        """The client left before the answer of a successful *name* reached it."""
        ...


class Doorman:
    """The daemon's side of the deadlines (see the module): a thread that
    accepts each connection, hands it to the trio loop (*handoff*, from
    this thread), and, once the client has sent something (its request,
    read or not), sends it a space every BEAT seconds until it is answered
    (``quiet``).  A client that sends nothing is told nothing."""

    def __init__(self, listener: socket.socket, handoff: Callable[[socket.socket], None]):
        self.listener = listener
        self.handoff = handoff
        # -> when it last heard from us, and whether its request was read
        self.waiting: dict[socket.socket, tuple[float, bool]] = {}
        self.lock = threading.Lock()  # (held while a sign of life is sent)
        self.wake_r, self.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="control-doorman", daemon=True)
        # connections open, by the user on the other end (root's uncounted)
        self.open: dict[socket.socket, int] = {}
        self.per_user: dict[int, int] = {}

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        os.write(self.wake_w, b"x")
        self.thread.join()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def asked(self, conn: socket.socket) -> None:
        """The request on *conn* is read: it waits for its answer."""
        with self.lock:
            if conn in self.waiting:
                self.waiting[conn] = (self.waiting[conn][0], True)

    def quiet(self, conn: socket.socket) -> None:
        """No more signs of life on *conn* (its answer is sent next)."""
        with self.lock:
            self.waiting.pop(conn, None)

    def _run(self) -> None:
        import logging

        poller = select.poll()
        poller.register(self.listener, select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        while not self.stopping:
            try:
                with self.lock:
                    due = min((t for t, _ in self.waiting.values()), default=math.inf) + BEAT
                wait = -1 if due == math.inf else max(0.0, due - time.monotonic()) * 1000
                if any(fd == self.listener.fileno() for fd, _ in poller.poll(wait)):
                    self._accept()
                self._beat()
            except Exception:  # (without this thread nobody gets in)
                logging.getLogger("cowfs.control").exception("control doorman")
                time.sleep(0.1)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return
            except (ConnectionAbortedError, InterruptedError):
                continue
            except OSError:  # out of descriptors or memory: a moment later
                time.sleep(0.1)
                return
            if not self._admit(conn):
                continue
            with self.lock:
                self.waiting[conn] = (time.monotonic(), False)
            try:
                self.handoff(conn)
            except Exception:  # (the loop has ended)
                self.done(conn)
                conn.close()

    def _admit(self, conn: socket.socket) -> bool:
        """Count *conn* against the user on the other end; a user other than
        root who has MAX_CONNECTIONS open already is answered an error at
        once and let go (a user holding connections open -- each may take
        up to the time a request has to arrive -- must not take the
        daemon's descriptors from everyone else)."""
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            uid = struct.unpack("3i", creds)[1]
        except OSError:
            conn.close()
            return False
        if uid != 0:
            with self.lock:
                if self.per_user.get(uid, 0) >= MAX_CONNECTIONS:
                    refused = True
                else:
                    refused = False
                    self.per_user[uid] = self.per_user.get(uid, 0) + 1
                    self.open[conn] = uid
            if refused:
                answer = {
                    "ok": False,
                    "code": errors.NOT_ANSWERING,
                    "error": f"user {uid} has {MAX_CONNECTIONS} requests open to this "
                    "workspace's daemon already: wait for their answers",
                }
                try:
                    conn.send(encode(answer), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                except OSError:
                    pass
                conn.close()
                return False
        return True

    def done(self, conn: socket.socket) -> None:
        """*conn* is over (answered or not): it counts no more."""
        with self.lock:
            self.waiting.pop(conn, None)
            uid = self.open.pop(conn, None)
            if uid is not None:
                left = self.per_user[uid] - 1
                if left:
                    self.per_user[uid] = left
                else:
                    del self.per_user[uid]

    def _beat(self) -> None:
        now = time.monotonic()
        with self.lock:
            for conn, (last, asked) in self.waiting.items():
                if now - last < BEAT:
                    continue
                self.waiting[conn] = (now, asked)
                try:
                    # (a request not read yet waits in the socket)
                    if asked or conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                        # (one byte: sent whole or not at all)
                        conn.send(b" ", socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                except OSError:
                    pass  # (nothing sent, not reading, or gone: its handler finds out)


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
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.bind(path)
        os.chmod(path, mode)
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
        async with trio.open_nursery() as nursery:
            token = trio.lowlevel.current_trio_token()

            async def connection(conn: socket.socket) -> None:
                """Serve one request; nothing a client sends may escape this
                (an exception here would stop the daemon and its mount)."""
                try:
                    stream = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
                    await _serve_one(
                        stream, host, log, lambda: doorman.asked(conn), lambda: doorman.quiet(conn)
                    )
                except Exception:
                    log.exception("control connection failed")
                finally:
                    doorman.done(conn)
                    conn.close()

            def start(conn: socket.socket) -> None:
                try:
                    nursery.start_soon(connection, conn)
                except RuntimeError:  # (the nursery is closing)
                    doorman.done(conn)
                    conn.close()

            doorman = Doorman(sock, lambda conn: token.run_sync_soon(start, conn))
            doorman.start()
            if task_status is not None:
                task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                doorman.stop()


async def _serve_one(
    stream: Any, host: Host, log: Any, asked: Callable[[], None], quiet: Callable[[], None]
) -> None:
    """Serve the request on *stream*; *asked* says it is read, *quiet*
    stops the signs of life before anything is sent."""
    import trio

    async def send(answer: dict) -> None:
        quiet()
        for piece in encode_pieces(answer):
            await stream.send_all(piece)

    def gone() -> bool:
        """Whether the client has closed its end."""
        poller = select.poll()
        poller.register(stream.socket.fileno(), select.POLLIN)
        return any(ev & select.POLLHUP for _, ev in poller.poll(0))

    async with stream:
        who = Requester.of_peer(stream.socket)
        if who.uid not in (0, host.owner) and not host.permits_any(who):
            e = not_owner(f"the cowfs workspace mounted at {host.mountpoint}", host.owner)
            await send({"ok": False, **e.to_dict()})
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
                await send(
                    {
                        "ok": False,
                        "code": errors.USAGE,
                        "error": f"bad request: larger than {MAX_REQUEST:,} bytes",
                    }
                )
            return
        asked()
        try:
            req = json.loads(buf[: buf.index(b"\n")])
            name = req.pop("op")
            op = host.operation(name)
            check_args(op, req)
            host.permits(who, name)
        except errors.CowfsError as e:
            await send({"ok": False, **e.to_dict()})
            return
        except BadRequest as e:
            await send({"ok": False, "code": errors.USAGE, "error": f"bad request: {e}"})
            return
        except Exception:  # not JSON, not an object, no such op, too deep, ...
            await send({"ok": False, "code": errors.USAGE, "error": "malformed request"})
            return
        host.inflight += 1  # until answered: an unmount's answer goes out before we exit
        try:
            resp: dict[str, Any]
            try:
                resp = {"ok": True, "result": await host.run_request(name, op, req, who, gone)}
            except Gone:
                log.info("%s not carried out: its client left before it started", name)
                return
            except errors.CowfsError as e:
                resp = {"ok": False, **e.to_dict()}
            except Exception as e:
                log.exception("control request failed")
                resp = {"ok": False, "code": errors.DAEMON_ERROR, "error": str(e)}
            try:
                await send(resp)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                if resp["ok"]:
                    await host.unanswered(name, resp["result"])
        finally:
            host.inflight -= 1
