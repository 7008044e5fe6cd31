"""The file part of a rollback: the undo steps of the records of the rolled
back layers, last first, and the end of it -- the layers dropped (parked,
for a redo) and what a redo needs sealed -- or, when not every step could
be taken, the layers kept with the steps left.

One `Rollback` runs one (resumable) file part.  Its concerns, one method
each: a step (`_step`), a batch of steps that keep what a redo needs,
taken by the helper process while the next batch is planned (`_batch`),
what the redo keeps of each step (`_redo_keeps`, `_done`) and giving that
up (`_give_up_redo`: a full disk, an error), records it cannot apply (a
damaged record, a corrupt pre-image: `_pass_over`), making room on a full
disk (`_make_room`), stopping (`_stop`, `_stopped`), and the seal
(`_drop_and_seal`).  The order of what is written is that of the pending
record (cowfs/layers/pending.py): the steps are taken before their records go,
so a rollback killed anywhere is finished by the same one, resumed.
"""

from __future__ import annotations

import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..storage import schema
from ..storage.store import Layer, Store
from ..system import backing, progress
from ..text import count, human_size
from . import fsck, pending, redo, steps
from .stackview import StackView
from .undo import Touched, Undoer, describe


@dataclass
class RollbackReport:
    dropped: list[int] = field(default_factory=list)
    applied: int = 0
    failures: list[str] = field(default_factory=list)
    touched: Touched = field(default_factory=Touched)
    top: int = 0
    restored: list[int] = field(default_factory=list)  # (a redo)
    # a rollback that could not take every step: why, how many steps were
    # kept (not taken, still recorded), the free space they need
    stopped: str | None = None
    kept: int = 0
    needs: int = 0

    def to_dict(self) -> dict:
        d = {
            "dropped": self.dropped,
            "applied": self.applied,
            "failures": self.failures,
            "top": self.top,
        }
        if self.stopped is not None:
            d |= {"stopped": self.stopped, "kept": self.kept, "needs": self.needs}
        return d | {"restored": self.restored} if self.restored else d


@dataclass(frozen=True)
class Acting:
    """How the files of one group operation are put back: with the capture
    filter, what the mount is told, the helper process and the progress
    board (the session's, as they are when the operation runs)."""

    # the capture filter ((path, is_dir) -> bool), if any
    ignored: Callable[[bytes | Callable[[], bytes], bool], bool] | None = None
    # told the inodes of objects a rollback removed to make room (their
    # blocks are freed once nothing holds them)
    on_removed: Callable[[list[int]], None] | None = None
    helper: steps.Helper | None = None  # (the mount daemon's: see `steps`)
    board: progress.Board = progress.LOCAL  # where a rollback notes how far it has got


class Files(Protocol):
    """What a rollback needs of the layers' files (``LayerFiles``): the
    store, the tree's resolver, the stack's views, and what it asks of
    them."""

    store: Store
    resolver: backing.Resolver
    view: StackView

    def ensure_base(self) -> Layer: ...

    def discard_redo(self, reason: str, fallback: bool = False) -> None: ...


# (seq, record, whether its step moved its object into the grave or out of it)
Taken = tuple[int, schema.Record, bool]


class Rollback:
    """The file part of the rollback down to layer *to*, of the layers of
    *files*, acting as *acting* says (the capture filter, the helper, ...)."""

    def __init__(
        self,
        files: Files,
        acting: Acting,
        to: int,
        skip_damaged: bool,
        report: RollbackReport,
    ):
        self.files = files
        self.store: Store = files.store
        self.to = to
        self.skip_damaged = skip_damaged
        self.report = report
        self.board = acting.board
        self.on_removed = acting.on_removed
        self.layers = [layer for layer in self.store.layers() if layer.id >= to]
        undone = {layer.id for layer in self.layers}
        seg = redo.segment(self.store)  # (the changes since a rollback that can be redone)
        if seg is not None:
            undone.add(seg)
        self.undo = Undoer(self.store, files.resolver, report.touched, acting.ignored, undone)
        # what a redo needs, kept as the steps are taken (None: given up)
        self.keeper = (
            redo.RedoInverses(self.store, files.resolver) if redo.building(self.store, to) else None
        )
        self.runner = steps.BatchRunner(self.undo, acting.helper)
        self.records: list[tuple[int, schema.Record]] = []
        self.i = 0  # the record whose step is next
        # An object with a corrupt or missing pre-image is skipped as a
        # whole (left as it is now), never restored in part.
        self.unrestorable: dict[int, str] = {}
        self.known: set[int] = set()  # damaged records whose object is known
        self.reported: set[int] = set()  # objects whose unrestorable step was reported
        self.kept: list[tuple[int, schema.Record]] = []  # left in the store, not applied
        # directories whose names a kept step acts on (see ``_again``)
        self.stuck_dirs: set[int] = set()
        self.stopped: str | None = None  # why the rollback stopped, and where
        self.room = False  # whether it stopped for want of room
        self.early: set[int] = set()  # seqs taken ahead of their turn, to make room
        self.room_made_at = -1
        self.ahead: steps.Keeps | None = None  # what the batch at i keeps, kept meanwhile
        self.paired = -1  # the seq of a step taken with the one before it

    def run(self) -> RollbackReport:
        if self.layers:
            self.records = self.files.view.records_from(self.layers[0].start)
            self.board.start(len(self.records))
            self.unrestorable, self.known = fsck.unrestorable(self.store, self.records)
            while self.i < len(self.records) and self.stopped is None:
                if not self._next():
                    break
            if self.stopped is not None:
                self.kept += [
                    (seq, rec) for seq, rec in self.records[self.i :] if seq not in self.early
                ]
        if self.stopped is not None or self.kept:
            if self.keeper is not None:  # (the steps it held were taken: their records go)
                self._give_up_redo(RuntimeError("the rollback left steps undone"))
            return self._stopped()
        return self._drop_and_seal()

    def _skipped(self, seq: int, rec: schema.Record) -> bool:
        return (
            isinstance(rec, schema.Damaged)
            or schema.restores(rec) in self.unrestorable
            or seq in self.early
        )

    # -- the loop ---------------------------------------------------------------------

    def _next(self) -> bool:
        """Take the step (or the batch of steps) at records[i]; False: the
        rollback cannot go on."""
        seq, rec = self.records[self.i]
        if seq in self.early:
            self.i += 1
            return True
        keeps = self._redo_keeps(seq, rec)
        if self.keeper is not None and len(keeps) > 1:
            self._batch(self.keeper, keeps)
            return True
        return self._step(seq, rec, keeps)

    def _redo_keeps(self, seq: int, rec: schema.Record) -> steps.Keeps:
        """Keep what a redo needs of the steps from i on (a batch of them,
        planned while the batch before ran, or one): what each keeps."""
        keeps: steps.Keeps = [None]
        if self.keeper is not None and not self._skipped(seq, rec):
            try:
                keeps = self.ahead or self.keeper.batch(self.records, self.i, self._skipped)
            except Exception as e:
                # no room to keep it (or no way): the rollback goes on
                self._give_up_redo(e)
                keeps = [None]
            self.ahead = None
        return keeps

    def _batch(self, keeper: redo.RedoInverses, keeps: steps.Keeps) -> None:
        """The steps of a batch that keeps what a redo needs, taken (by the
        helper, if there is one) while the next batch is planned."""
        i = self.i
        batch = self.records[i : i + len(keeps)]
        undone, self.ahead, error = self.runner.run(
            batch,
            keeps,
            keeper.planned,
            lambda: keeper.batch_ahead(self.records, i + len(keeps), self._skipped),
        )
        halt = next((k for k, out in enumerate(undone) if out.halted), None)
        halted = undone[halt].failure if halt is not None else None
        if halt is not None:
            # the steps from there on are taken one by one (making
            # room first), without keeping what a redo needs
            undone, batch = undone[:halt], batch[:halt]
        taken: list[Taken] = []
        for (seq, rec), out in zip(batch, undone, strict=True):
            if out.failure is not None:
                self._failed(seq, rec, out.failure)
                continue
            self.report.applied += 1
            if out.emptied:
                keeper.emptied_by(seq, *out.emptied)
            if self._again(seq, rec):
                self.kept.append((seq, rec))
                self.board.step(1)
                continue
            taken.append((seq, rec, out.moved))
        self._done(taken)
        self.i += len(batch)
        if halted is not None and self.keeper is not None:
            self._give_up_redo(RuntimeError(halted))
        if error is not None and self.keeper is not None:
            self._give_up_redo(error)
            self.ahead = None
        if self.keeper is None:
            self.ahead = None

    def _step(self, seq: int, rec: schema.Record, keeps: steps.Keeps) -> bool:
        """One step, taken here; False: the rollback cannot go on."""
        ino = schema.restores(rec)
        moved = False
        try:
            if isinstance(rec, schema.Damaged) or ino in self.unrestorable:
                self._pass_over(seq, rec, ino)
                self.i += 1
                return True
            moved = self._take(seq, rec, keeps)
        except Exception as e:  # report by name, keep going
            if steps.halts(e):
                return self._halted(e, rec)
            self._failed(seq, rec, f"{describe(rec)}: {e}")
            self.i += 1
            return True
        if self._again(seq, rec):
            self.kept.append((seq, rec))
            self.board.step(1)
            self.i += 1
            return True
        try:
            self._done([(seq, rec, moved)])
        except OSError as e:  # (taken, but still recorded: taken again when resumed)
            self._stop(f"the store: {e.strerror or e}")
            self.room = steps.wants_room(e)
            return False
        self.i += 1
        return True

    def _take(self, seq: int, rec: schema.Record, keeps: steps.Keeps) -> bool:
        """The undo step of *rec*; whether it moved its object into the
        grave or out of it."""
        if seq == self.paired:  # (taken with the RENAME before it)
            self.report.applied += 1
            return True
        if (
            self.keeper is None
            and isinstance(rec, schema.Rename)
            and steps.removes_next(self.records, self.i, self._skipped)
            and self.undo.put_back_and_remove(rec, None)
        ):
            self.paired = self.records[self.i + 1][0]
            self.report.applied += 1
            return False
        moved = self.undo.apply(rec, keeps[0])
        self.report.applied += 1
        return moved

    def _pass_over(self, seq: int, rec: schema.Record, ino: int | None) -> None:
        """A record that is damaged or whose object cannot be restored: its
        step is not taken; reported once, and kept (or, with
        --skip-damaged, given up)."""
        if isinstance(rec, schema.Damaged) and seq not in self.known:
            where = fsck.layer_of([(la.start, la.id) for la in self.layers], seq)
            self.report.failures.append(
                f"record {seq} of layer {where} is damaged: it "
                f"{schema.damage_of(rec)}; not applied, what it would undo "
                "stays as it is"
            )
        elif ino is not None and ino not in self.reported:
            self.reported.add(ino)
            self.report.failures.append(self.unrestorable[ino])
        if not self.skip_damaged:
            self.kept.append((seq, rec))
        else:  # given up: gone, not kept for a redo either
            with self.store.write() as w:
                w.delete_record(seq)
            self.board.step(1)

    def _failed(self, seq: int, rec: schema.Record, failure: str) -> None:
        """A step failed (its object or directory is not the one recorded,
        its pre-image is missing, ...): reported by name, and its record
        kept with what it needs, to be taken when the same command runs
        again (or, with --skip-damaged, given up): what a layer holds is
        never dropped untaken without the user saying so."""
        self.report.failures.append(failure)
        if not self.skip_damaged:
            self.kept.append((seq, rec))
            self.stuck_dirs |= self._dirs_of(rec)
            self.board.step(1)
        else:
            self._done([(seq, rec, False)])

    def _dirs_of(self, rec: schema.Record) -> set[int]:
        """The directories (backing inodes) whose names a step acts on."""
        if isinstance(rec, schema.Create | schema.Link | schema.Grave):
            dirs = [(rec.dir, rec.path)]
        elif isinstance(rec, schema.Rename):
            dirs = [(rec.src_dir, rec.src), (rec.dst_dir, rec.dst)]
        elif isinstance(rec, schema.Exchange):
            dirs = [(rec.a_dir, rec.a), (rec.b_dir, rec.b)]
        else:
            return set()
        out = set()
        for dino, loc in dirs:
            if not dino and schema.grave_id(loc) is None:
                # (a record without them -- an older cowfs's, or a redo's:
                # the directory there now)
                try:
                    st = self.undo.r.lstat(backing.split(loc)[0])
                except OSError:
                    st = None
                dino = st.st_ino if st is not None else 0
            if dino:
                out.add(dino)
        return out

    def _again(self, seq: int, rec: schema.Record) -> bool:
        """Whether the step of *rec*, taken, is kept to be taken again: it
        puts back the attributes of a directory a kept step acts in (its
        times, which that step changes when the same command takes it)."""
        return isinstance(rec, schema.Meta | schema.Xattrs) and rec.ino in self.stuck_dirs

    def _halted(self, e: Exception, rec: schema.Record) -> bool:
        """A step failed in a way that halts the rollback (see
        ``steps.halts``): with a full disk, room is made and the step tried
        again (True); else the rollback stops here (False)."""
        if self.keeper is not None:
            self._give_up_redo(e)
        if steps.wants_room(e) and self.room_made_at != self.i:
            self.room_made_at = self.i
            if self._make_room():
                return True  # (and the step is tried again)
        assert isinstance(e, OSError)  # (as halts says)
        self._stop(f"{describe(rec)}: {e.strerror or e}")
        self.room = steps.wants_room(e)
        return False

    # -- what a redo keeps --------------------------------------------------------------

    def _done(self, taken: list[Taken]) -> None:
        """After the steps of these records: taken, failed or given up.
        Their records are held for a redo, or deleted."""
        self.board.step(len(taken))
        if self.keeper is not None:
            try:
                self.keeper.hold(taken)
            except OSError as e:  # (a full disk: deleting still works)
                self._give_up_redo(e)
        if self.keeper is None:
            with self.store.write() as w:
                for seq, _, _ in taken:
                    w.delete_record(seq)

    def _give_up_redo(self, e: Exception) -> None:
        """Go on with the rollback without keeping what a redo needs; the
        records the keeper held are deleted like the others."""
        keeper, self.keeper = self.keeper, None
        self.files.discard_redo(
            f"what a redo needs could not be kept ({getattr(e, 'strerror', None) or e})",
            fallback=True,
        )
        if keeper is not None and keeper.held:
            with self.store.write() as w:
                for seq, _, _ in keeper.held:
                    w.delete_record(seq)

    # -- a full disk, a stop --------------------------------------------------------------

    def _stop(self, why: str) -> None:
        """The rollback cannot go on here (a full disk, an I/O error): what
        is left is kept, nothing a redo would need."""
        self.stopped = why
        if self.keeper is not None:
            self._give_up_redo(RuntimeError(why))

    def _make_room(self) -> bool:
        """The disk is full at records[i]: take first the steps after it that
        remove a name the rolled-back layers made (a CREATE or LINK of no
        directory), where nothing between names that place, what is above
        it or below it -- they leave the tree as they would in their turn.
        Returns whether any was taken."""
        named: set[bytes] = set()  # places named by the steps from i on
        above: set[bytes] = set()  # and every directory above them
        any_taken = False
        undo = self.undo
        removed = len(undo.touched.removed)
        for seq, rec in self.records[self.i :]:
            if seq in self.early:
                continue
            if isinstance(rec, schema.Create | schema.Link) and not self._skipped(seq, rec):
                path = rec.path
                ups = [path[:k] for k in range(len(path)) if path[k : k + 1] == b"/"]
                if path not in named and path not in above and not named.intersection(ups):
                    there = undo.r.lstat(path)
                    if there is not None and not stat.S_ISDIR(there.st_mode):
                        try:
                            undo.apply(rec)
                            self._done([(seq, rec, False)])
                        except OSError:
                            pass
                        else:
                            self.early.add(seq)
                            any_taken = True
                            continue
            if isinstance(rec, schema.Damaged):
                break  # (what it names is not known: nothing past it)
            for loc in redo.record_locs(rec):
                named.add(loc)
                above.update(loc[:k] for k in range(len(loc)) if loc[k : k + 1] == b"/")
        if self.on_removed is not None and len(undo.touched.removed) > removed:
            self.on_removed(undo.touched.removed[removed:])
        return any_taken

    def _stopped(self) -> RollbackReport:
        """The rollback could not take every step: the steps not taken stay
        recorded in their layers, which stay (a damaged record without
        --skip-damaged, a full disk, an I/O error).  What the layers
        captured is forgotten (their records stay), so that changes made
        from now on are captured afresh and undone first by the rollback
        that finishes the job -- the same command, run again -- but where a
        record kept holds the object's state already."""
        store, layers, kept, report = self.store, self.layers, self.kept, self.report
        with store.write() as w:
            for layer in layers:
                w.drop_index(layer.id, {seq for seq, _ in kept})
            pending.stopped(w)
        store.forget_layer_cache()
        self.files.discard_redo("the rollback stopped before it finished")
        needs = 0
        for _, rec in kept:
            if isinstance(rec, schema.Chunk) and rec.digest:
                needs += rec.length
        report.top = store.open_layer().id
        report.kept = len(kept)
        report.needs = needs if self.room else 0
        first = layers[0].id if layers else 0
        if self.stopped is not None:
            report.stopped = f"the rollback stopped: {self.stopped}"
        else:
            report.stopped = (
                "what the steps not taken name (damaged records, steps that "
                "failed) is left as it is; run the same command again once what "
                "made them fail is gone, or roll back with --skip-damaged to give "
                "them up"
            )
        report.stopped += (
            f"; {count(len(kept), 'step')} not taken, kept in layers {first}..{layers[-1].id}"
            if layers
            else ""
        )
        if report.needs:
            report.stopped += (
                f"; it needs about {human_size(report.needs)} of free space "
                f"({human_size(store.space_left())} free now): make room and run the same "
                "command again to finish it"
            )
        elif self.stopped is not None:
            report.stopped += "; run the same command again to finish it"
        return report

    # -- the end: the layers dropped, the redo sealed -----------------------------------

    def _drop_and_seal(self) -> RollbackReport:
        """Every step was taken: drop the layers (parked, for a redo) and
        seal what a redo needs (its fingerprints taken, by the helper if
        there is one, while the layers are dropped)."""
        sealing: Callable[[], list[tuple[bytes, bytes]]] | None = None
        to_seal: redo.ToSeal | None = None
        prints: list[tuple[bytes, bytes]] = []
        try:
            if self.keeper is not None:
                self.keeper.flush()
                # where a redo would act, looked at (by the helper, if there
                # is one) while the layers are dropped
                to_seal = self.keeper.sealed()
                sealing = self.runner.prints(to_seal.locs)
            try:
                drop_layers(self.store, self.layers, park=self.keeper is not None)
            finally:
                prints = sealing() if sealing is not None else []
        except OSError as e:
            if self.keeper is None:
                raise
            self._give_up_redo(e)
            drop_layers(self.store, self.layers, park=False)
        self.store.forget_layer_cache()
        report = self.report
        report.dropped = [layer.id for layer in self.layers]
        report.top = self.files.ensure_base().id
        if self.keeper is not None and to_seal is not None:
            seal_redo(self.files, self.keeper, report.top, (to_seal.known + prints, to_seal.moved))
        return report


def drop_layers(store: Store, layers: list[Layer], park: bool) -> None:
    """Drop the rolled-back layers (*park*: kept for a redo) and mark the
    pending rollback's file part done, in one transaction."""
    with store.write() as w:
        for layer in layers:
            if park:
                w.park_layer(layer.id)
            else:
                w.drop_layer(layer.id)
        pending.files_done(w)


def seal_redo(
    files: Files,
    keeper: redo.RedoInverses,
    top: int,
    looked: tuple[list[tuple[bytes, bytes]], list[bytes]] | None = None,
) -> None:
    """Seal what a redo of the rollback needs (see ``RedoInverses.seal``);
    a store that cannot take that has the redo discarded."""
    try:
        keeper.seal(top, looked)
    except OSError as e:
        files.discard_redo(
            f"what a redo needs could not be kept ({getattr(e, 'strerror', None) or e})",
            fallback=True,
        )
