"""Words for people: counts with their nouns, ages, durations."""

from __future__ import annotations

import time


def count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 step', '3 steps', '1 directory' / count(3, 'directory', 'directories')."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


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
