"""Content hashes of the regular files kept whole in the grave.

A file a layer removes or replaces is moved, whole, into ``STORE/grave/<id>``
(same inode: nothing is copied).  Its bytes are hashed so that `cowfs check`
and a rollback notice when they changed in the store — a flipped byte —
instead of putting the file back silently.  The hash (``datahash``: xxh3-128
of the blocks that are not all zeros, with their positions, and the size)
reads only the ranges of the file that hold data: a removed sparse file of
5 TiB holding one byte costs a few system calls, not 5 TiB of zeros.
Entries an older cowfs wrote hold the xxh3-128 of every byte; they are
verified that way (``schema.SUM_FORM_ALL``), reading only the data too.

Off the request path: the handler that moves the file only adds, in the
transaction of its GRAVE record, a *pending* entry (``gravesums``, see
``schema``) with the file's inode, size and mtime and the time of the move.
The mount daemon's ``Hasher`` reads the file later, in a worker thread
(which never touches LMDB), and records the digest in a short transaction
on the daemon's thread, between requests.  It starts on a file once the
mount has been quiet for ``QUIET`` (or the file has waited ``PATIENCE_NS``),
so that a busy mount — an ``rm -rf`` — does not share its disk and CPUs
with it.  Pending files are hashed at the latest at unmount (within
``UNMOUNT_BUDGET``); after a kill -9 they stay
pending — verified by identity only, as before — and the next mount hashes
them.  A file still open in the mount is hashed once it is closed.

The guard: a hash is recorded only if the file is still the one that was
removed, unchanged — same inode, size and mtime, and a ctime no later than
the move (``SLACK_NS``: ctime cannot be set back, so any change made to it
since shows) — and its stat did not change while it was read; otherwise it
is marked *changed* and verified by identity only.  A removed file can
still change legitimately: a program writes to it through a descriptor it
kept open, or through another name (a hard link).  Such changes reach the
daemon, which marks the entry *changed* (``Hasher.changing``) before the
bytes change; a rollback or redo changes them by cowfs's own hand, while
file requests are held off, so a hash read before it is recorded only if
the file's stat is still the one read.  A recorded hash thus always
describes the bytes the undo step will put back; check, rollback and redo
then verify it (``verify``).
Directories, symlinks and special files are verified by identity only (a
directory is removed only when empty; a symlink's target cannot change in
place).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import lmdb
import trio
import xxhash

from ..system import backing
from . import datahash, schema
from .store import Store

log = logging.getLogger(__name__)

SLACK_NS = 1_000_000_000  # the move into the grave follows its record within this
READ_SIZE = 1 << 20
BATCH_FILES = 256  # files per worker-thread call ...
BATCH_BYTES = 64 << 20  # ... and bytes (the daemon's thread records in between)
POLL = 0.05  # seconds between looks for new grave files
QUIET = 0.1  # a file is hashed after this long without requests ...
PATIENCE_NS = 5_000_000_000  # ... or once it was removed this long ago
UNMOUNT_BUDGET = 20.0  # seconds an unmount spends hashing what is left


def read_sum(
    store: Store, gid: int, txn: lmdb.Transaction[bytes] | None = None
) -> schema.GraveSum | None:
    if store.db_sums is None:
        return None
    if txn is None:
        with store.read() as t:
            raw = t.get(schema.u64(gid), db=store.db_sums)
    else:
        raw = txn.get(schema.u64(gid), db=store.db_sums)
    return schema.decode_sum(raw) if raw is not None else None


def _open(store: Store, gid: int) -> int:
    return backing.open_noatime(
        str(gid).encode(),
        os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
        dir_fd=store.grave_fd,
    )


def digest_of(fd: int, stop: Callable[[], bool] | None = None) -> bytes | None:
    """The digest of the file *fd* (``datahash``: what reading costs follows
    the file's data, not its size); None when *stop* said so midway."""
    return datahash.of_file(fd, stop)


def digest_all(fd: int) -> bytes:
    """xxh3-128 of every byte of file *fd*: the digest older cowfs recorded
    (``SUM_FORM_ALL``).  Only the ranges that hold data are read; the
    holes between them are hashed as the zeros they read as."""
    h = xxhash.xxh3_128()
    size = os.fstat(fd).st_size
    at = 0
    for lo, hi in backing.iter_data(fd, size):
        _zeros(h, lo - at)
        for off in range(lo, hi, READ_SIZE):
            data = os.pread(fd, min(READ_SIZE, hi - off), off)
            h.update(data)
            if len(data) < min(READ_SIZE, hi - off):  # (shorter now)
                return h.digest()
        at = hi
    _zeros(h, size - at)
    return h.digest()


_ZEROS = memoryview(bytes(READ_SIZE))


def _zeros(h: xxhash.xxh3_128, n: int) -> None:
    while n > 0:
        h.update(_ZEROS[: min(n, READ_SIZE)])
        n -= READ_SIZE


def verify(store: Store, gid: int, txn: lmdb.Transaction[bytes] | None = None) -> str | None:
    """Why grave object *gid* cannot be put back as it was removed: None
    when its bytes hash as recorded (or no hash was recorded: verified by
    identity only, elsewhere)."""
    s = read_sum(store, gid, txn)
    if s is None or s.state != schema.SUM_HASHED:
        return None
    try:
        fd = _open(store, gid)
    except FileNotFoundError:
        return None  # missing: said by the identity check
    except OSError as e:  # (a symlink in its place)
        return f"grave {gid} is no longer the file that was removed ({e.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"grave {gid} is no longer a regular file"
        found = digest_all(fd) if s.form == schema.SUM_FORM_ALL else digest_of(fd)
        if found == s.digest:
            return None  # (even if it is another inode now: the same bytes)
    finally:
        os.close(fd)
    return (
        f"its {st.st_size} bytes (grave {gid}) do not hash to the digest taken when "
        "it was removed" + (f" ({s.size} bytes then)" if st.st_size != s.size else "")
    )


def _key(st: os.stat_result) -> tuple:
    return st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def hash_pending(
    store: Store, gid: int, s: schema.GraveSum, stop: Callable[[], bool]
) -> tuple[bool, bytes | None]:
    """Hash pending grave file *gid* (in a worker thread: no LMDB here).
    Returns (done, the entry to record instead of the pending one, if
    any): not done when *stop* interrupted it."""
    try:
        fd = _open(store, gid)
    except FileNotFoundError:
        return True, None  # moved out meanwhile: its entry goes with it
    except OSError:  # (a symlink planted in the store, ...)
        return True, schema.encode_sum(s._replace(state=schema.SUM_CHANGED))
    try:
        st = os.fstat(fd)
        if not (
            stat.S_ISREG(st.st_mode)
            and st.st_ino == s.ino
            and st.st_size == s.size
            and st.st_mtime_ns == s.mtime_ns
            and st.st_ctime_ns <= s.time_ns + SLACK_NS
        ):
            return True, schema.encode_sum(s._replace(state=schema.SUM_CHANGED))
        d = digest_of(fd, stop)
        if d is None:
            return False, None
        if _key(os.fstat(fd)) != _key(st):  # changed while it was read
            return True, schema.encode_sum(s._replace(state=schema.SUM_CHANGED))
        return True, schema.encode_sum(
            schema.GraveSum(
                schema.SUM_HASHED, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, d
            )
        )
    finally:
        os.close(fd)


def _sound(raw: bytes) -> schema.GraveSum:
    """A hash entry known to decode (the Hasher takes in no other, and
    writes only what it encoded)."""
    s = schema.decode_sum(raw)
    assert s is not None
    return s


class Hasher:
    """The mount daemon's background pass over pending grave files.

    Everything but the reading runs on the daemon's (trio) thread, so it
    never interleaves with a request handler; the reading runs in a worker
    thread, and what it found is recorded only if the entry is still the
    pending one it read (compare and set), so a file moved out, changed or
    moved back meanwhile is never blessed."""

    def __init__(
        self,
        store: Store,
        busy: Callable[[int], bool] | None = None,
        quiet: Callable[[], float] | None = None,
        exclusive: Callable[[], AbstractContextManager] = contextlib.nullcontext,
        operating: Callable[[], bool] | None = None,
    ):
        self.store = store
        # whether a control operation (a rollback, a redo...) is under way:
        # hashing waits for its end, as it would take turns with it
        self.operating = operating or (lambda: False)
        self.exclusive = exclusive  # (no file request meanwhile)
        self.busy = busy or (lambda ino: False)  # open in the mount: wait until closed
        self.quiet = quiet or (lambda: QUIET)  # seconds since the mount's last request
        self.stop = threading.Event()
        self.deadline: float | None = None
        self.live: dict[int, set[int]] = {}  # inode -> its pending or hashed entries
        self.todo: dict[int, bytes] = {}  # gid -> its pending entry, as read
        self.scanned = 0  # graves below this id were looked at
        self.reload()

    # -- what is in the store ------------------------------------------------------

    def reload(self) -> None:
        """Look at every entry again (after a rollback, redo or commit)."""
        self.live, self.todo, self.scanned = {}, {}, 0
        self._scan()

    def _scan(self) -> None:
        """Take in the entries of graves made since the last look."""
        start, self.scanned = self.scanned, self.store.next_grave
        db = self.store.db_sums
        if db is None:
            return
        with self.store.read() as txn:
            cur = txn.cursor(db=db)
            ok = cur.set_range(schema.u64(start))
            while ok:
                gid, raw = schema.from_u64(cur.key()), bytes(cur.value())
                s = schema.decode_sum(raw)
                if s is not None and s.state != schema.SUM_CHANGED:
                    self.live.setdefault(s.ino, set()).add(gid)
                    if s.state == schema.SUM_PENDING:
                        self.todo[gid] = raw
                ok = cur.next()

    def changing(self, ino: int) -> None:
        """The bytes of object *ino* are about to change through the mount
        (a write, a truncation): if it is also kept in the grave (open after
        its removal, or another name of it), mark its entries changed
        first.  Raises OSError (the request fails) when the store cannot
        take that."""
        if self.store.next_grave != self.scanned:
            self._scan()
        gids = self.live.get(ino)
        if not gids:
            return
        with self.store.write() as w:
            for gid in gids:
                raw = w.grave_sum(gid)
                s = schema.decode_sum(raw) if raw is not None else None
                if s is not None and s.ino == ino and s.state != schema.SUM_CHANGED:
                    w.put_grave_sum(
                        gid, schema.encode_sum(s._replace(state=schema.SUM_CHANGED, digest=b""))
                    )
        for gid in gids:
            self.todo.pop(gid, None)
        del self.live[ino]

    # -- the pass ----------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self.stop.is_set() or (
            self.deadline is not None and time.monotonic() > self.deadline
        )

    def _due(self, s: schema.GraveSum) -> bool:
        """Whether to hash *s* now rather than wait for a pause."""
        if self.operating():
            return False
        return self.quiet() >= QUIET or time.time_ns() - s.time_ns >= PATIENCE_NS

    def _batch(self, everything: bool = False) -> list[tuple[int, bytes]]:
        if self.store.next_grave != self.scanned:
            self._scan()
        batch: list[tuple[int, bytes]] = []
        size = 0
        if not everything and self.operating():
            return batch
        quiet = everything or self.quiet() >= QUIET
        now = time.time_ns()
        for gid, raw in self.todo.items():
            s = _sound(raw)
            if not quiet and now - s.time_ns < PATIENCE_NS:
                # (entries are taken in the order they were made: the rest are
                # younger still -- so a pass costs nothing while files are
                # removed by the thousand, however many wait)
                break
            if not everything and self.busy(s.ino):
                continue
            batch.append((gid, raw))
            size += s.size
            if len(batch) >= BATCH_FILES or size >= BATCH_BYTES:
                break
        return batch

    def _hash(
        self, batch: list[tuple[int, bytes]], everything: bool = False
    ) -> list[tuple[int, bytes, bytes | None]]:
        """In a worker thread.  When requests come, the rest of the batch
        waits (unless it is overdue)."""
        out = []
        for gid, raw in batch:
            s = _sound(raw)
            if not everything and not self._due(s):
                break
            done, new = hash_pending(self.store, gid, s, self._stopping)
            if not done:
                break
            out.append((gid, raw, new))
        return out

    def _record(self, results: list[tuple[int, bytes, bytes | None]]) -> None:
        written = []
        with self.store.write() as w:
            for gid, raw, new in results:
                if new is not None and w.grave_sum(gid) == raw:
                    new = self._still(gid, raw, new)
                    w.put_grave_sum(gid, new)
                    written.append((gid, _sound(new)))
        for gid, raw, _ in results:
            if self.todo.get(gid) == raw:  # (not taken in again since)
                del self.todo[gid]
        for gid, s in written:
            if s.state == schema.SUM_CHANGED:
                self.live.get(s.ino, set()).discard(gid)

    def _still(self, gid: int, raw: bytes, new: bytes) -> bytes:
        """The entry to record for grave file *gid* (pending entry *raw*),
        read as *new*: a hash only if the file is still as it was read.  A
        rollback or redo that ran after the reading (on the daemon's
        thread: file requests, and so ``changing``, were held off) may have
        changed it through another name."""
        s = _sound(new)
        if s.state != schema.SUM_HASHED:
            return new
        st = backing.lstat_at(self.store.grave_fd, str(gid).encode())
        if st is not None and (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) == (
            s.ino,
            s.size,
            s.mtime_ns,
            s.time_ns,  # (the ctime, in a hashed entry)
        ):
            return new
        return schema.encode_sum(_sound(raw)._replace(state=schema.SUM_CHANGED))

    async def _step(self, everything: bool = False) -> bool:
        """Hash and record one batch; False when there was nothing to do."""
        with self.exclusive():
            batch = self._batch(everything)
        if not batch:
            return False
        results = await trio.to_thread.run_sync(self._hash, batch, everything)
        try:
            with self.exclusive():
                self._record(results)
        except OSError as e:  # a full store: the files stay pending
            log.warning("could not record the hashes of removed files: %s", e)
            await trio.sleep(1)
        return True

    async def run(self) -> None:
        """Hash pending grave files as they come, until cancelled (set
        ``stop`` first, so that a batch being read ends soon)."""
        while True:
            if not await self._step():
                await trio.sleep(POLL)

    async def drain(self, seconds: float = UNMOUNT_BUDGET) -> None:
        """At unmount (nothing is open any more): hash what is left, for
        *seconds* at most; the rest stays pending for the next mount."""
        self.stop.clear()
        self.deadline = time.monotonic() + seconds
        try:
            while not self._stopping() and await self._step(everything=True):
                pass
        finally:
            self.deadline = None
        if self.todo:
            log.info(
                "%d removed files are not hashed yet; the next mount hashes them", len(self.todo)
            )
