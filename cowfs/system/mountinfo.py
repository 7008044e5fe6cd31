"""The mount table as /proc/self/mountinfo lists it (below ``mounts`` and
``trust``, which both read it)."""

from __future__ import annotations

from typing import NamedTuple


def _unescape(field: str) -> str:
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


class Mount(NamedTuple):
    """One line of /proc/self/mountinfo."""

    id: int
    dev: str  # "major:minor" of its superblock
    mountpoint: str
    fstype: str
    source: str
    options: str  # the superblock's options (user_id=... for FUSE)


def mounts() -> list[Mount]:
    """The mount table, in mount order."""
    for _ in range(3):
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
        out, whole = _parsed(text)
        if whole:
            break
        # (a line came out cut short while the table changed under the
        # read -- seen while a killed daemon's mount was going: read again)
    return out


_LAST: list[tuple[str, list[Mount]]] = []  # (the last table read, parsed)


def _parsed(text: str) -> tuple[list[Mount], bool]:
    """parse_mountinfo, kept for a table read again unchanged."""
    last = _LAST[:1]
    if last and last[0][0] == text:
        return list(last[0][1]), True
    out, whole = parse_mountinfo(text)
    if whole:
        _LAST[:] = [(text, out)]
    return list(out), whole


def parse_mountinfo(text: str) -> tuple[list[Mount], bool]:
    """The mounts *text* lists, and whether every line was whole."""
    out, whole = [], True
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(" "), right.split(" ")
        if len(fields) < 5 or len(rest) < 2 or not fields[0].isdigit():
            whole = False
            continue
        out.append(
            Mount(
                int(fields[0]),
                fields[2],
                _unescape(fields[4]),
                rest[0],
                _unescape(rest[1]),
                rest[2] if len(rest) > 2 else "",
            )
        )
    return out, whole
