"""Words for people: counts with their nouns, ages, durations, names
quoted so that no file name can reach a terminal raw, and workspace paths
as seen from the current directory; and JSON that carries every name
exactly yet is valid Unicode (``lossless``)."""

from __future__ import annotations

import base64
import json
import os
import re
import time
from typing import Any


def count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 step', '3 steps', '1 directory' / count(3, 'directory', 'directories')."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def ago(t: float, now: float) -> str:
    """When *t* (unix time) was, for people: '3 minutes ago' within a day,
    else the local date and time ('2025-06-01 09:12')."""
    age = max(0, now - t)
    for limit, unit, noun in ((60, 1, "second"), (3600, 60, "minute"), (86400, 3600, "hour")):
        if age < limit:
            return "just now" if age < 1 else f"{count(int(age // unit), noun)} ago"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def duration(seconds: float) -> str:
    """'0.31 s', '41 s', '2 min 3 s', '1 h 2 min'."""
    if seconds < 10:
        return f"{seconds:.2g} s" if seconds < 1 else f"{seconds:.1f} s"
    if seconds < 59.5:
        return f"{seconds:.0f} s"
    m, s = divmod(int(seconds), 60)
    return f"{m} min {s} s" if m < 60 else f"{m // 60} h {m % 60} min"


# What a name is quoted for when it is printed for people, as git's
# core.quotePath does: the C0 controls, DEL and the C1 controls (ESC, CSI:
# they would reach the terminal as escape sequences; newline and CR: they
# would forge lines), the line and paragraph separators and the
# bidirectional formatting characters (they move or reorder what is shown),
# '"' and '\' (so a quoted name reads back unambiguously), and lone
# surrogates: the bytes of a name that are not UTF-8, which os.fsdecode
# carries as U+DC80..U+DCFF.  Valid UTF-8 otherwise prints as it is (git
# with core.quotePath=false): "café" stays café.
UNSAFE = re.compile(
    r'[\x00-\x1f"\\\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]'
)
# The same without '"' and '\': what free text (a message, a command line)
# may not carry to a terminal.
CONTROL = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]"
)
C_ESCAPES = {
    "\a": "\\a",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\v": "\\v",
    "\f": "\\f",
    "\r": "\\r",
    '"': '\\"',
    "\\": "\\\\",
}


def _escape(m: re.Match) -> str:
    ch = m.group()
    short = C_ESCAPES.get(ch)
    if short is not None:
        return short
    if "\udc80" <= ch <= "\udcff":  # a byte that is not UTF-8: the byte itself
        raw = bytes([ord(ch) - 0xDC00])
    else:  # the character's UTF-8 bytes (a surrogate's own, as no byte stands for it)
        raw = ch.encode("utf-8", "surrogatepass")
    return "".join(f"\\{b:03o}" for b in raw)


def quote(name: str | bytes) -> str:
    r"""*name* (a path: str as os.fsdecode gives it, or bytes) as lines for
    people print it: unchanged when nothing in it needs escaping, else in
    double quotes with C escapes (\n \t \" \\ \a \b \f \r \v) and three-digit
    octal for the rest of what UNSAFE matches: a byte that is not UTF-8 as
    itself (b"\xff": "\377"), a character as its UTF-8 bytes (ESC: "\033").
    JSON carries names exactly; only lines for people use this."""
    if isinstance(name, bytes):
        name = os.fsdecode(name)
    if not UNSAFE.search(name):
        return name
    return '"' + UNSAFE.sub(_escape, name) + '"'


def printable(text: str) -> str:
    """Free text for people (a message, a command line), not quoted: what
    CONTROL matches escaped as ``quote`` escapes it; quotes and backslashes
    left as they are."""
    return CONTROL.sub(_escape, text)


def relative(path: str, base: str) -> str:
    """Workspace path *path* (from the workspace's root, "." the root) as
    seen from the directory *base* (a workspace path too; "" or "." the
    root: *path* as it is), as ``git status`` names paths: "src/x" from
    above it, "../other/x" from beside it, "." for *base* itself."""
    if base in ("", "."):
        return path
    to = [] if path in ("", ".") else path.split("/")
    here = base.split("/")
    n = 0
    while n < min(len(to), len(here)) and to[n] == here[n]:
        n += 1
    return "/".join([".."] * (len(here) - n) + to[n:]) or "."


# -- JSON ---------------------------------------------------------------------------------

SURROGATE = re.compile(r"[\ud800-\udfff]")


def raw(text: str) -> bytes:
    """The bytes *text* stands for, as os.fsencode gives them (a surrogate
    U+DC80..U+DCFF: the byte of a name that is not UTF-8); any other
    surrogate, which no byte stands for, as its own UTF-8 form."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return b"".join(
            bytes([ord(ch) - 0xDC00])
            if "\udc80" <= ch <= "\udcff"
            else ch.encode("utf-8", "surrogatepass")
            for ch in text
        )


def _b64(text: str) -> str:
    return base64.b64encode(raw(text)).decode()


def lossless(obj: Any) -> Any:
    r"""*obj*, what a JSON output says, with every string valid Unicode, so
    that strict parsers take it (jq, and any that decodes UTF-8): each
    surrogate in a string -- a byte of a name that is not UTF-8, as
    os.fsdecode carries it -- becomes U+FFFD, and beside the member KEY
    of an object that holds such a string, KEY_bytes holds its bytes in
    base64 ("path": "latin\ufffd.txt", "path_bytes": "bGF0aW7pLnR4dA=="); beside
    a list of strings with such a string in it, KEY_bytes is a list of the
    same length with the base64 of each such string and null for the
    others.  *obj* itself when no string needs it."""
    if isinstance(obj, str):
        return SURROGATE.sub("\ufffd", obj) if SURROGATE.search(obj) else obj
    if isinstance(obj, dict):
        out: dict = {}
        changed = False
        for k, v in obj.items():
            key = lossless(k) if isinstance(k, str) else k
            new = lossless(v)
            out[key] = new
            changed |= new is not v or key is not k
            if isinstance(v, str) and new is not v:
                out[f"{key}_bytes"] = _b64(v)
            elif isinstance(v, list) and any(isinstance(x, str) and SURROGATE.search(x) for x in v):
                out[f"{key}_bytes"] = [
                    _b64(x) if isinstance(x, str) and SURROGATE.search(x) else None for x in v
                ]
        return out if changed else obj
    if isinstance(obj, (list, tuple)):
        items = [lossless(x) for x in obj]
        return items if any(a is not b for a, b in zip(items, obj, strict=True)) else obj
    return obj


def json_text(obj: Any) -> str:
    """*obj* as JSON text for an output (``lossless``: names that are not
    UTF-8 carried as KEY_bytes); as json.dumps gives it when no string
    holds a surrogate (its escapes are the only place one could show)."""
    text = json.dumps(obj)
    return json.dumps(lossless(obj)) if "\\ud" in text else text


def first_line(text: str) -> str:
    """A message of many lines as one line for a table: its first line
    that is not blank (``printable``), and " …" when more lines follow
    (lines end at a newline: a carriage return alone is escaped)."""
    lines = [line.removesuffix("\r") for line in text.split("\n") if line.strip()]
    if not lines:
        return printable(text.strip())
    return printable(lines[0]) + (" …" if len(lines) > 1 else "")
