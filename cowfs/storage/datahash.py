"""Content digests that cost what a file holds, not the size it claims.

A file can be 5 TiB long and hold one byte (sparse): read whole, it is
5 TiB of zeros.  The digest here reads only the ranges that hold data
(SEEK_DATA/SEEK_HOLE, ``backing.iter_data``; for a past version of a file:
those of the live file and the chunks recorded of it) and hashes a
canonical form of the file's logical content that no layout of holes
changes (``FORM``):

    xxh3-128( b"cowfs-data-1\\0" + u64 size + D + R )

The content is cut into 4 KiB blocks (the last one may be shorter); a block
that is all zeros -- a hole, zeros written, preallocated space -- adds
nothing.  D is the xxh3-128 digest of the bytes of the other blocks, in
order; R the xxh3-128 digest of their maximal runs, each as u64 first block
and u64 number of blocks, in order (integers big-endian).  The size, the
runs and the bytes give back the content, so two contents share a digest
only by an xxh3 collision; the same content hashes the same wherever it
lives (a grave file, a live file, a past version laid over by chunks) and
however its zeros are stored.

Reading costs the data ranges (aligned out to whole blocks), one ``READ`` at
a time: memory does not grow with the file or its number of extents.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Iterator

import xxhash

from ..system import backing

FORM = b"cowfs-data-1\0"
BLOCK = 4096
READ = 1 << 20
_ZERO_BLOCK = bytes(BLOCK)
_ZERO_READ = bytes(READ)
_U64 = struct.Struct(">Q")
_RUN = struct.Struct(">QQ")


def _zeros(n: int) -> bytes:
    return _ZERO_READ if n == READ else _ZERO_READ[:n] if n < READ else bytes(n)


def _nonzero(data: bytes) -> Iterator[tuple[int, int]]:
    """The runs [lo, hi) of *data* made of blocks that are not all zeros
    (*data* begins on a block; its end may cut the last block short)."""
    n = len(data)
    if data == _zeros(n):
        return
    full = n - n % BLOCK
    if data.find(_ZERO_BLOCK, 0, full) < 0:  # (no whole zero block: one run)
        if full < n and data[full:] == _zeros(n - full):
            if full:
                yield 0, full
            return
        yield 0, n
        return
    start = -1
    for i in range(0, n, BLOCK):
        end = min(i + BLOCK, n)
        if data[i:end] == (_ZERO_BLOCK if end - i == BLOCK else _zeros(end - i)):
            if start >= 0:
                yield start, i
                start = -1
        elif start < 0:
            start = i
    if start >= 0:
        yield start, n


class Digest:
    """The digest of a content of *size* bytes, fed its ranges in order
    (what is not fed reads as zeros)."""

    def __init__(self, size: int):
        self.size = size
        self._data = xxhash.xxh3_128()
        self._runs = xxhash.xxh3_128()
        self._first = -1  # the open run of non-zero blocks: its first block ...
        self._end = -1  # ... and the block after it
        self._pos = 0  # nothing may be fed below this
        self.read = 0  # bytes fed

    def update(self, off: int, data: bytes) -> None:
        """The content's bytes at *off* (a multiple of BLOCK, at or after
        the end of what was fed before; *data* ends on a block or at the
        size)."""
        if off % BLOCK or off < self._pos or off + len(data) > self.size:
            raise ValueError("ranges fed out of order, unaligned or past the size")
        self._pos = off + len(data)
        self.read += len(data)
        view = memoryview(data)
        for lo, hi in _nonzero(data):
            first = (off + lo) // BLOCK
            if first != self._end:
                self._close()
                self._first = first
            self._end = -(-(off + hi) // BLOCK)
            self._data.update(view[lo:hi])

    def _close(self) -> None:
        if self._first >= 0:
            self._runs.update(_RUN.pack(self._first, self._end - self._first))
        self._first = self._end = -1

    def digest(self) -> bytes:
        self._close()
        return xxhash.xxh3_128_digest(
            FORM + _U64.pack(self.size) + self._data.digest() + self._runs.digest()
        )

    def hexdigest(self) -> str:
        return self.digest().hex()


def aligned(ranges: Iterable[tuple[int, int]], size: int) -> Iterator[tuple[int, int]]:
    """*ranges* (sorted by start, overlapping or not) widened to whole
    blocks, cut at *size* and merged."""
    lo = hi = -1
    for a, b in ranges:
        a, b = a - a % BLOCK, min(size, -(-b // BLOCK) * BLOCK)
        if a >= b:
            continue
        if a <= hi:
            hi = max(hi, b)
            continue
        if hi > lo:
            yield lo, hi
        lo, hi = a, b
    if hi > lo:
        yield lo, hi


def within(ranges: Iterable[tuple[int, int]], limit: int) -> list[tuple[int, int]] | None:
    """*ranges* as a list, or None once they hold more than *limit* bytes
    (looked at no further)."""
    out, total = [], 0
    for lo, hi in ranges:
        total += hi - lo
        if total > limit:
            return None
        out.append((lo, hi))
    return out


def of_ranges(
    read: Callable[[int, int], bytes],
    size: int,
    ranges: Iterable[tuple[int, int]],
    stop: Callable[[], bool] | None = None,
) -> bytes | None:
    """The digest of a content of *size* bytes that may be other than zero
    only within *ranges* (sorted by start), read with *read(offset,
    length)*; None when *stop* said so midway.  A short read (the file is
    shorter now) reads as zeros."""
    d = Digest(size)
    for lo, hi in aligned(ranges, size):
        for off in range(lo, hi, READ):
            if stop is not None and stop():
                return None
            n = min(READ, hi - off)
            data = read(off, n)
            if len(data) < n:
                data += bytes(n - len(data))
            d.update(off, data)
    return d.digest()


def of_file(fd: int, stop: Callable[[], bool] | None = None) -> bytes | None:
    """The digest of the regular file open at *fd* (its size now); None
    when *stop* said so midway."""
    size = os.fstat(fd).st_size
    return of_ranges(lambda off, n: os.pread(fd, n, off), size, backing.iter_data(fd, size), stop)


def of_bytes(data: bytes) -> bytes:
    """The digest of *data* (what ``of_file`` gives for a file holding it)."""
    return of_ranges(lambda off, n: data[off : off + n], len(data), [(0, len(data))]) or b""
