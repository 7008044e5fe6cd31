"""Ranges of zeros: what a CHUNK record with an empty digest spanning many
chunks says (see ``schema.Chunk``), kept so that asking whether a chunk lies
in one costs a binary search, whatever the number of chunks they span.

A layer records each chunk of an object at most once, but a layer merged
into the one below (a commit) keeps both layers' records: a range of the
upper one may overlap chunks (or ranges) the lower one recorded.  The older
record holds the state at the start and wins -- a rollback applies it last;
a reading of the journal keeps the first record of each chunk -- so ranges
here may overlap, and ``Zeros`` answers for their union.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator


class Zeros:
    """A union of byte ranges [lo, hi), possibly overlapping."""

    __slots__ = ("starts", "ends", "reach")

    def __init__(self) -> None:
        self.starts: list[int] = []  # (sorted)
        self.ends: list[int] = []  # the end of each range, in the same order
        self.reach: list[int] = []  # the furthest end of the ranges up to each

    def __bool__(self) -> bool:
        return bool(self.starts)

    def __len__(self) -> int:
        return len(self.starts)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Zeros) and list(self.union()) == list(other.union())

    def __repr__(self) -> str:
        return f"Zeros({list(self.union())})"

    def copy(self) -> Zeros:
        z = Zeros()
        z.starts, z.ends, z.reach = list(self.starts), list(self.ends), list(self.reach)
        return z

    def add(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        starts = self.starts
        i = bisect.bisect_right(starts, lo)
        starts.insert(i, lo)
        self.ends.insert(i, hi)
        reach = self.reach
        reach.insert(i, max(hi, reach[i - 1]) if i else hi)
        # (the ranges after it reach at least as far now; appending, the
        # usual case, stops at once)
        for j in range(i + 1, len(reach)):
            if reach[j] >= reach[j - 1]:
                break
            reach[j] = reach[j - 1]

    def until(self, pos: int) -> int:
        """Where the zeros covering *pos* end (*pos* itself: none do)."""
        i = bisect.bisect_right(self.starts, pos) - 1
        if i >= 0 and self.reach[i] > pos:
            return self.reach[i]
        return pos

    def covers(self, pos: int) -> bool:
        return self.until(pos) > pos

    def next_start(self, pos: int) -> int | None:
        """The first start of a range after *pos* (None: none)."""
        i = bisect.bisect_right(self.starts, pos)
        return self.starts[i] if i < len(self.starts) else None

    def union(self, lo: int = 0, hi: int = 1 << 64) -> Iterator[tuple[int, int]]:
        """The disjoint ranges the union makes within [lo, hi), in order
        (each costs a binary search: their number, not their size)."""
        pos = lo
        while pos < hi:
            end = self.until(pos)
            if end > pos:
                yield pos, min(end, hi)
                pos = end
                continue
            nxt = self.next_start(pos)
            if nxt is None:
                return
            pos = nxt

    def gaps(self, lo: int, hi: int) -> Iterator[tuple[int, int]]:
        """The ranges within [lo, hi) that no range covers, in order."""
        pos = lo
        for a, b in self.union(lo, hi):
            if a > pos:
                yield pos, a
            pos = b
        if pos < hi:
            yield pos, hi


class ChunkMap:
    """The pre-images the records since a time T hold of one object's
    chunks, the first record of each chunk winning (it holds the state at
    T): ``one``, chunk -> (length, digest) of the records of one chunk,
    and ``zeros``, the ranges records of zeros span (bytes).  A record of
    one chunk that a range recorded before it covers says nothing; a range
    recorded after records of some of its chunks leaves those theirs."""

    __slots__ = ("C", "one", "zeros")

    def __init__(self, chunk_size: int):
        self.C = chunk_size
        self.one: dict[int, tuple[int, bytes]] = {}
        self.zeros = Zeros()

    def __bool__(self) -> bool:
        return bool(self.one) or bool(self.zeros)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChunkMap) and (self.C, self.one, self.zeros) == (
            other.C,
            other.one,
            other.zeros,
        )

    def __repr__(self) -> str:
        return f"ChunkMap({self.one}, {self.zeros})"

    def add(self, k: int, length: int, digest: bytes) -> None:
        """A record of chunk *k* (of zeros over *length* bytes when
        *digest* is empty), read after those added so far."""
        C = self.C
        if digest or length <= C:
            if k not in self.one and not self.zeros.covers(k * C):
                self.one[k] = (length, digest)
        else:
            self.zeros.add(k * C, k * C + length)

    def get(self, k: int) -> tuple[int, bytes] | None:
        """(length, digest) of chunk *k*'s pre-image (an empty digest:
        zeros), or None when no record holds it."""
        got = self.one.get(k)
        if got is not None:
            return got
        lo = k * self.C
        end = self.zeros.until(lo)
        return (min(self.C, end - lo), b"") if end > lo else None

    def __contains__(self, k: int) -> bool:
        return k in self.one or self.zeros.covers(k * self.C)

    def covers_all(self, n: int) -> bool:
        """Whether records hold every chunk below *n* (at a cost that
        follows the records, not *n*)."""
        C, one, zeros = self.C, self.one, self.zeros
        if len(one) + len(zeros) == 0 and n > 0:
            return False
        k = 0
        while k < n:
            if k in one:
                k += 1
                continue
            end = zeros.until(k * C)
            if end <= k * C:
                return False
            k = -(-end // C)
        return True

    def spans(self, size: int) -> list[tuple[int, int]]:
        """The byte ranges below *size* that records hold, merged, in order."""
        C = self.C
        out: list[tuple[int, int]] = []
        spans = sorted(
            [(k * C, min(size, k * C + C)) for k in self.one if k * C < size]
            + list(self.zeros.union(0, size))
        )
        for lo, hi in spans:
            if out and lo <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], hi))
            else:
                out.append((lo, hi))
        return out

    def zero_spans(self, size: int) -> Iterator[tuple[int, int]]:
        """The ranges below *size* that records of zeros spanning chunks
        hold (records of one chunk are in ``one``), where no earlier record
        of one chunk says otherwise."""
        C = self.C
        singles = sorted(self.one)
        for lo, hi in self.zeros.union(0, size):
            pos = lo
            i = bisect.bisect_left(singles, -(-lo // C))
            while i < len(singles) and singles[i] * C < hi:
                k = singles[i]
                if k * C > pos:
                    yield pos, k * C
                pos = max(pos, k * C + C)
                i += 1
            if pos < hi:
                yield pos, min(hi, size)
