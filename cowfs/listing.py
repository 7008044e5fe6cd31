"""Lists of changes that stay readable when a step changes thousands of
files: a directory added or deleted as a whole is one entry (like git's
untracked directories), with a count of what it holds, and a header counts
the changes by kind.

Changes are dicts as the daemon gives them: "path", "kind", and "from",
"dir" (a directory; for D: it was one), "who" where they apply.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import overload

from .text import count, quote

KINDS = {
    "A": "added",
    "D": "deleted",
    "M": "modified",
    "R": "renamed",
    "T": "type changed",
    "m": "attributes",
}


class Changes(Sequence[dict]):
    """Changes as the daemon gives them, held as a row each -- (path, kind,
    from, dir, ino, who), paths as bytes -- and made into dicts as they are
    read: a layer of 200,000 new files is 200,000 rows of some 150 bytes,
    not as many dicts of 350.  JSON encoders take it as a list, some rows at
    a time (control.encode_pieces)."""

    __slots__ = ("rows",)

    def __init__(self, rows: list[tuple]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> dict: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict]: ...

    def __getitem__(self, i: int | slice) -> dict | list[dict]:
        if isinstance(i, slice):
            return [_as_dict(r) for r in self.rows[i]]
        return _as_dict(self.rows[i])

    def __iter__(self) -> Iterator[dict]:
        return map(_as_dict, self.rows)

    def where(self, wanted: Callable[[str, str | None], bool]) -> Changes:
        """The changes whose path (or the path they came from) is *wanted*."""
        return Changes(
            [
                r
                for r in self.rows
                if wanted(_path(r[0]), os.fsdecode(r[2]) if r[2] is not None else None)
            ]
        )


class Encoded(str):
    """An item of a list held as its JSON text (made once it is complete: a
    diff entry's text is a third of its dicts), which encoders put in as
    it is (control.encode_pieces)."""

    __slots__ = ()

    @classmethod
    def of(cls, value: object) -> Encoded:
        return cls(json.dumps(value))


def plain_list(items: Sequence) -> list:
    """*items* as a plain list of what its JSON says (offline answers)."""
    return [json.loads(x) if isinstance(x, Encoded) else x for x in items]


def _path(p: bytes) -> str:
    return os.fsdecode(p) if p else "."


def _as_dict(row: tuple) -> dict:
    path, kind, was, is_dir, _, who = row
    c = {"path": _path(path), "kind": kind}
    if was is not None:
        c["from"] = os.fsdecode(was)
    if is_dir:
        c["dir"] = True
    if who is not None:
        c["who"] = who
    return c


WHOLE = ("A", "D")  # the kinds whose directories are taken as a whole
# A directory holding fewer changes is listed in full: a line per path is
# then about as short, and says more.
SMALL = 5


def collapse(changes: list[dict]) -> list[dict]:
    """*changes* with each directory added (or deleted) as a whole standing
    for the changes below it of the same kind: it gets "collapsed":
    {"files": N, "dirs": M}, what it holds (files: anything but a
    directory), and they are left out -- unless it holds fewer than SMALL.
    An entry is taken into the directory above it only when every
    directory between them is a change of the same kind too; others below
    it (a file moved into a new directory: R) stay.  The order is kept."""
    by_path = {c["path"]: c for c in changes if c["kind"] in WHOLE}
    top: dict[str, str] = {}  # path -> the path of the entry it is taken into

    def top_of(path: str) -> str:
        found = top.get(path)
        if found is None:
            kind = by_path[path]["kind"]
            parent = path.rpartition("/")[0]
            above = by_path.get(parent) if parent else None
            found = top_of(parent) if above is not None and above["kind"] == kind else path
            top[path] = found
        return found

    inside: dict[str, dict] = {}
    for path in sorted(by_path, key=lambda p: p.count("/")):  # (shallow first: no deep recursion)
        t = top_of(path)
        if t != path:
            held = inside.setdefault(t, {"files": 0, "dirs": 0})
            held["dirs" if by_path[path].get("dir") else "files"] += 1
    inside = {t: n for t, n in inside.items() if n["files"] + n["dirs"] >= SMALL}
    out = []
    for c in changes:
        if c["kind"] in WHOLE and top[c["path"]] in inside and top[c["path"]] != c["path"]:
            continue
        out.append(c | {"collapsed": inside[c["path"]]} if c["path"] in inside else c)
    return out


def individual_first(changes: list[dict]) -> list[dict]:
    """Single changes first, then the directories taken as a whole."""
    return [c for c in changes if "collapsed" not in c] + [c for c in changes if "collapsed" in c]


def counts(changes: list[dict]) -> dict[str, int]:
    """How many changes of each kind, in the order of KINDS."""
    found: dict[str, int] = {}
    for c in changes:
        found[c["kind"]] = found.get(c["kind"], 0) + 1
    return {k: found[k] for k in [*KINDS, *sorted(found)] if k in found}


def headline(by_kind: dict[str, int]) -> str:
    """'7,231 changes: 7,229 added, 2 modified' (or 'no changes')."""
    total = sum(by_kind.values())
    if not total:
        return "no changes"
    return f"{count(total, 'change')}: " + ", ".join(
        f"{n:,} {KINDS.get(k, k)}" for k, n in by_kind.items()
    )


def held(c: dict) -> str:
    """'  (7,229 files, 812 directories)' for a collapsed directory."""
    inside = c.get("collapsed")
    if inside is None:
        return ""
    parts = [count(inside["files"], "file")] if inside["files"] or not inside["dirs"] else []
    if inside["dirs"]:
        parts.append(count(inside["dirs"], "directory", "directories"))
    return f"  ({', '.join(parts)})"


def line(c: dict) -> str:
    """One change as `status` shows it: 'M a.txt', 'R old -> new',
    'A node_modules/  (7,229 files)'; names quoted (text.quote)."""
    if c["kind"] == "R":
        return f"R {quote(c['from'])} -> {quote(c['path'])}"
    if "collapsed" in c:
        return f"{c['kind']} {quote(c['path'] + '/')}{held(c)}"
    return f"{c['kind']} {quote(c['path'])}"


def cut(changes: list, limit: int | None) -> tuple[list, str | None]:
    """The first *limit* entries, and the line that says how many more."""
    if not limit or len(changes) <= limit:
        return changes, None
    return changes[:limit], f"... and {len(changes) - limit:,} more"
