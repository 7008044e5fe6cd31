"""Lists of changes that stay readable when a step changes thousands of
files: a directory added or deleted as a whole is one entry (like git's
untracked directories), with a count of what it holds, and a header counts
the changes by kind.

Changes are dicts as the daemon gives them: "path", "kind", and "from",
"dir" (a directory; for D: it was one), "who" where they apply.
"""

from __future__ import annotations

import heapq
import json
import os
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, overload

from ..text import count, quote

KINDS = {
    "A": "added",
    "D": "deleted",
    "M": "modified",
    "R": "renamed",
    "T": "type changed",
    "m": "attributes",
    "t": "times only",
}
# a path whose modification time alone differs: listed only when asked for
# (``StackView.shown``), and counted apart otherwise
TIMES = "t"


class Row(NamedTuple):
    """One change as the net-change computation makes it (``Changes``
    holds them in columns)."""

    path: bytes
    kind: str  # A, D, M, T, R, m or t
    was: bytes | None  # where it came from (R)
    is_dir: bool
    ino: int | None  # the object (None: none)
    who: dict | None = None  # who first made it


class Changes(Sequence[dict]):
    """Changes as the daemon gives them, held in columns -- a row each of
    path, kind, whether a directory, object (ino), where it came from (R,
    held apart) and who first made it (an index into the dicts of the few
    writers) -- and made into dicts as they are read: a layer of 200,000 new
    files is some 30 bytes a change, not a tuple of 170 or a dict of 350.
    A path is held whole, or as a name (the object a journal reading holds
    already) in a directory of a table (``append_in``).  JSON encoders take
    it as a list, some rows at a time (control.encode_pieces)."""

    __slots__ = (
        "names",
        "heads",
        "parents",
        "kinds",
        "dirs",
        "inos",
        "was",
        "who",
        "whos",
        "_who_index",
        "times_only",
    )

    def __init__(self, rows: Iterable[Row] = ()):
        self.names: list[bytes] = []  # the path, or the name in its parent
        self.heads = array("i")  # the parent in ``parents`` (-1: the path is whole)
        self.parents: list[bytes] = []
        self.kinds = bytearray()  # (the kind's letter)
        self.dirs = bytearray()
        self.inos = array("Q")  # (0: none)
        self.was: dict[int, bytes] = {}  # row -> the path it came from
        self.who = array("i")  # row -> its writer in ``whos`` (-1: none)
        self.whos: list[dict] = []
        self._who_index: dict[int, int] = {}  # id(a writer's dict) -> its index
        self.times_only = 0  # the paths left out whose times alone differ (``without_times``)
        for r in rows:
            self.append_in(-1, r.path, r.kind, r.was, r.is_dir, r.ino, r.who)

    def append(
        self,
        path: bytes,
        kind: str,
        was: bytes | None,
        is_dir: bool,
        ino: int | None,
        who: dict | None = None,
    ) -> None:
        """A change at the end: (path, kind, from, is a directory, ino, who)."""
        self.append_in(-1, path, kind, was, is_dir, ino, who)

    def parent(self, path: bytes) -> int:
        """The index of directory *path* for ``append_in``."""
        self.parents.append(path)
        return len(self.parents) - 1

    def append_in(
        self,
        head: int,
        name: bytes,
        kind: str,
        was: bytes | None,
        is_dir: bool,
        ino: int | None,
        who: dict | None = None,
    ) -> None:
        """A change at the end, at *name* in directory *head* (``parent``;
        -1: *name* is the whole path)."""
        i = len(self.names)
        self.names.append(name)
        self.heads.append(head)
        self.kinds.append(ord(kind))
        self.dirs.append(is_dir)
        self.inos.append(ino or 0)
        self.who.append(-1)
        if was is not None:
            self.was[i] = was
        if who is not None:
            self.set_who(i, who)

    def path(self, i: int) -> bytes:
        h = self.heads[i]
        if h < 0:
            return self.names[i]
        p = self.parents[h]
        return p + b"/" + self.names[i] if p else self.names[i]

    def set_who(self, i: int, who: dict) -> None:
        """Row *i* was first made by *who* (a dict held once per writer)."""
        k = self._who_index.get(id(who))
        if k is None or self.whos[k] is not who:
            k = self._who_index[id(who)] = len(self.whos)
            self.whos.append(who)
        self.who[i] = k

    def ino(self, i: int) -> int | None:
        return self.inos[i] or None

    def row(self, i: int) -> Row:
        """Row *i*."""
        k = self.who[i]
        return Row(
            self.path(i),
            chr(self.kinds[i]),
            self.was.get(i),
            bool(self.dirs[i]),
            self.ino(i),
            self.whos[k] if k >= 0 else None,
        )

    def _key(self, i: int) -> bytes:
        return self.path(i) or b"."  # (the root is listed as ".")

    def sort(self) -> None:
        """In the order of the paths (the root's, b"", as "."); stable.
        Each run of rows in one directory (or of whole paths) is sorted in
        place, then the runs are merged: no path is made but those the
        merge compares, no list of every row's index."""
        heads, names, n = self.heads, self.names, len(self.names)
        runs = []
        start = 0
        while start < n:
            h, end = heads[start], start + 1
            while end < n and heads[end] == h:
                end += 1
            key = self._key if h < 0 else names.__getitem__
            self._permute(start, end, sorted(range(start, end), key=key))
            runs.append(range(start, end))
            start = end
        if len(runs) < 2:
            return
        order = array("I", heapq.merge(*runs, key=self._key))
        if all(i == j for i, j in enumerate(order)):
            return
        self._permute(0, n, order)

    def _permute(self, start: int, end: int, order: Sequence[int]) -> None:
        """Rows start..end-1 in *order* (their indices)."""
        if all(i == j for i, j in enumerate(order, start)):
            return
        self.names[start:end] = [self.names[i] for i in order]
        self.heads[start:end] = array("i", (self.heads[i] for i in order))
        self.kinds[start:end] = bytes(self.kinds[i] for i in order)
        self.dirs[start:end] = bytes(self.dirs[i] for i in order)
        self.inos[start:end] = array("Q", (self.inos[i] for i in order))
        self.who[start:end] = array("i", (self.who[i] for i in order))
        if self.was:
            at = {i: j for j, i in enumerate(order, start) if i in self.was}
            self.was = {at.get(i, i): p for i, p in self.was.items()}

    def __len__(self) -> int:
        return len(self.names)

    @overload
    def __getitem__(self, i: int) -> dict: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict]: ...

    def __getitem__(self, i: int | slice) -> dict | list[dict]:
        if isinstance(i, slice):
            return [self._as_dict(k) for k in range(*i.indices(len(self.names)))]
        if i < 0:
            i += len(self.names)
        if not 0 <= i < len(self.names):
            raise IndexError("change index out of range")
        return self._as_dict(i)

    def __iter__(self) -> Iterator[dict]:
        return map(self._as_dict, range(len(self.names)))

    def _as_dict(self, i: int) -> dict:
        c: dict[str, Any] = {"path": _path(self.path(i)), "kind": chr(self.kinds[i])}
        was = self.was.get(i) if self.was else None
        if was is not None:
            c["from"] = os.fsdecode(was)
        if self.dirs[i]:
            c["dir"] = True
        k = self.who[i]
        if k >= 0:
            c["who"] = self.whos[k]
        return c

    def where(self, wanted: Callable[[str, str | None], bool]) -> Changes:
        """The changes whose path (or the path they came from) is *wanted*."""
        out = self.select(
            i
            for i in range(len(self.names))
            if wanted(
                _path(self.path(i)),
                os.fsdecode(self.was[i]) if i in self.was else None,
            )
        )
        out.times_only = self.times_only
        return out

    def without_times(self) -> Changes:
        """These changes but those of a path whose modification time alone
        differs (kind t), counted in ``times_only``."""
        t = ord(TIMES)
        if t not in self.kinds:
            return self
        out = self.select(i for i, k in enumerate(self.kinds) if k != t)
        out.times_only = self.times_only + len(self) - len(out)
        return out

    def select(self, rows: Iterable[int]) -> Changes:
        """The rows *rows* (indices, in order), as a table of their own
        (sharing the directories' paths and the writers)."""
        out = Changes()
        out.parents = self.parents
        for i in rows:
            k = self.who[i]
            out.append_in(
                self.heads[i],
                self.names[i],
                chr(self.kinds[i]),
                self.was.get(i),
                bool(self.dirs[i]),
                self.ino(i),
                self.whos[k] if k >= 0 else None,
            )
        return out


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
