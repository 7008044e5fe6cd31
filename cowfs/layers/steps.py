"""Taking the undo steps of a rollback a batch at a time (see
``redo.RedoInverses``), here or in a helper process.

While the helper takes the steps of one batch, the rollback plans the next
and keeps what a redo of it needs (``RedoInverses.batch_ahead``).  Both mostly
wait on the disk.  Two threads of one interpreter would take turns at
every system call, with a wake-up across CPUs each time; two processes do
not.  The mount daemon forks the helper when it mounts (before its FUSE
engine and control server start their threads, with little memory to
share); a rollback without one takes its steps itself.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, Pipe
from typing import Any, NamedTuple

from ..storage import schema
from ..storage.store import Store
from ..system import backing
from . import redo
from .undo import Touched, Undoer, describe

log = logging.getLogger(__name__)


class Outcome(NamedTuple):
    """What one step of a batch did (sent from the helper as a plain tuple)."""

    moved: bool  # whether it moved its object into the grave or out of it
    failure: str | None
    emptied: tuple[bytes, ...]  # where it left nothing (see ``RedoInverses.emptied_by``)
    # whether it failed in a way that halts the rollback (see ``halts``): then
    # it is the last outcome of its batch, the steps after it were not taken
    halted: bool


Keeps = list[tuple[int, int] | None]

# Errors after which a rollback does not take the next step (an undo step
# out of its order would not be undone the same way): it stops, keeping
# what is left, to be taken by the same command once the cause is gone.
HALTING = frozenset(
    (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOMEM, errno.EMFILE, errno.ENFILE)
)


def halts(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in HALTING


def wants_room(e: BaseException) -> bool:
    """A halt a full disk caused (removing files may cure it)."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def removes_next(records: Sequence[tuple[int, schema.Record]], i: int, skipped: redo.Skip) -> bool:
    """Whether records[i], a RENAME, is one whose undo step puts a file back
    where the next record, the CREATE that made it there, has it removed
    (applied): a file written under a temporary name and renamed into
    place (see ``Undoer.put_back_and_remove``)."""
    if i + 1 == len(records):
        return False
    seq, nxt = records[i + 1]
    return redo.removes_source(records[i][1], nxt) and not skipped(seq, nxt)


def batch_steps(
    undo: Undoer,
    batch: Sequence[tuple[int, schema.Record]],
    keeps: Keeps,
    planned: dict[int, os.stat_result],
) -> list[Outcome]:
    """Take the undo steps of a batch, in order (*keeps*: what `RedoInverses.batch`
    returned for it; *planned*: `RedoInverses.planned` then).  A RENAME and the
    CREATE after it that made the file at its source go as one (see
    ``Undoer.put_back_and_remove``), with the CREATE's inverse."""
    out: list[Outcome] = []
    taken: schema.Rename | None = None  # a RENAME step taken with the CREATE after it
    for k, (_, rec) in enumerate(batch):
        moved, failure, halt = False, None, False
        emptied: tuple[bytes, ...] = ()
        try:
            if taken is not None:
                moved, emptied, taken = True, (taken.src, taken.dst), None
            elif (
                isinstance(rec, schema.Rename)
                and removes_next(batch, k, lambda *_: False)
                and keeps[k + 1] is not None
                and undo.put_back_and_remove(rec, keeps[k + 1], planned.get(batch[k + 1][0]))
            ):
                taken = rec
            else:
                moved = undo.apply(rec, keeps[k])
        except Exception as e:  # report by name, keep going (unless it halts)
            failure, halt = f"{describe(rec)}: {e}", halts(e)
        out.append(Outcome(moved, failure, emptied, halt))
        if halt:
            break
    return out


class Helper:
    """The helper process of a mount daemon (see the module).  It reads
    nothing from the store: a batch with a CHUNK step (whose pre-image is
    there) is taken by the rollback itself.  It looks up directories
    through a resolver of its own, emptied at the start of each rollback
    and whenever a step taken outside it moved a directory, and sends back
    what its steps changed, for the mount.  Should it be lost, its batch is
    taken again by the rollback, each step looking afresh (applied again,
    its steps change nothing they did), and the rollbacks after it take
    their steps themselves."""

    def __init__(self, store: Store, resolver: backing.Resolver):
        mine, theirs = Pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the helper; what it does is checked by the daemon)
            try:
                mine.close()
                _serve(theirs, store, resolver)
            finally:
                os._exit(0)
        theirs.close()
        self.conn: Connection | None = mine
        self.pid = pid

    @property
    def alive(self) -> bool:
        return self.conn is not None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()  # (it ends when it reads the end)
            self.conn = None
            os.waitpid(self.pid, 0)

    def send(self, message: Any) -> bool:
        try:
            assert self.conn is not None
            self.conn.send(message)
            return True
        except OSError as e:
            self._lost(e)
            return False

    def receive(self) -> Any:
        try:
            assert self.conn is not None
            return self.conn.recv()
        except (OSError, EOFError) as e:
            self._lost(e)
            return None

    def _lost(self, e: Exception) -> None:
        log.warning("the rollback helper process is lost (%s); rollbacks go on without it", e)
        self.close()


class BatchRunner:
    """The batches of one rollback, taken by the helper if there is one."""

    def __init__(self, undo: Undoer, helper: Helper | None):
        self.undo = undo
        self.helper = helper if helper is not None and helper.alive else None
        self.generation: int | None = None  # the resolver's, at the last batch sent

    def run(
        self,
        batch: Sequence[tuple[int, schema.Record]],
        keeps: Keeps,
        planned: dict[int, os.stat_result],
        meanwhile: Callable[[], Any],
    ) -> tuple[list[Outcome], Any, Exception | None]:
        """`batch_steps` of *batch*, in the helper if there is one, and
        *meanwhile*() here.  Returns the steps' outcomes, what *meanwhile*
        returned and the exception it raised."""
        h = self.helper
        sent = h is not None and h.alive and not any(isinstance(r, schema.Chunk) for _, r in batch)
        if sent:
            assert h is not None
            r = self.undo.r
            fresh = self.generation != r.generation  # (the first batch, or a directory moved)
            self.generation = r.generation
            # (plain tuples: pickled several times faster)
            sent = h.send(
                (
                    "batch",
                    fresh,
                    [(seq, rec.kind, tuple(rec)) for seq, rec in batch],
                    keeps,
                    {seq: tuple(st) for seq, st in planned.items()},
                )
            )
        result, error, reply = None, None, None
        try:  # (taken first without the helper, too: it may, and the crash tests see it)
            result = meanwhile()
        except Exception as e:
            error = e
        finally:
            if sent:  # (its answer is taken whatever happens here)
                assert h is not None
                reply = h.receive()
        if not sent:
            outcomes = batch_steps(self.undo, batch, keeps, planned)
        elif reply is None:
            # (lost: each step looks again, as what the plan saw may have moved)
            outcomes = batch_steps(self.undo, batch, keeps, {})
            _touched_by(batch, keeps, self.undo)
        else:
            plain, touched = reply
            outcomes = [Outcome._make(o) for o in plain]
            self.undo.touched.merge(touched)
        return outcomes, result, error

    def prints(self, locs: list[bytes]) -> Callable[[], list[tuple[bytes, bytes]]]:
        """Start taking the fingerprints of *locs* (``redo.fingerprints``),
        in the helper if there is one; returns what gives them."""
        h = self.helper
        if h is not None and h.alive and h.send(("prints", locs)):
            return lambda: h.receive() or self._prints(locs)
        return lambda: self._prints(locs)

    def _prints(self, locs: list[bytes]) -> list[tuple[bytes, bytes]]:
        with self.undo.r.reading():
            return redo.fingerprints(self.undo.r, locs)


def _serve(conn: Connection, store: Store, resolver: backing.Resolver) -> None:  # pragma: no cover
    """The helper process: take the batches *conn* brings until it ends."""
    r = backing.Resolver(resolver.rootfd, resolver.grave_fd)
    lo = 3  # (the mount's fds, the store's, the nodes': not for it)
    for fd in sorted({conn.fileno(), r.rootfd, r.grave_fd}):
        os.closerange(lo, fd)
        lo = fd + 1
    os.closerange(lo, os.sysconf("SC_OPEN_MAX"))
    undo = Undoer(store, r)
    with r.acting():
        while True:
            try:
                what, *message = conn.recv()
            except EOFError:
                return
            if what == "prints":
                r.moved()  # (looked up afresh)
                conn.send(redo.fingerprints(r, *message))
                continue
            fresh, packed, keeps, stats = message
            if fresh:
                r.moved()
            undo.touched = Touched()
            batch = [(seq, schema.RECORD_TYPES[kind](*fields)) for seq, kind, fields in packed]
            planned = {seq: os.stat_result(st) for seq, st in stats.items()}
            outcomes = [tuple(o) for o in batch_steps(undo, batch, keeps, planned)]
            conn.send((outcomes, undo.touched))


def _touched_by(batch: Sequence[tuple[int, schema.Record]], keeps: Keeps, undo: Undoer) -> None:
    """What the steps of *batch* may have changed, for the mount, when what
    they did is not known (the helper that took them was lost): every name
    they act on and every object, and each object's move, if it is where
    its step moves it."""
    t = undo.touched
    for (_, rec), keep in zip(batch, keeps, strict=True):
        for loc in redo.record_locs(rec):  # type: ignore[arg-type]
            undo._entry_at(loc)
        ino, to = schema.restores(rec), None
        if isinstance(rec, schema.Rename):
            to = rec.src
        elif isinstance(rec, schema.Grave):
            to = rec.path
        elif isinstance(rec, schema.Create | schema.Link) and keep is not None:
            # (with the RENAME before it, if they went as one)
            ino, to = keep[1], schema.grave_loc(keep[0])
        if ino is None:
            continue
        t.objects.add(ino)
        if to is None:
            continue
        gid = schema.grave_id(to)
        if gid is not None:
            st = undo.r.lstat(to)
            if st is not None and st.st_ino == ino:
                t.moves.append((ino, 0, str(gid).encode()))
            continue
        try:
            with undo.r.at(to) as (d, n):
                st = backing.lstat_at(d, n)
                if st is not None and st.st_ino == ino:
                    t.moves.append((ino, os.fstat(d).st_ino, n))
        except OSError:
            continue
