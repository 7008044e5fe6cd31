"""What the interfaces print, shared by the command line and the MCP
server: changes, diffs, audit events, layers' agent turns, and the
trimming of results for a model to read."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from typing import Any

from ..layers import listing
from ..text import human_size, printable, quote, relative


def format_event(e: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["time"]))
    kind = e["event"]
    if kind == "change":
        what = format_change(e) + (" (undone)" if e.get("undone") else "")
        who = f"  [{format_who(e)}]" if e.get("who") else ""
        return f"{when}  {'':>10}  {what}{who}"
    detail = {k: v for k, v in e.items() if k not in ("n", "time", "event")}
    return f"{when}  {kind:>10}  " + " ".join(
        f"{k}={printable(v) if isinstance(v, str) else v}" for k, v in detail.items()
    )


def relative_change(c: dict, base: str) -> dict:
    """Change *c* with its paths as seen from the directory *base* (a
    workspace path; "" the root: *c* itself), as lines for people name
    them."""
    if not base:
        return c
    return c | {k: relative(c[k], base) for k in ("path", "from") if c.get(k) is not None}


def format_change(c: dict, base: str = "") -> str:
    """'M a.txt', 'R old -> new': names quoted (text.quote), each side of
    a rename on its own; seen from *base* (``relative_change``)."""
    c = relative_change(c, base)
    if c["kind"] == "R":
        return f"R {quote(c['from'])} -> {quote(c['path'])}"
    return f"{c['kind']} {quote(c['path'])}"


def format_who(c: dict) -> str:
    """The process that first made a change, for --who (an argument with a
    control character in it quoted as a name is, the others as a shell
    would take them)."""
    w = c.get("who")
    if not w:
        return "(unknown)"
    cmd = " ".join(quote(a) if printable(a) != a else shlex.quote(a) for a in w.get("cmd") or ["?"])
    return f"pid {w.get('pid')} uid {w.get('uid')}: {cmd}"


def times_line(res: dict) -> list[str]:
    """The line saying how many paths were left out because their
    modification time alone differs (op status's, changes' and diff's
    "times_only"), and how to list them."""
    n = res.get("times_only") or 0
    if not n:
        return []
    if n == 1:
        return ["# 1 path differs only in its modification time (--times lists it)"]
    return [f"# {n:,} paths differ only in their modification times (--times lists them)"]


def redo_line(info: dict | None) -> list[str]:
    """What status and log say about undoing the last rollback: that it can
    be, or why it cannot -- only while the layers are still those it left
    (a checkpoint, commit or other rollback since makes it old news)."""
    if not info or not (info["available"] or info.get("current", True)):
        return []
    from ..layers.redo import layers_text

    what = f"# the rollback of {layers_text(info['layers'])}"
    if info["available"]:
        return [f"{what} can be undone: cowfs redo"]
    return [f"{what} cannot be redone: {info['why']}"]


def change_lines(
    changes: list[dict],
    every: bool,
    limit: int | None = None,
    suffix: Callable[[dict], str] | None = None,
    line: Callable[[dict], str] = listing.line,
    base: str = "",
) -> list[str]:
    """The lines of a list of changes: directories added or deleted as a
    whole as one line each (after the single changes), unless *every*;
    at most *limit* lines; *suffix* adds to each (--who); paths seen from
    *base* (``relative_change``)."""
    shown = changes if every else listing.individual_first(listing.collapse(changes))
    shown, more = listing.cut(shown, limit)
    return [line(relative_change(c, base)) + (suffix(c) if suffix else "") for c in shown] + (
        [more] if more else []
    )


def diff_rows(
    changes: list[dict], name_status: bool, stat: bool, who: bool, base: str = ""
) -> list[str]:
    """The lines `cowfs diff` prints for *changes* (op diff's), paths seen
    from *base* (``relative_change``)."""
    rows = []
    for c in changes:
        name = format_change(c, base)
        if name_status:
            rows.append(name.replace(" ", "\t", 1) + (f"\t{format_who(c)}" if who else ""))
        elif stat:
            counts = (
                "not readable by you"
                if c.get("unreadable")
                else f"text too large to diff{over(c)}"
                if c.get("text_limit") is not None
                else "too many lines to diff"
                if c.get("too_large")
                else "content unchanged"
                if same_content(c)
                else f"+{c['added']} -{c['removed']}"
                if "diff" in c
                else f"binary {side_sizes(c)}"
                if c["binary"]
                else c["kind"]
            )
            rows.append(f" {name[2:]:<50} | {counts}")
        else:
            rows.append(f"diff --cowfs {name}")
            for side in ("old", "new"):
                if side in c and c[side]["kind"] != "file":
                    rows.append(f"{side} {c[side]['kind']} mode {c[side]['mode']:o}")
                    if "target" in c[side] and not c.get("diff"):  # (a type change)
                        rows[-1] += f" -> {quote(c[side]['target'])}"
            same = same_content(c)
            if c.get("unreadable"):
                rows.append("(not readable by you: contents not shown)")
            elif c.get("text_limit") is not None:
                rows.append(f"Text, too large to diff{over(c)}: {side_sizes(c)}")
            elif c.get("too_large"):
                rows.append(f"Text, too many lines to diff: {side_sizes(c)}")
            elif c.get("diff"):
                rows.append(quoted_headers(c, base).rstrip("\n"))
            elif c["binary"] and not same:
                rows.append(f"Binary: {side_sizes(c)}")
            elif same:
                rows.append(f"content unchanged ({c['new']['size']} bytes xxh3 {c['new']['xxh3']})")
            rows += attribute_changes(c, mtime=same)
    return rows


def over(c: dict) -> str:
    """What limit a text too large to diff was over (0: the diff had read
    as much text as it holds at once before it)."""
    limit = c["text_limit"]
    return (
        f" (over {human_size(limit)})"
        if limit
        else " (this diff read its most text already: ask for fewer paths)"
    )


def quoted_headers(c: dict, base: str = "") -> str:
    """The unified diff of change *c* with the names in its ---/+++ lines
    quoted as git quotes them ('--- "a/x\\ny"'), seen from *base*
    (``relative_change``): they are the one place where the diff names a path
    (op diff's JSON keeps them exact, from the root)."""

    def sides(c: dict) -> list[str]:
        old = (
            "a/" + (c.get("from") or (c["path"] if c["path"] != "." else ""))
            if "old" in c
            else None
        )
        new = f"b/{c['path']}" if "new" in c else None
        return [side or "/dev/null" for side in (old, new)]

    exact = sides(c)
    head = f"--- {exact[0]}\n+++ {exact[1]}\n"
    if not c["diff"].startswith(head):  # (past.diff_entry writes it so; else no name raw)
        return "\n".join(map(printable, c["diff"].split("\n")))
    shown = sides(relative_change(c, base))
    return f"--- {quote(shown[0])}\n+++ {quote(shown[1])}\n" + c["diff"][len(head) :]


def same_content(c: dict) -> bool:
    """A file whose bytes are back as they were (both sides hashed, equal)."""
    return (
        "old" in c
        and "new" in c
        and "xxh3" in c["old"]
        and c["old"].get("xxh3") == c["new"].get("xxh3")
    )


def attribute_changes(c: dict, mtime: bool) -> list[str]:
    """The mode of a changed entry when it differs, and (*mtime*: when the
    content is back as it was) its mtime."""
    old, new = c.get("old"), c.get("new")
    if not old or not new:
        return []
    rows = []
    if old["mode"] != new["mode"]:
        rows.append(f"mode {old['mode']:o} -> {new['mode']:o}")
    if mtime and old["mtime_ns"] != new["mtime_ns"]:
        rows.append(f"mtime {iso_ns(old['mtime_ns'])} -> {iso_ns(new['mtime_ns'])}")
    return rows


def iso_ns(ns: int) -> str:
    t = time.gmtime(ns // 10**9)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{ns % 10**9:09d}Z"


def side_sizes(c: dict) -> str:
    def one(side: str) -> str:
        d = c.get(side)
        if d is None:
            return "(none)"
        if "xxh3" not in d and d.get("sparse"):
            return f"{d['size']} bytes (sparse: not read)"
        return f"{d['size']} bytes xxh3 {d.get('xxh3', '-')}"

    return f"{one('old')} -> {one('new')}"


def summary(
    changes: list,
    limit: int | None = 10,
    every: bool = False,
    base: str = "",
    times_only: int = 0,
) -> str:
    """Counts by kind, then the single changes and after them the
    directories added or deleted as a whole, one line each (*every*: each
    path), at most *limit* lines; paths seen from *base* (``relative_change``);
    and how many paths differ only in their modification times."""
    times = [line.removeprefix("# ") for line in times_line({"times_only": times_only})]
    if not changes:
        return "\n".join(["no changes", *times])
    dicts = [c.to_dict() for c in changes]
    return "\n".join(
        [listing.headline(listing.counts(dicts)), *times]
        + [f"  {line}" for line in change_lines(dicts, every, limit, base=base)]
    )


def agent_lines(layer: dict) -> list[str]:
    """The agent events recorded on *layer* (see ``agents.describe``)."""
    if not layer.get("agent") and not layer.get("turns"):
        return []
    from .agents import describe

    return describe(layer)


# -- for a model to read (MCP) ----------------------------------------------

TEXT_LIMIT = 20_000  # default byte limit of diff, show and run output


def as_text(data: Any) -> str:
    return data if isinstance(data, str) else json.dumps(data, indent=1, ensure_ascii=False)


NOISE = {"daemon_ms", "engine", "who", "start", "records"}


def clean(data: Any, keep: frozenset = frozenset()) -> Any:
    """*data* without what a model need not read: timings, engine
    statistics, writers (unless in *keep*), empty lists and nulls."""
    if isinstance(data, dict):
        return {
            k: clean(v, keep)
            for k, v in data.items()
            if (k not in NOISE or k in keep) and v is not None and (v != [] or k == "changes")
        }
    if isinstance(data, list):
        return [clean(v, keep) for v in data]
    return data


def cut(text: str, limit: int, hint: str) -> tuple[str, bool]:
    """*text*, or its first *limit* bytes (at a line end where there is
    one) and a line saying what was left out."""
    data = text.encode()
    if len(data) <= limit:
        return text, False
    head = data[: max(0, limit)]
    nl = head.rfind(b"\n")
    if nl > 0:
        head = head[: nl + 1]
    return (
        head.decode(errors="ignore") + f"[... cut at {len(head)} of {len(data)} bytes; {hint}]\n"
    ), True


def utf8(data: bytes) -> str | None:
    """*data* as text, or None for binary (a character cut at the end is
    left out)."""
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        if e.start < len(data) - 3:
            return None
        return data[: e.start].decode()
