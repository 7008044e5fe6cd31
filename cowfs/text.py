"""Words for people: counts with their nouns."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 step', '3 steps', '1 directory' / count(3, 'directory', 'directories')."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
