"""`cowfs mcp`: one workspace's operations as tools for any agent that
speaks the Model Context Protocol, over stdio, on the official ``mcp`` SDK
(an optional dependency: ``pip install 'cowfs[mcp]'``; only this module
imports it).

The tools are derived from the commands' declarations (``commands.TOOLS``:
a command's ``tool`` method is its tool, its docstring the description, its
parameters the arguments).  Every tool talks to the workspace's daemon
through the Python API's ``Workspace`` (never the cowfs command); a failure
comes back as a tool error carrying the cowfs message and exit code, and
the server goes on.  The
stdio transport is this module's own (``run_stdio``): it answers a line that
is no message to serve with its JSON-RPC error, where the SDK's drops it.
"""

import fcntl
import functools
import inspect
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Any, BinaryIO, get_args, get_origin

from .. import __version__, errors
from ..errors import CowfsError
from ..service import control
from ..system.mounts import find_mount
from ..text import lossless, quote
from .api import Workspace
from .command import Arg, Command

INSTRUCTIONS = """\
cowfs makes the workspace at {root} undoable: every change any program makes \
there is captured in layers. Take a checkpoint before risky work, look at what \
changed (status, diff), and roll back to undo it exactly, or commit to keep it. \
run executes a command as its own step: rolled back if it (or its verify \
command) fails. Layer ids come from checkpoint and log."""


def failure(message: str, code: int) -> Any:
    """A tool error for the model: one line with the cowfs message and
    exit code, and both in its structured content."""
    from mcp_types import CallToolResult, TextContent

    return CallToolResult(
        content=[TextContent(type="text", text=f"cowfs: {message} (exit code {code})")],
        structured_content={"error": message, "code": code},
        is_error=True,
    )


def argument_error(tool: str, args: dict[str, Any], error: Any) -> str:
    """What was wrong with the arguments *args* of a call of *tool* that
    pydantic refused (*error*, its ValidationError), in a line: each
    argument named, with what it should be and what it was."""
    wanted: dict[str, list[str]] = {}  # argument -> what it should be (the alternatives)
    other: dict[str, list[str]] = {}  # argument -> pydantic's other words
    for err in error.errors(include_url=False):
        name = str(err["loc"][0]) if err["loc"] else ""
        msg = " ".join(str(err["msg"]).split())
        if err["type"] == "missing":
            other.setdefault(name, []).append("required")
        elif msg.startswith("Input should be "):  # "... a valid integer, unable to parse ..."
            kind = msg.removeprefix("Input should be ").split(", ")[0]
            if kind not in wanted.setdefault(name, []):
                wanted[name].append(kind)
        else:
            other.setdefault(name, []).append(msg[:1].lower() + msg[1:])
    parts = []
    for name in dict.fromkeys([*wanted, *other]):
        given = json.dumps(args.get(name), default=str)
        given = given if len(given) <= 60 else given[:57] + "..."
        if other.get(name) == ["required"]:
            parts.append(f"argument {name} is required")
        elif name in wanted:
            parts.append(f"argument {name} should be {' or '.join(wanted[name])}, not {given}")
        else:
            parts.append(f"argument {name}: {'; '.join(other[name])} (given {given})")
    return f"{tool}: " + "; ".join(parts)


def answer(root: str, work: Callable[[Workspace], Any], text: Callable[[Any], str]) -> Any:
    """Run *work* on the workspace at *root* (attached afresh: the mount
    may have come and gone); a CowfsError becomes a tool error with its
    code."""
    from mcp_types import CallToolResult, TextContent

    try:
        result = lossless(work(Workspace.attach(root)))  # (names not UTF-8: KEY_bytes)
        return CallToolResult(
            content=[TextContent(type="text", text=text(result))],
            structured_content=result if isinstance(result, dict) else {"result": result},
        )
    except CowfsError as e:
        code, message = e.code, str(e)
    except OSError as e:
        code = errors.DAEMON_ERROR
        message = (f"{os.fsdecode(e.filename)}: " if e.filename else "") + (e.strerror or str(e))
    except Exception as e:  # a bug: still one line for the model to read
        code, message = errors.DAEMON_ERROR, f"internal error: {type(e).__name__}: {e}"
    return failure(message, code)


def arguments(command: Command) -> list[inspect.Parameter]:
    """The arguments of *command*'s tool as the SDK reads them: the
    parameters of its ``tool`` method after the workspace, each ``Arg``
    turned into a pydantic ``Field``."""
    from pydantic import Field

    assert command.tool is not None
    fn = command.tool
    params = list(inspect.signature(fn).parameters.values())[1:]  # (after ws)
    out = []
    for p in params:
        hint = eval(p.annotation, fn.__globals__) if isinstance(p.annotation, str) else p.annotation
        if get_origin(hint) is Annotated:
            base, *meta = get_args(hint)
            meta = [
                Field(description=m.description, **m.constraints) if isinstance(m, Arg) else m
                for m in meta
            ]
            hint = Annotated[(base, *meta)] if meta else base
        out.append(p.replace(annotation=hint))
    return out


def tool_function(root: str, command: Command) -> Callable[..., Any]:
    """What the SDK calls for *command*'s tool: its description the tool
    method's docstring, its schema the arguments' (parameters with an
    alias, ``from``, reach the method under their Python names)."""
    from mcp_types import CallToolResult

    tool = command.tool
    assert tool is not None
    params = arguments(command)
    names = {
        m.alias: p.name
        for p in params
        for m in getattr(p.annotation, "__metadata__", ())
        if getattr(m, "alias", None)
    }

    @functools.wraps(tool)
    def call(**kw: Any) -> Any:
        args = {names.get(k, k): v for k, v in kw.items()}
        return answer(root, lambda ws: tool(ws, **args), command.tool_text)

    call.__name__ = call.__qualname__ = command.name
    call.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # (what the SDK reads)
        params, return_annotation=CallToolResult
    )
    return call


def build(root: str, tools: Sequence[Command]) -> Any:
    """The MCP server for the workspace mounted at *root*: a tool for each
    of the commands *tools* (see commands.TOOLS)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from pydantic import ValidationError

    class Server(MCPServer):
        async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
            """(Arguments of the wrong type or shape are said in a line, as
            cowfs's usage errors are: the SDK passed pydantic's report on.)"""
            try:
                return await super().call_tool(name, arguments, context)
            except ToolError as e:
                if not isinstance(e.__cause__, ValidationError):
                    raise
                return failure(argument_error(name, arguments, e.__cause__), errors.USAGE)

    server = Server("cowfs", version=__version__, instructions=INSTRUCTIONS.format(root=root))
    for command in tools:
        fn = tool_function(root, command)
        # (the docstring without its indentation: clients show it as it is)
        server.add_tool(fn, name=command.name, description=inspect.cleandoc(fn.__doc__ or ""))
    return server


# The stdio transport.  The SDK's own (mcp.server.stdio) hands a line that is
# no JSON-RPC message to the session as an exception, which logs and drops it
# (the client waits for an answer for ever), reads a line of any length, and
# dies when an answer cannot be written.  This one answers every line as
# JSON-RPC 2.0 says and goes on serving the lines that follow.

MAX_LINE = control.MAX_REQUEST  # bytes one message line may have, without its newline: 1 MiB
MAX_DEPTH = 100  # levels of arrays and objects one message may nest
SURROGATE = re.compile("[\ud800-\udfff]")  # (what json.loads leaves unpaired)


class Refused(Exception):
    """A line that is no message to serve; its JSON-RPC error code, and the
    request's id where it has one (None: the answer's id is null)."""

    def __init__(self, code: int, message: str, rid: int | str | None = None):
        super().__init__(message)
        self.code, self.rid = code, rid


def levels(obj: Any) -> Iterator[list]:
    """The values in the parsed JSON *obj*, keys included, level by level:
    [obj], then what is in it, then what is in that, and so on."""
    level = [obj]
    while level:
        yield level
        inner: list = []
        for x in level:
            if isinstance(x, dict):
                inner += x
                inner += x.values()
            elif isinstance(x, list):
                inner += x
        level = inner


def not_text(obj: Any) -> Iterator[str]:
    """The strings in *obj* that are not Unicode text (they hold a lone
    surrogate, which UTF-8 cannot carry)."""
    for level in levels(obj):
        yield from (x for x in level if isinstance(x, str) and SURROGATE.search(x))


def request_id(value: Any) -> int | str | None:
    """*value* if it can be a request's id (an integer or a string) and be
    answered with, else None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return value if isinstance(value, str) and not SURROGATE.search(value) else None


def leading_id(head: bytes) -> int | str | None:
    """The id of the JSON object that *head* begins (a line cut short), if a
    member "id" comes before the cut: clients put it before the params."""
    decoder, text = json.JSONDecoder(), head.decode(errors="replace")

    def skip(at: int, char: str = "") -> int:
        """*at* past blanks and then *char*; -1 if *char* is not there."""
        while text[at : at + 1] in (" ", "\t", "\r", "\n"):
            at += 1
        return at + len(char) if text.startswith(char, at) else -1

    at = skip(0, "{")
    try:
        while at >= 0:
            key, at = decoder.raw_decode(text, skip(at))
            if not isinstance(key, str) or (at := skip(at, ":")) < 0:
                return None
            value, at = decoder.raw_decode(text, skip(at))
            if key == "id":  # (a number at the cut may go on after it)
                return request_id(value) if at < len(text) else None
            at = skip(at, ",")
    except (ValueError, RecursionError):  # cut in the middle of a value
        pass
    return None


def read_line(wire: BinaryIO) -> tuple[bytes, int] | None:
    """The next line of *wire* without its newline (of a line longer than
    MAX_LINE: its first MAX_LINE + 1 bytes, the rest read and dropped) and
    its length; None at the end."""
    head = last = wire.readline(MAX_LINE + 1)
    if not head:
        return None
    size = len(head)
    while size > MAX_LINE and last and not last.endswith(b"\n"):
        last = wire.readline(1 << 16)
        size += len(last)
    return head.removesuffix(b"\n"), size - last.endswith(b"\n")


JSON_KINDS = {str: "a string", int: "a number", float: "a number", bool: "true or false"}


def parse(line: bytes, size: int) -> Any:
    """The JSON-RPC message (an ``mcp_types.JSONRPCMessage``) of one line of
    *size* bytes, None for a blank line; raises Refused.  The JSON text must
    be UTF-8 (RFC 8259 8.1) and parse: else -32700, a parse error, id null
    (also for a document nested too deeply to parse).  What parses but is
    not a message to serve is -32600, an invalid request, with its id: not a
    JSON-RPC 2.0 message object, nested deeper than MAX_DEPTH, a lone
    surrogate in a string (RFC 8259's grammar allows one as an escape, but it
    is not Unicode text), or longer than MAX_LINE."""
    from mcp_types import (
        INVALID_REQUEST,
        PARSE_ERROR,
        JSONRPCError,
        JSONRPCNotification,
        JSONRPCRequest,
        JSONRPCResponse,
    )
    from pydantic import ValidationError

    if size > MAX_LINE:
        raise Refused(
            INVALID_REQUEST,
            f"Invalid Request: the message is {size:,} bytes long; a line may have at most "
            f"{MAX_LINE:,} (1 MiB): send less (a shorter message, fewer paths)",
            leading_id(line),
        )
    if not line.strip():
        return None

    def constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    try:
        obj = json.loads(line.decode(), parse_constant=constant)
    except UnicodeDecodeError as e:
        raise Refused(PARSE_ERROR, f"Parse error: not UTF-8 (byte {e.start})") from None
    except ValueError as e:
        raise Refused(PARSE_ERROR, f"Parse error: {e}") from None
    except RecursionError:
        raise Refused(PARSE_ERROR, "Parse error: nested too deeply to parse") from None
    rid = request_id(obj.get("id")) if isinstance(obj, dict) else None

    def invalid(why: str) -> Refused:
        return Refused(INVALID_REQUEST, f"Invalid Request: {why}", rid)

    if isinstance(obj, list):
        raise invalid("an array (a batch): MCP takes one message, an object, per line")
    if not isinstance(obj, dict):
        raise invalid(f"a message is a JSON object, not {JSON_KINDS.get(type(obj), 'null')}")
    if any(depth > MAX_DEPTH for depth, _ in enumerate(levels(obj))):
        raise invalid(f"nested deeper than {MAX_DEPTH} levels")
    # (a lone surrogate in a string parsed from UTF-8 comes from an escape)
    bad = next(not_text(obj), None) if b"\\u" in line else None
    if bad is not None:
        lone = SURROGATE.search(bad).group()  # type: ignore[union-attr]
        raise invalid(f"a string holds a lone surrogate (U+{ord(lone):04X}): not Unicode text")
    model = (
        (JSONRPCRequest if "id" in obj else JSONRPCNotification)
        if "method" in obj
        else JSONRPCResponse
        if "result" in obj
        else JSONRPCError
        if "error" in obj
        else None
    )
    if model is None:
        raise invalid('no "method" (a request) and no "result" or "error" (a response)')
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise invalid(
            "; ".join(
                f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                for err in e.errors(include_url=False)[:3]
            )
        ) from None


END = object()


def next_message(wire: BinaryIO) -> Any:
    """The next message read from *wire*: a JSONRPCMessage, None for a blank
    line, END at the end; raises Refused."""
    got = read_line(wire)
    return END if got is None else parse(*got)


def encode(message: Any) -> bytes | None:
    """*message* as a line to send.  An answer that holds text that is not
    UTF-8 (a file name's bytes, as os.fsdecode carries them) becomes an
    internal error saying so; a message of the server's own that does, None."""
    from mcp_types import INTERNAL_ERROR, ErrorData, JSONRPCError, JSONRPCResponse

    try:
        return message.model_dump_json(by_alias=True, exclude_unset=True).encode() + b"\n"
    except ValueError:  # pydantic_core.PydanticSerializationError
        # (the shortest: a name rather than a text that holds it)
        bad = min(not_text(message.model_dump()), key=len, default=None)
        if bad is None:
            raise
    if not isinstance(message, JSONRPCResponse | JSONRPCError) or message.id is None:
        print(f"cowfs mcp: not sent, not UTF-8: {quote(bad[:200])}", file=sys.stderr)
        return None
    return encode(
        JSONRPCError(
            jsonrpc="2.0",
            id=message.id,
            error=ErrorData(
                code=INTERNAL_ERROR,
                message="Internal error: the answer holds text that is not UTF-8, which JSON-RPC "
                f"cannot carry: {quote(bad[:200])}",
            ),
        )
    )


def claim_stdio() -> tuple[BinaryIO, BinaryIO]:
    """The protocol's stdin and stdout on descriptors of their own; fd 0 then
    reads /dev/null and fd 1 writes to stderr, so nothing a tool runs or
    prints reads the client's requests or writes into the answers."""
    sys.stdout.flush()
    wire_in = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    wire_out = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    return os.fdopen(wire_in, "rb"), os.fdopen(wire_out, "wb")


def send_line(wire: BinaryIO, data: bytes) -> None:
    wire.write(data)
    wire.flush()


async def run_stdio(server: Any) -> None:
    """Serve *server* (an MCPServer, as its run_stdio_async does) on stdin
    and stdout until the client closes stdin."""
    import anyio
    from mcp.shared.message import SessionMessage
    from mcp_types import ErrorData, JSONRPCError

    wire_in, wire_out = claim_stdio()
    read_send, read_receive = anyio.create_memory_object_stream[Any](0)
    write_send, write_receive = anyio.create_memory_object_stream[Any](0)

    async def reader(answers: Any) -> None:
        async with read_send, answers:
            while True:
                try:
                    got = await anyio.to_thread.run_sync(
                        next_message, wire_in, abandon_on_cancel=True
                    )
                except Refused as e:
                    error = ErrorData(code=e.code, message=str(e))
                    await answers.send(
                        SessionMessage(JSONRPCError(jsonrpc="2.0", id=e.rid, error=error))
                    )
                    continue
                if got is END:
                    return
                if got is not None:
                    await read_send.send(SessionMessage(got))

    async def writer() -> None:
        async with write_receive:
            async for item in write_receive:
                data = encode(item.message)
                if data is None:
                    continue
                try:
                    await anyio.to_thread.run_sync(send_line, wire_out, data)
                except OSError:  # the client is gone
                    tg.cancel_scope.cancel()
                    return

    # (MCPServer's lowlevel server: what its own run_stdio_async runs)
    lowlevel = server._lowlevel_server
    async with anyio.create_task_group() as tg:
        tg.start_soon(reader, write_send.clone())
        tg.start_soon(writer)
        await lowlevel.run(read_receive, write_send, lowlevel.create_initialization_options())


KEPT_ENV = frozenset({"LANG", "LANGUAGE", "TZ", "TERM"})  # (and LC_*, COWFS_*)


def become(user: str) -> None:
    """Switch this process to *user* for good (its groups too): what the
    server does from here on, the agent's commands included, it does with
    that user's rights."""
    import pwd

    try:
        pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        raise CowfsError(f"--as {user}: no such user", errors.USAGE) from None
    if os.geteuid() != 0:
        if pw.pw_uid != os.geteuid():
            raise CowfsError(f"--as {user}: only root may serve as another user", errors.NOT_OWNER)
        return
    # What the tools load later is loaded now: the interpreter's own files
    # may be where USER cannot read them (a root's pyenv).
    import importlib.readers  # noqa: F401

    from ..escalation.policy import Policy

    Policy.load()
    os.initgroups(pw.pw_name, pw.pw_gid)
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    # A fresh environment, as a login would give it: what the starter's
    # held (tokens, keys, its PATH) is not the agent's to read.
    kept = {k: v for k, v in os.environ.items() if k in KEPT_ENV or k.startswith(("LC_", "COWFS_"))}
    os.environ.clear()
    os.environ.update(
        kept,
        HOME=pw.pw_dir,
        USER=pw.pw_name,
        LOGNAME=pw.pw_name,
        SHELL="/bin/sh",
        PATH="/usr/local/bin:/usr/bin:/bin",
    )


def serve(
    path: str, tools: Sequence[Command], mount: bool = False, as_user: str | None = None
) -> int:
    """`cowfs mcp`: serve the workspace containing *path* until the client
    closes stdin; *as_user*: as that user (required when run as root: the
    agent would otherwise act as root, through run above all)."""
    if os.geteuid() == 0 and as_user is None:
        raise CowfsError(
            "cowfs mcp was started as root: its tools (run, show, diff) would act as "
            "root for the agent; start it with --as USER, the agent's account (the "
            "workspace grants it what it may ask: cowfs mount --allow USER), or "
            "--as root to mean it",
            errors.USAGE,
        )
    try:
        import anyio
        import mcp.server.mcpserver  # noqa: F401
    except ImportError:
        raise CowfsError(
            "cowfs mcp needs the MCP SDK: pip install 'cowfs[mcp]'", errors.USAGE
        ) from None
    if mount:
        from ..system.mounts import is_cowfs_mount

        try:
            root = find_mount(path).mountpoint
        except errors.NotMounted:
            if not os.path.isdir(path) and not is_cowfs_mount(os.path.abspath(path)):
                raise errors.BadWorkspace(
                    f"workspace {path} does not exist or is not a directory"
                ) from None
            grant = [as_user] if as_user not in (None, "root", "0") else None
            root = Workspace.mount(path, allow=grant).root
    else:
        root = find_mount(path).mountpoint
    if as_user is not None:
        become(as_user)
    server = build(root, tools)
    try:
        anyio.run(run_stdio, server)
    except KeyboardInterrupt:
        pass
    return 0
