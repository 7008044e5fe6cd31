"""Agent CLI hooks: each turn of a coding agent (and, optionally, each shell
or file-writing tool call) becomes a checkpoint, so `cowfs rewind` can undo
what the agent's commands did.

`install` / `uninstall` edit the agent's project-level hook settings in
place (`jsonedit`: the user's own bytes stay as they are); `handle` is what
those hooks run (``cowfs hook AGENT EVENT``, the event JSON on stdin); a
hook never blocks or breaks the agent: whatever goes wrong, it says so in
one line and exits 0, which every agent here treats as "go on".

What each agent documents (see README.md, "Agents"):

* Claude Code (docs of 2026-08-22, v2.1.240): ``.claude/settings.json``,
  ``hooks.<Event>[] = {"matcher", "hooks": [{"type": "command", "command",
  "timeout" (s)}]}``; UserPromptSubmit carries ``prompt``, PreToolUse
  ``tool_name`` and ``tool_input``; exit 2 blocks, 0 goes on.
* Gemini CLI (docs/hooks of main, 2026-08-21, v0.56 nightly):
  ``.gemini/settings.json`` (comments allowed), the same nesting, ``timeout``
  in ms, ``name``; BeforeAgent carries ``prompt``, BeforeTool ``tool_name``
  and ``tool_input``; exit 2 blocks, 0 goes on (stdout must be JSON or
  nothing).
* Codex (developers.openai.com/codex/hooks as of 2026-05-18; hook schemas in
  codex-rs/hooks): ``.codex/hooks.json``, the same nesting, ``timeout`` (s);
  UserPromptSubmit carries ``prompt`` and ``turn_id``, PreToolUse
  ``tool_name`` (Bash, apply_patch) and ``tool_input.command``; exit 2
  blocks, 0 goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import stat
import sys
import time
from dataclasses import dataclass

from .. import errors
from ..errors import CowfsError
from ..service import control
from ..text import printable, quote
from . import jsonedit

HOOK_TIMEOUT = 60  # seconds an agent waits for our hook (we give up first)
CONTROL_TIMEOUT = 45  # seconds the hook waits for the daemon
MESSAGE_LIMIT = 200  # characters of a prompt's first line kept as the message
PAYLOAD_LIMIT = 64 << 20  # bytes of event JSON read from stdin


@dataclass(frozen=True)
class Agent:
    name: str
    settings: str  # the project-level hook settings, relative to the workspace
    prompt_event: str  # fires when the user submits a prompt: a turn begins
    tool_event: str  # fires before a tool runs
    tool_matcher: str  # the tools that run commands or write files
    timeout_unit: int  # the settings' timeout is in seconds (1) or ms (1000)
    comments: bool = False  # the settings file may hold // and /* */ comments

    def handler(self, command: str, event: str) -> dict:
        h: dict = {"type": "command", "command": command}
        if self.name == "gemini":
            h["name"] = f"cowfs-{event}"
            h["description"] = "cowfs: a checkpoint to undo to (cowfs rewind)"
        h["timeout"] = HOOK_TIMEOUT * self.timeout_unit
        if self.name == "codex":
            h["statusMessage"] = "cowfs checkpoint"
        return h

    def kind(self, event: str) -> str | None:
        return {self.prompt_event: "prompt", self.tool_event: "tool"}.get(event)


AGENTS = {
    a.name: a
    for a in (
        Agent(
            "claude-code",
            ".claude/settings.json",
            "UserPromptSubmit",
            "PreToolUse",
            "Bash|PowerShell|Write|Edit|NotebookEdit",
            1,
        ),
        Agent(
            "gemini",
            ".gemini/settings.json",
            "BeforeAgent",
            "BeforeTool",
            "^(run_shell_command|write_file|replace)$",
            1000,
            comments=True,
        ),
        Agent(
            "codex",
            ".codex/hooks.json",
            "UserPromptSubmit",
            "PreToolUse",
            "^(Bash|apply_patch)$",
            1,
        ),
    )
}


def agent(name: str) -> Agent:
    try:
        return AGENTS[name]
    except KeyError:
        raise CowfsError(
            f"unknown agent {name!r} (one of {', '.join(AGENTS)})", errors.USAGE
        ) from None


# -- the hook command and which hooks are ours --------------------------------------


def cowfs_argv() -> list[str]:
    """How to run this cowfs from an agent (which may not have our PATH):
    the ``cowfs`` script beside this interpreter, else ``python -m cowfs``."""
    script = os.path.join(os.path.dirname(sys.executable), "cowfs")
    if os.access(script, os.X_OK):
        return [script]
    return [sys.executable, "-m", "cowfs"]


# What the agent shows if the hook command cannot run at all (cowfs gone, or
# too old to know `hook`): said as JSON on stdout, with exit 0, so a failure
# there never blocks the agent either (every agent here runs the command
# through a shell; exit 2, argparse's, would block Claude Code's prompt).
FALLBACK = {
    "systemMessage": "cowfs: the checkpoint hook could not run (is cowfs installed "
    "and new enough?); no checkpoint taken"
}


def hook_command(a: Agent, workspace: str, event: str) -> str:
    return (
        shlex.join([*cowfs_argv(), "-C", workspace, "hook", a.name, event])
        + " || echo "
        + shlex.quote(json.dumps(FALLBACK))
    )


def is_ours(command: object, a: Agent) -> bool:
    """Whether a hook command is one `install` writes for *a*: cowfs (a
    script named cowfs, or python -m cowfs) running ``hook AGENT``."""
    if not isinstance(command, str):
        return False
    try:
        words = shlex.split(command)
    except ValueError:
        return False
    for i in range(len(words) - 1):
        if words[i] == "hook" and words[i + 1] == a.name:
            before = words[:i]
            return any(os.path.basename(w) == "cowfs" for w in before[:1]) or any(
                before[j : j + 2] == ["-m", "cowfs"] for j in range(len(before))
            )
    return False


# -- installing ---------------------------------------------------------------------


def settings_path(a: Agent, workspace: str) -> str:
    return os.path.join(workspace, a.settings)


def _document(a: Agent, text: str, path: str) -> jsonedit.Node:
    try:
        root = jsonedit.parse(text, comments=a.comments)
    except jsonedit.JSONTextError as e:
        raise CowfsError(
            f"{path} is not valid JSON ({e}); nothing was changed", errors.USAGE
        ) from None
    if root.kind != "object":
        raise CowfsError(f"{path} does not hold a JSON object; nothing was changed", errors.USAGE)
    hooks = root.get("hooks")
    if hooks is not None and hooks.kind != "object":
        raise CowfsError(f'{path}: "hooks" is not an object; nothing was changed', errors.USAGE)
    return root


def _find_ours(a: Agent, root: jsonedit.Node) -> tuple[jsonedit.Node, int] | None:
    """The innermost container holding one of our handlers and its index,
    widened while it would be left empty: a matcher group of ours only, an
    event list of ours only, a hooks object of ours only."""
    hooks = root.get("hooks")
    if hooks is None:
        return None
    for mi, (_, _, groups) in enumerate(hooks.members):
        if groups.kind != "array":
            continue
        for gi, group in enumerate(groups.items):
            handlers = group.get("hooks") if group.kind == "object" else None
            if handlers is None or handlers.kind != "array":
                continue
            for hi, h in enumerate(handlers.items):
                if h.kind == "object" and is_ours(h.value.get("command"), a):
                    at = [k for k, _, _ in root.members].index("hooks")
                    chain = [(handlers, hi), (groups, gi), (hooks, mi), (root, at)]
                    level = 0
                    while level < 3 and len(chain[level][0].spans()) == 1:
                        level += 1
                    return chain[level]
    return None


def strip_ours(a: Agent, text: str, path: str) -> str:
    """*text* without our hooks (and the containers only they filled)."""
    while True:
        found = _find_ours(a, _document(a, text, path))
        if found is None:
            return text
        container, index = found
        text = jsonedit.remove(text, container, index)


def add_group(a: Agent, text: str, path: str, event: str, group: dict) -> str:
    root = _document(a, text, path)
    hooks = root.get("hooks")
    if hooks is None:
        return jsonedit.append(text, root, {event: [group]}, key="hooks")
    groups = hooks.get(event)
    if groups is None:
        return jsonedit.append(text, hooks, [group], key=event)
    if groups.kind != "array":
        raise CowfsError(f"{path}: hooks.{event} is not a list; nothing was changed", errors.USAGE)
    return jsonedit.append(text, groups, group)


EMPTY = "{}\n"  # what is left of a settings file that only we wrote

# the mark `install` leaves on a settings directory it made (.codex/ ...), so
# that `uninstall` takes away only such a directory, once nothing is left in it
MADE = "user.cowfs.made"


SETTINGS_LIMIT = 16 << 20  # bytes of an agent's settings file read (they are a few KiB)


class _Settings:
    """An agent's settings file in a workspace, found once and used through
    descriptors (see DESIGN.md, "Threat model": the agent may swap any name
    in its workspace for a symlink at any moment, and root may be the one
    installing): the workspace and the settings directory are opened by
    launch.open_dir (no symlink followed but one the invoking user or root
    put where only they could; `install` creates a missing directory), the
    file itself by launch.open_entry (a symlink another user may have put
    there is refused, exit 2: nothing is read through it or written to
    it), read through that descriptor, and replaced by a new file made
    with O_CREAT | O_EXCL | O_NOFOLLOW under an unpredictable name in the
    same directory (relative to its descriptor), renamed over the name.
    A symlink that is followed (the user's own, in a directory only the
    user or root may change) stays: the file it leads to is the one
    replaced."""

    def __init__(self, a: Agent, workspace: str, create: bool):
        from ..service.launch import PlantedLink, open_dir, open_entry

        self.path = settings_path(a, workspace)
        self.workspace = workspace
        self.dirfd: int | None = None
        self.fd: int | None = None
        self.linked = False  # reached through a symlink of the user's (or root's)
        head, name = os.path.split(a.settings)
        self.head, self.name = head, name
        try:
            root = open_dir(workspace)
            try:
                try:
                    d = open_dir(head, root)
                except FileNotFoundError:
                    if not create:
                        raise
                    d = open_dir(head, root, mkdir=0o777)
                    with contextlib.suppress(OSError):  # (no user xattrs there: it stays)
                        os.setxattr(f"/proc/self/fd/{d}", MADE, b"cowfs hooks install")
            finally:
                os.close(root)
            try:
                self.dirfd, self.name, self.fd, self.linked = open_entry(d, name)
            finally:
                os.close(d)
        except FileNotFoundError:
            if create:
                raise
            # (no settings directory: nothing to read or remove)
        except PlantedLink as e:  # (it names the link)
            raise CowfsError(f"{e}; nothing was changed", errors.USAGE) from None

    def refused(self, why: str) -> CowfsError:
        return CowfsError(f"{quote(self.path)}: {why}; nothing was changed", errors.USAGE)

    def __enter__(self) -> _Settings:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in (self.fd, self.dirfd):
            if fd is not None:
                os.close(fd)

    def read(self) -> str | None:
        """The file's text, None where there is none; a file that is not a
        regular file, too large or not UTF-8 is refused."""
        if self.fd is None:
            return None
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            raise self.refused("not a regular file")
        # (the O_PATH descriptor opened again for reading: the same file)
        fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = bytearray()
            while len(data) <= SETTINGS_LIMIT:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(fd)
        if len(data) > SETTINGS_LIMIT:
            raise self.refused(f"larger than {SETTINGS_LIMIT >> 20} MiB")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise CowfsError(
                f"{quote(self.path)} is not UTF-8 text; nothing was changed", errors.USAGE
            ) from None

    def write(self, text: str | None) -> None:
        """Replace the file with *text* (its mode and owner kept), or
        remove it (None); then sync the directory."""
        assert self.dirfd is not None
        if text is None:
            os.unlink(self.name, dir_fd=self.dirfd)
        else:
            st = os.fstat(self.fd) if self.fd is not None else None
            tmp, fd = self._create(0o600 if st is not None else 0o666)
            try:
                try:
                    if st is not None:
                        if os.geteuid() == 0:
                            os.fchown(fd, st.st_uid, st.st_gid)
                        os.fchmod(fd, st.st_mode & 0o777)  # (never setuid/setgid)
                    data = text.encode("utf-8")
                    while data:
                        data = data[os.write(fd, data) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self.name, src_dir_fd=self.dirfd, dst_dir_fd=self.dirfd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=self.dirfd)
                except OSError:
                    pass
                raise
        d = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.dirfd)
        try:
            os.fsync(d)
        finally:
            os.close(d)

    def remove_made_dir(self) -> bool:
        """Remove the settings directory if `install` made it (its mark)
        and it is empty -- never one the user had, nor one reached through
        a symlink; whether it was removed."""
        from ..service.launch import open_dir

        if self.dirfd is None or self.linked or not self.head:
            return False
        try:
            made = os.getxattr(f"/proc/self/fd/{self.dirfd}", MADE)
        except OSError:
            return False
        parent, leaf = os.path.split(self.head)
        try:
            d = open_dir(os.path.join(self.workspace, parent) if parent else self.workspace)
        except OSError:
            return False
        try:
            there, ours = os.stat(leaf, dir_fd=d, follow_symlinks=False), os.fstat(self.dirfd)
            if not made or (there.st_dev, there.st_ino) != (ours.st_dev, ours.st_ino):
                return False
            if os.listdir(f"/proc/self/fd/{self.dirfd}"):
                return False
            os.rmdir(leaf, dir_fd=d)  # (ENOTEMPTY if something came meanwhile)
            return True
        except OSError:
            return False
        finally:
            os.close(d)

    def _create(self, mode: int) -> tuple[str, int]:
        """A new, empty file beside the settings, under a name nobody could
        guess (and plant something at) beforehand."""
        assert self.dirfd is not None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(100):
            tmp = f"{self.name}.cowfs-{secrets.token_hex(12)}"
            try:
                return tmp, os.open(tmp, flags, mode, dir_fd=self.dirfd)
            except FileExistsError:
                continue
        raise CowfsError(
            f"cannot make a temporary file beside {quote(self.path)}; nothing was changed"
        )


def install(a: Agent, workspace: str, per_tool: bool = False) -> dict:
    """Write our hooks into *a*'s settings in *workspace* (replacing ours
    from before, keeping everything else byte for byte)."""
    path = settings_path(a, workspace)
    events = [(a.prompt_event, None)] + ([(a.tool_event, a.tool_matcher)] if per_tool else [])
    with _Settings(a, workspace, create=True) as settings:
        before = settings.read()
        text = strip_ours(a, EMPTY if before is None else before, path)
        for event, matcher in events:
            group: dict[str, object] = {"matcher": matcher} if matcher else {}
            group["hooks"] = [a.handler(hook_command(a, workspace, event), event)]
            text = add_group(a, text, path, event, group)
        if text != before:
            settings.write(text)
    return {
        "agent": a.name,
        "settings": path,
        "events": [e for e, _ in events],
        "created": before is None,
        "changed": text != before,
    }


def uninstall(a: Agent, workspace: str) -> dict:
    """Remove our hooks from *a*'s settings; a file only we wrote goes, and
    then the directory `install` made for it if nothing else is in it."""
    path = settings_path(a, workspace)
    with _Settings(a, workspace, create=False) as settings:
        before = settings.read()
        text = before if before is None else strip_ours(a, before, path)
        # (a file reached through the user's own symlink is emptied, not removed)
        removed = text != before and text == EMPTY and not settings.linked
        if text != before:
            settings.write(None if removed else text)
        gone = (before is None or removed) and settings.remove_made_dir()
    return {
        "agent": a.name,
        "settings": path,
        "changed": text != before,
        "removed": removed,
        "removed_dir": os.path.join(workspace, settings.head) if gone else None,
    }


# -- the hook itself ------------------------------------------------------------------


def read_payload(fd: int, limit: int = PAYLOAD_LIMIT, timeout: float = 10.0) -> dict:
    """The event JSON an agent writes on our stdin (an empty dict for none,
    a terminal, or one that never ends)."""
    if os.isatty(fd):
        return {}
    buf = bytearray()
    deadline = time.monotonic() + timeout
    while len(buf) <= limit:
        if not control.wait_readable(fd, deadline - time.monotonic()):
            raise CowfsError("the event JSON did not arrive on stdin in time", errors.USAGE)
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        buf += chunk
    if len(buf) > limit:
        raise CowfsError("the event JSON on stdin is too large", errors.USAGE)
    if not buf.strip():
        return {}
    try:
        payload = json.loads(buf)
    except ValueError:
        raise CowfsError("the event JSON on stdin is not valid JSON", errors.USAGE) from None
    if not isinstance(payload, dict):
        raise CowfsError("the event JSON on stdin is not an object", errors.USAGE)
    return payload


def first_line(text: object, limit: int = MESSAGE_LIMIT) -> str:
    for line in str(text or "").splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 1] + "…"
    return ""


def _relative(path: object, workspace: str) -> str:
    p = str(path or "")
    root = workspace.rstrip("/") + "/"
    return p[len(root) :] if p.startswith(root) else p


def tool_summary(tool: str, tool_input: object, workspace: str) -> str:
    """What a tool call is about to do, in a line: a shell command, the
    file a tool writes, the files a patch touches."""
    args = tool_input if isinstance(tool_input, dict) else {}
    if tool == "apply_patch":
        files = re.findall(
            r"^\*\*\* (?:Add|Update|Delete) File: (.+)$", str(args.get("command") or ""), re.M
        )
        return first_line(", ".join(_relative(f.strip(), workspace) for f in files))
    for key in ("file_path", "notebook_path", "path"):
        if args.get(key):
            return first_line(_relative(args[key], workspace))
    return first_line(args.get("command") or args.get("description") or "")


def checkpoint_for(a: Agent, event: str, payload: dict, workspace: str) -> tuple[str, dict]:
    """The message and the agent record of the checkpoint for *event*."""
    kind = a.kind(event)
    record = {"agent": a.name, "event": event, "kind": kind}
    for key, field_ in (
        ("session", "session_id"),
        ("turn", "turn_id"),
        ("turn", "prompt_id"),
        ("tool_use", "tool_use_id"),
    ):
        if isinstance(payload.get(field_), str) and key not in record:
            record[key] = payload[field_][:200]
    if kind == "prompt":
        return first_line(payload.get("prompt")) or "(an empty prompt)", record
    tool = str(payload.get("tool_name") or "a tool")[:100]
    record["tool"] = tool
    what = tool_summary(tool, payload.get("tool_input"), workspace)
    return (f"{tool}: {what}" if what else tool), record


def handle(
    agent_name: str, event: str, path: str | None, stdin_fd: int = 0
) -> tuple[str, int | None]:
    """Take the checkpoint an agent's hook event asks for.  Returns what to
    say (one line) and the layer id, or raises CowfsError (the caller says
    it and still exits 0)."""
    from .client import Client

    a = agent(agent_name)
    kind = a.kind(event)
    if kind is None:
        return (
            f"{a.name} event {event!r} is not one cowfs checkpoints at "
            f"({a.prompt_event}, {a.tool_event}); nothing done",
            None,
        )
    payload = read_payload(stdin_fd)
    where = (
        path or (payload.get("cwd") if isinstance(payload.get("cwd"), str) else None) or os.getcwd()
    )
    ws = Client.attach(where)
    message, record = checkpoint_for(a, event, payload, ws.root)
    res = ws.call("checkpoint", timeout=CONTROL_TIMEOUT, message=message, agent=record)
    return f"checkpoint {res['id']}: {message}", res["id"]


# -- rewinding turns ----------------------------------------------------------------------


def turns_to_rewind(layers: list[dict], n: int) -> tuple[int, list[dict]]:
    """The layer a rollback of the last *n* turns goes down to, and the
    layers it undoes (each with its agent record, if any)."""
    prompts = [x for x in layers if (x.get("agent") or {}).get("kind") == "prompt"]
    if not prompts:
        raise errors.NothingToDo(
            "no agent turns are recorded in this workspace's layers "
            "(cowfs hooks install AGENT records them)"
        )
    if n < 1 or n > len(prompts):
        raise CowfsError(
            f"cannot rewind {n} turn{'s' if n != 1 else ''}: "
            f"{len(prompts)} turn{'s are' if len(prompts) != 1 else ' is'} "
            "recorded",
            errors.USAGE,
        )
    target = prompts[-n]["id"]
    return target, [x for x in layers if x["id"] >= target]


def describe(layer: dict) -> list[str]:
    """Lines for a layer an agent event opened (and those merged into it);
    what the agent said (its tool, the message with the paths it names)
    with control characters escaped (text.printable)."""
    rows = []
    for rec, message in [(layer.get("agent"), layer.get("message"))] + [
        (t, t.get("message")) for t in layer.get("turns") or []
    ]:
        if not rec:
            continue
        what = "turn" if rec.get("kind") == "prompt" else f"before {rec.get('tool', 'a tool')}"
        merged = f"layer {rec['layer']}, merged: " if "layer" in rec else ""
        session = f", session {str(rec['session'])[:8]}" if rec.get("session") else ""
        rows.append(
            printable(
                f"{merged}{rec.get('agent')} {what} ({rec.get('event')}{session})"
                + (f": {message}" if merged else "")
            )
        )
    return rows
