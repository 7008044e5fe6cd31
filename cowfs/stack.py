"""Stack operations on a store: checkpoint, commit, rollback and the views
of a layer (status, log).  They work the same inside the mount daemon and on
an unmounted workspace; the daemon adds flushing and cache invalidation.
"""

from __future__ import annotations

import gc
import logging
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial

from . import backing as B
from . import fsck, progress, redo, steps
from . import pending as P
from . import schema as S
from .errors import NeedsConfirmation, NothingToDo, Refused, StoreError, UnknownLayer
from .journal import Kept, MetaAt, Reading
from .listing import Changes
from .past import filter_paths
from .store import Layer, PendingRecord, Store, digest
from .text import count, human_size
from .undo import Touched, Undoer, describe
from .zeros import ChunkMap

log = logging.getLogger(__name__)


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


class Stack:
    WHO_BATCH = 4096  # changes attributed at a time

    def __init__(self, store: Store, resolver: B.Resolver):
        self.store = store
        self.resolver = resolver
        # the capture filter ((path, is_dir) -> bool), if any
        self.ignored: Callable[[bytes | Callable[[], bytes], bool], bool] | None = None
        # told the inodes of objects a discarded redo held in the grave
        self.on_freed: Callable[[list[int]], None] | None = None
        # told the inodes of objects a rollback removed to make room (their
        # blocks are freed once nothing holds them)
        self.on_removed: Callable[[list[int]], None] | None = None
        self.redo_blocked: str | None = None  # why, when even noting it failed
        self.same = Sameness(store, resolver)
        self.kept = Kept(store)  # readings of the journal up to now
        # the records the audit of the rollback planned now read (see `undone`)
        self._ahead: tuple[int, int, int, list[tuple[int, S.Record]]] | None = None
        self.board = progress.LOCAL  # where a rollback notes how far it has got
        self.helper: steps.Helper | None = None  # (the mount daemon's: see `steps`)

    # -- basics -----------------------------------------------------------------

    def ensure_base(self) -> Layer:
        """There is always an open layer."""
        top = self.store.top()
        return top if top is not None else self.store.push_layer("base")

    def layer_is_empty(self, layer_id: int) -> bool:
        layer = self.store.get_layer(layer_id)
        return not self.store.count_records(layer.start, self.store.layer_end(layer_id), 1)

    def checkpoint(self, message: str = "", agent: dict | None = None) -> Layer:
        self.discard_redo("a checkpoint was taken after it")
        layer = self.store.push_layer(message, agent)
        self.kept.opened(layer.start)
        return layer

    def discard_redo(self, reason: str, fallback: bool = False) -> None:
        """What the last rollback kept for a redo is no longer needed (see
        ``redo``): free it, noting *reason*.  With *fallback*, a store that
        cannot take that (full) at least has the redo refused."""
        try:
            freed = redo.discard(self.store, reason)
        except OSError as e:
            if not fallback:
                raise
            log.warning("could not free what was kept for a redo: %s", e)
            self.redo_blocked = reason
            redo.mark_unavailable(self.store, reason)
            return
        if freed and self.on_freed is not None:
            self.on_freed(freed)

    def resume(self) -> RollbackReport | None:
        """Finish the file part of a stack operation that was interrupted by
        a crash.  Provider steps left in the pending record are the caller's
        (the session runs them before and after this); the record is closed
        here only when none is left."""
        pending = self.pending()
        report = None
        if pending is not None:
            if P.files_left(pending):
                report = self.apply_files()
            if not P.steps_left(pending):
                self.finish()
        if self.pending() is None and redo.complete(self.store):
            # a crash between the end of a rollback's files and its fingerprint
            self._seal_redo(redo.Keeper(self.store, self.resolver), self.ensure_base().id)
        self.sweep_graves()
        self.ensure_base()
        return report

    def check(self) -> list[str]:
        """Quick consistency check of the stack (run when recovering a mount
        whose daemon died): everything `cowfs check` verifies except the
        chunk hashes."""
        return [str(p) for p in fsck.check(self.store, hashes=False).problems]

    # -- group operations: the pending record (see cowfs/pending.py) ----------------
    # The stack plans it for a rollback, a redo and a merge's discards, and
    # carries out the file part; the session (cowfs/session.py) the rest.

    def pending(self) -> PendingRecord | None:
        return self.store.pending()

    def planned(self) -> PendingRecord:
        """The pending record, where one must be (an operation planned it
        and it is not finished yet)."""
        pending = self.pending()
        if pending is None:
            raise StoreError("no group operation is pending")
        return pending

    def finish(self) -> PendingRecord | None:
        """Close the pending group operation: keep the restores' post-mortems
        with the layer the workspace is now at, and clear the record.
        Returns the record as it was."""
        if self.pending() is None:
            return None
        top = self.ensure_base()
        with self.store.write() as w:
            return P.close(w, top.id)

    # -- commit -------------------------------------------------------------------

    def commit(self) -> dict:
        """Merge the top layer into the one below; committing the base layer
        makes its changes permanent and opens a fresh base layer."""
        layers = self.store.layers()
        top = layers[-1]
        if len(layers) == 1 and self.layer_is_empty(top.id):
            raise NothingToDo("nothing to commit: the base layer has no changes")
        self.discard_redo("a commit was made after it")
        if len(layers) == 1:
            freed = self._commit_base(top)
            fresh = self.store.push_layer("base")
            return {"committed": top.id, "into": None, "top": fresh.id, "freed": freed}
        below = layers[-2]
        self._merge(top, below)
        return {"committed": top.id, "into": below.id, "top": below.id}

    def merge_into_base(self) -> int:
        """Merge the oldest layer above the base into the base (--max-layers);
        return its id.  Its snapshots' discards are left pending."""
        base, oldest = self.store.layers()[:2]
        self._merge(oldest, base)
        return oldest.id

    # -- drift: changes made while not mounted ---------------------------------------

    def fingerprint(self) -> dict:
        """What every path the layers changed looks like now (taken at
        unmount): {"seq", "layers": the store's state it belongs to,
        "paths": path -> its ``backing.fingerprint``}."""
        layers = self.store.layers()
        out: dict[str, list | None] = {}
        if layers:
            j = self.kept.get(layers[0].start)
            with self.resolver.reading():
                for path, fp in B.fingerprints(self.resolver, sorted(j.touched())):
                    out[os.fsdecode(path)] = fp
        return {"seq": self.store.next_seq, "layers": [x.id for x in layers], "paths": out}

    def drift(self, recorded: dict) -> list[str]:
        """The recorded paths that are not as they were at unmount.  A
        record the store has moved on from (a mount since then that did
        not end cleanly) describes nothing any more."""
        if recorded.get("seq") != self.store.next_seq or recorded.get("layers") != [
            x.id for x in self.store.layers()
        ]:
            return []
        was = recorded.get("paths", {})
        paths = sorted(was)
        with self.resolver.reading():
            now = B.fingerprints(self.resolver, [os.fsencode(p) for p in paths])
        return [
            p for p, (_, fp) in zip(paths, now, strict=True) if _as_recorded(fp, was[p]) != was[p]
        ]

    def redo_note(self) -> dict | None:
        """What `status` and `log` say about the last rollback (see
        ``redo.summary``), with "current": whether the layers are still
        those it left (no checkpoint, commit or other rollback since).  That
        it cannot be redone is worth saying only while it is current."""
        note = redo.summary(self.store, self.resolver)
        if note is None:
            return None
        st = redo.state(self.store)
        assert st is not None  # (summary found it)
        layers = self.store.layers()
        ids = [x.id for x in layers]
        if st.get("fresh") is not None:  # it rolled back the base too
            current = ids == st["kept"] + [st["fresh"]]
        elif st["kept"]:
            current = ids == st["kept"]
        else:  # the base, unsealed: the fresh base it opened
            current = len(layers) == 1 and layers[0].start == st["seq"]
        return note | {"current": current}

    def usage(self) -> dict:
        data, grave = self.store.data_bytes(), self.store.grave_bytes()
        limits = self.store.limits()
        return {
            "bytes": data + grave,
            "data": data,
            "grave": grave,
            "max_store": limits.get("max_store"),
            "layers": len(self.store.layers()),
            "max_layers": limits.get("max_layers"),
        }

    def gc(self) -> dict:
        """Free what nothing needs: unused chunks, grave files no record
        holds, stale index entries, wrong reference counts (`cowfs check
        --repair` without asking, minus what needs judgement)."""
        before = self.usage()["bytes"]
        rep = fsck.check(self.store, hashes=False)
        done = fsck.repair(self.store, rep, self.discard_redo)
        after = self.usage()["bytes"]
        return {
            "done": done,
            "freed_bytes": max(0, before - after),
            "bytes": after,
            "problems": [str(p) for p in fsck.check(self.store, hashes=False).problems],
        }

    def _merge(self, top: Layer, below: Layer) -> None:
        st = self.store
        with st.write() as w:
            w.merge_index(top.id, below.id)
            for key in ("runs", "postmortems", "drift"):
                if getattr(top, key):
                    st.append_to_layer(below.id, key, list(getattr(top, key)), w)
            turns = [top.agent | {"layer": top.id, "message": top.message}] if top.agent else []
            turns += top.turns
            if turns:  # the agent events of a merged layer stay with the one below
                st.append_to_layer(below.id, "turns", turns, w)
            w.delete_layer_row(top.id)
            P.plan_discards(w, top)
        st.forget_layer_cache()

    def _commit_base(self, base: Layer) -> list[int]:
        """Returns the inodes whose grave entries were deleted."""
        st = self.store
        graves, freed = [], []
        with st.write() as w:
            for seq, rec in st.records(base.start, st.layer_end(base.id)):
                if isinstance(rec, S.Grave):
                    graves.append(rec.grave)
                    freed.append(rec.ino)
                w.delete_record(seq)
            w.drop_layer(base.id)
            P.plan_discards(w, base)
        st.forget_layer_cache()
        for gid in graves:
            B.remove_tree_at(st.grave_fd, str(gid).encode())
        return freed

    def attribute(self, changes: Changes, since: int) -> Changes:
        """Each change with who first made it ("who": pid, uid, cmd), from
        the layers since *since* (looked up a batch at a time)."""
        layers = [layer.id for layer in self.store.layers() if layer.id >= since]
        seg = redo.segment(self.store)  # (changes since the last rollback)
        if seg is not None:
            layers.append(seg)
        inos = changes.inos
        for i in range(0, len(inos), self.WHO_BATCH):
            found = self.store.who(layers, [n for n in inos[i : i + self.WHO_BATCH] if n])
            for j in range(i, min(i + self.WHO_BATCH, len(inos))):
                who = found.get(inos[j]) if inos[j] else None
                if who is not None:  # (one dict per writer, shared: read, never changed)
                    changes.set_who(j, who)
        return changes

    def sweep_graves(self) -> int:
        """Remove grave entries no record refers to (left by a crash during a
        base commit)."""
        fd = os.open(B.proc(self.store.grave_fd), os.O_RDONLY | os.O_DIRECTORY)
        try:
            names = os.listdir(fd)
        finally:
            os.close(fd)
        removed = 0
        with self.store.read() as txn:
            live = {
                n
                for n in names
                if n.isdigit() and txn.get(S.u64(int(n)), db=self.store.db_graves) is not None
            }
        for n in names:
            if n not in live:
                B.remove_tree_at(self.store.grave_fd, os.fsencode(n))
                removed += 1
        return removed

    # -- rollback -------------------------------------------------------------------

    def plan_rollback(
        self,
        to: int | None = None,
        keep_redo: bool = True,
        base: bool = True,
        skip_damaged: bool = False,
    ) -> PendingRecord:
        """Check a rollback (down to and including layer *to*; default: the
        top layer) and write its pending record: the restores of the dropped
        layers' snapshots (top layer first, last taken first), the files,
        then the discards of those snapshots.  Nothing is changed yet but
        freeing what an earlier rollback kept for a redo.  *keep_redo*: keep
        what a redo of this one needs (impossible with provider snapshots).
        Without *base*, a rollback of the top layer that is the base layer
        (everything since the mount or the last commit) is refused."""
        layers = self.store.layers()
        top = layers[-1]
        if to is None:
            if len(layers) == 1 and self.layer_is_empty(top.id):
                raise NothingToDo("nothing to roll back: the base layer has no changes")
            if len(layers) == 1 and not base:
                raise NeedsConfirmation(
                    f"the open layer {top.id} is the base layer: rolling it back undoes "
                    "everything since the workspace was mounted or last committed; confirm "
                    f"with --yes, or name it with --to {top.id}; nothing was changed"
                )
            to = top.id
        elif to not in {layer.id for layer in layers}:
            raise UnknownLayer(
                f"no layer {to} (layers: {', '.join(str(layer.id) for layer in layers)})"
            )
        dropping = [layer for layer in reversed(layers) if layer.id >= to]
        pending = P.rollback(to, dropping) | ({"skip_damaged": True} if skip_damaged else {})
        self.discard_redo("another rollback was made")
        why = None
        if not keep_redo:
            why = "it was made with --no-redo"
        elif any(layer.snapshots for layer in dropping):
            why = (
                "it restored provider snapshots, and the state of those containers or "
                "VMs before it was not kept"
            )
        try:
            with self.store.write() as w:
                P.plan(w, pending)
                redo.begin(
                    w,
                    to,
                    sorted(layer.id for layer in dropping),
                    [layer.id for layer in layers if layer.id < to],
                    why,
                )
        except OSError:
            # a full disk: the rollback itself must still be possible
            with self.store.write() as w:
                P.plan(w, pending)
        return pending

    def _give_up_redo(self, keeper: redo.Keeper | None, e: Exception) -> None:
        """Go on with the rollback without keeping what a redo needs; the
        record the keeper held is deleted like the others."""
        self.discard_redo(
            f"what a redo needs could not be kept ({getattr(e, 'strerror', None) or e})",
            fallback=True,
        )
        if keeper is not None and keeper.held:
            with self.store.write() as w:
                for seq, _, _ in keeper.held:
                    w.delete_record(seq)

    def apply_files(self) -> RollbackReport:
        """The file part of the pending rollback or redo (resumable)."""
        pending = self.planned()
        self.kept.clear()  # (what it reads of the journal now is moved or deleted)
        try:
            with self.resolver.acting():  # (file requests are held off meanwhile)
                if pending["op"] == "redo":
                    return self._redo()
                return self._rollback_to(pending["to"])
        finally:
            self._ahead = None
            self.board.end()

    def plan_redo(self) -> redo.RedoState:
        """Check that the last rollback can be undone now and write the
        pending record of its redo."""
        if self.redo_blocked is not None:
            raise Refused(f"cannot redo the last rollback: {self.redo_blocked}")
        st = redo.check(self.store, self.resolver)
        with self.store.write() as w:
            redo.start(w)
            P.plan(w, P.redo())
        return st

    def _redo(self) -> RollbackReport:
        st = self.store
        report = RollbackReport()
        undo = Undoer(st, self.resolver, report.touched, self.ignored)
        report.applied = redo.apply(st, undo, report.failures, describe)
        with st.write() as w:
            report.restored = redo.restore(w)
            P.files_done(w)
        st.forget_layer_cache()
        report.top = self.ensure_base().id
        return report

    def rollback(self, to: int | None = None) -> RollbackReport:
        """A rollback of the files alone, for layers without provider
        snapshots.  (Provider steps, were there any, would stay pending for
        the daemon, which carries out groups with snapshots.)"""
        self.plan_rollback(to)
        report = self.apply_files()
        if not P.steps_left(self.planned()):
            self.finish()
        return report

    def _rollback_to(self, to: int) -> RollbackReport:
        st = self.store
        report = RollbackReport()
        layers = [layer for layer in st.layers() if layer.id >= to]
        undo = Undoer(st, self.resolver, report.touched, self.ignored)
        keeper = redo.Keeper(st, self.resolver) if redo.building(st, to) else None
        batches = steps.Batches(undo, self.helper)
        skip_damaged = bool(self.planned().get("skip_damaged"))
        kept: list[tuple[int, S.Record]] = []  # records left in the store, not applied
        stopped: str | None = None  # why the rollback stopped, and where
        room = False  # whether it stopped for want of room
        if layers:
            records = self._records_from(layers[0].start)
            self.board.start(len(records))
            # An object with a corrupt or missing pre-image is skipped as a
            # whole (left as it is now), never restored in part.
            unrestorable, known = fsck.unrestorable(st, records)
            reported: set[int] = set()
            early: set[int] = set()  # seqs taken ahead of their turn, to make room
            room_made_at = -1

            def skipped(seq: int, rec: S.Record) -> bool:
                return (
                    isinstance(rec, S.Damaged) or fsck.restores(rec) in unrestorable or seq in early
                )

            def done(taken: list[tuple[int, S.Record, bool]]) -> None:
                """After the steps of these records ((seq, record, whether
                it moved its object into the grave or out of it)): taken,
                failed or given up."""
                nonlocal keeper
                self.board.step(len(taken))
                if keeper is not None:
                    try:
                        keeper.hold(taken)
                    except OSError as e:  # (a full disk: deleting still works)
                        self._give_up_redo(keeper, e)
                        keeper = None
                if keeper is None:
                    with st.write() as w:
                        for seq, _, _ in taken:
                            w.delete_record(seq)

            def stop(why: str) -> None:
                """The rollback cannot go on here (a full disk, an I/O
                error): what is left is kept, nothing a redo would need."""
                nonlocal keeper, stopped
                stopped = why
                if keeper is not None:
                    self._give_up_redo(keeper, RuntimeError(why))
                    keeper = None

            i = 0
            ahead = None  # what the batch at i keeps, kept while the one before it ran
            taken = -1  # the seq of a step taken with the one before it
            while i < len(records) and stopped is None:
                seq, rec = records[i]
                if seq in early:
                    i += 1
                    continue
                keeps: list[tuple[int, int] | None] = [None]
                if keeper is not None and not skipped(seq, rec):
                    try:
                        keeps = ahead or keeper.batch(records, i, skipped)
                    except Exception as e:
                        # no room to keep it (or no way): the rollback goes on
                        self._give_up_redo(keeper, e)
                        keeper = None
                        keeps = [None]
                    ahead = None
                if keeper is not None and len(keeps) > 1:
                    batch = records[i : i + len(keeps)]
                    undone, ahead, error = batches.run(
                        batch,
                        keeps,
                        keeper.planned,
                        partial(keeper.batch_ahead, records, i + len(keeps), skipped),
                    )
                    halt = next((k for k, out in enumerate(undone) if out[3]), None)
                    halted = undone[halt][1] if halt is not None else None
                    if halt is not None:
                        # the steps from there on are taken one by one (making
                        # room first), without keeping what a redo needs
                        undone, batch = undone[:halt], batch[:halt]
                    failures = [failure for _, failure, _, _ in undone if failure is not None]
                    report.failures += failures
                    report.applied += len(batch) - len(failures)
                    for (seq, _), (_, _, emptied, _) in zip(batch, undone, strict=True):
                        if emptied:
                            keeper.emptied_by(seq, *emptied)
                    done(
                        [(seq, rec, out[0]) for (seq, rec), out in zip(batch, undone, strict=True)]
                    )
                    i += len(batch)
                    if halted is not None and keeper is not None:
                        self._give_up_redo(keeper, RuntimeError(halted))
                        keeper = None
                    if error is not None and keeper is not None:
                        self._give_up_redo(keeper, error)
                        keeper = None
                        ahead = None
                    if keeper is None:
                        ahead = None
                    continue
                ino = fsck.restores(rec)
                moved = False
                try:
                    if isinstance(rec, S.Damaged) or ino in unrestorable:
                        if isinstance(rec, S.Damaged) and seq not in known:
                            where = fsck.layer_of([(la.start, la.id) for la in layers], seq)
                            report.failures.append(
                                f"record {seq} of layer {where} is damaged: it "
                                f"{S.damage_of(rec)}; not applied, what it would undo "
                                "stays as it is"
                            )
                        elif ino is not None and ino not in reported:
                            reported.add(ino)
                            report.failures.append(unrestorable[ino])
                        if not skip_damaged:
                            kept.append((seq, rec))
                        else:  # given up: gone, not kept for a redo either
                            with st.write() as w:
                                w.delete_record(seq)
                            self.board.step(1)
                        i += 1
                        continue
                    elif seq == taken:
                        moved = True
                        report.applied += 1
                    elif (
                        keeper is None
                        and isinstance(rec, S.Rename)
                        and steps.removes_next(records, i, skipped)
                        and undo.put_back_and_remove(rec, None)
                    ):
                        taken = records[i + 1][0]
                        report.applied += 1
                    else:
                        moved = undo.apply(rec, keeps[0])
                        report.applied += 1
                except Exception as e:  # report by name, keep going
                    if steps.halts(e):
                        if keeper is not None:
                            self._give_up_redo(keeper, e)
                            keeper = None
                        if steps.wants_room(e) and room_made_at != i:
                            room_made_at = i
                            if self._make_room(undo, records, i, skipped, early, done):
                                continue  # (and the step is tried again)
                        assert isinstance(e, OSError)  # (as halts says)
                        stop(f"{describe(rec)}: {e.strerror or e}")
                        room = steps.wants_room(e)
                        break
                    report.failures.append(f"{describe(rec)}: {e}")
                try:
                    done([(seq, rec, moved)])
                except OSError as e:  # (taken, but still recorded: taken again when resumed)
                    stop(f"the store: {e.strerror or e}")
                    room = steps.wants_room(e)
                    break
                i += 1
            if stopped is not None:
                kept += [(seq, rec) for seq, rec in records[i:] if seq not in early]
        if stopped is not None or kept:
            if keeper is not None:  # (the steps it held were taken: their records go)
                self._give_up_redo(keeper, RuntimeError("the rollback left steps undone"))
            return self._stopped(layers, report, kept, stopped, room)
        sealing, to_seal, prints = None, None, []
        try:
            if keeper is not None:
                keeper.flush()
                # where a redo would act, looked at (by the helper, if there
                # is one) while the layers are dropped
                to_seal = keeper.sealed()
                sealing = batches.prints(to_seal[1])
            try:
                self._drop_layers(layers, keeper)
            finally:
                prints = sealing() if sealing is not None else []
        except OSError as e:
            if keeper is None:
                raise
            self._give_up_redo(keeper, e)
            keeper = None
            self._drop_layers(layers, None)
        st.forget_layer_cache()
        report.dropped = [layer.id for layer in layers]
        report.top = self.ensure_base().id
        if keeper is not None and to_seal is not None:
            self._seal_redo(keeper, report.top, (to_seal[0] + prints, to_seal[2]))
        return report

    def _make_room(
        self,
        undo: Undoer,
        records: list[tuple[int, S.Record]],
        i: int,
        skipped: Callable[[int, S.Record], bool],
        early: set[int],
        done: Callable[[list[tuple[int, S.Record, bool]]], None],
    ) -> bool:
        """The disk is full at records[i]: take first the steps after it that
        remove a name the rolled-back layers made (a CREATE or LINK of no
        directory), where nothing between names that place, what is above
        it or below it -- they leave the tree as they would in their turn.
        Returns whether any was taken."""
        named: set[bytes] = set()  # places named by the steps from i on
        above: set[bytes] = set()  # and every directory above them
        any_taken = False
        removed = len(undo.touched.removed)
        for seq, rec in records[i:]:
            if seq in early:
                continue
            if isinstance(rec, S.Create | S.Link) and not skipped(seq, rec):
                path = rec.path
                ups = [path[:k] for k in range(len(path)) if path[k : k + 1] == b"/"]
                if path not in named and path not in above and not named.intersection(ups):
                    st = undo.r.lstat(path)
                    if st is not None and not stat.S_ISDIR(st.st_mode):
                        try:
                            undo.apply(rec)
                            done([(seq, rec, False)])
                        except OSError:
                            pass
                        else:
                            early.add(seq)
                            any_taken = True
                            continue
            if isinstance(rec, S.Damaged):
                break  # (what it names is not known: nothing past it)
            for loc in redo.record_locs(rec):
                named.add(loc)
                above.update(loc[:k] for k in range(len(loc)) if loc[k : k + 1] == b"/")
        if self.on_removed is not None and len(undo.touched.removed) > removed:
            self.on_removed(undo.touched.removed[removed:])
        return any_taken

    def _stopped(
        self,
        layers: list[Layer],
        report: RollbackReport,
        kept: list[tuple[int, S.Record]],
        stopped: str | None,
        room: bool,
    ) -> RollbackReport:
        """The rollback could not take every step: the steps not taken stay
        recorded in their layers, which stay (a damaged record without
        --skip-damaged, a full disk, an I/O error).  What the layers
        captured is forgotten (their records stay), so that changes made
        from now on are captured afresh and undone first by the rollback
        that finishes the job -- the same command, run again -- but where a
        record kept holds the object's state already."""
        st = self.store
        with st.write() as w:
            for layer in layers:
                w.drop_index(layer.id, {seq for seq, _ in kept})
            P.stopped(w)
        st.forget_layer_cache()
        self.discard_redo("the rollback stopped before it finished")
        needs = 0
        for _, rec in kept:
            if isinstance(rec, S.Chunk) and rec.digest:
                needs += rec.length
        report.top = st.open_layer().id
        report.kept = len(kept)
        report.needs = needs if room else 0
        first = layers[0].id if layers else 0
        if stopped is not None:
            report.stopped = f"the rollback stopped: {stopped}"
        else:
            report.stopped = (
                "what the damaged records named is left as it is; roll back with "
                "--skip-damaged to give them up"
            )
        report.stopped += (
            f"; {count(len(kept), 'step')} not taken, kept in layers {first}..{layers[-1].id}"
            if layers
            else ""
        )
        if report.needs:
            report.stopped += (
                f"; it needs about {human_size(report.needs)} of free space "
                f"({human_size(st.space_left())} free now): make room and run the same "
                "command again to finish it"
            )
        elif stopped is not None:
            report.stopped += "; run the same command again to finish it"
        return report

    def _seal_redo(self, keeper: redo.Keeper, top: int, looked=None) -> None:
        try:
            keeper.seal(top, looked)
        except OSError as e:
            self._give_up_redo(None, e)

    def _drop_layers(self, layers: list[Layer], keeper: redo.Keeper | None) -> None:
        """Drop the rolled-back layers (kept for a redo, with a keeper) and
        mark the pending rollback's file part done, in one transaction."""
        st = self.store
        with st.write() as w:
            for layer in layers:
                if keeper is not None:
                    w.park_layer(layer.id)
                else:
                    w.drop_layer(layer.id)
            P.files_done(w)

    # -- views ------------------------------------------------------------------------

    def log(self, limit: int | None = None) -> list[dict]:
        """The layers, oldest first (with *limit*, only that many of the
        newest: each costs the count of its net changes)."""
        out = []
        layers = self.store.layers()
        for layer in layers[-limit:] if limit else layers:
            d = layer.to_dict()
            d["changes"] = len(self._changes(layer.id))  # (counted, not attributed)
            d["records"] = self.store.count_records(layer.start, self.store.layer_end(layer.id))
            d["bytes"] = self.store.layer_bytes(layer.id)
            out.append(d)
        return out

    def status(self, layer_id: int | None = None, paths: Iterable[str] = ()) -> dict:
        """The open layer's net changes (under *paths*, if given)."""
        layer_id = self.store.open_layer().id if layer_id is None else layer_id
        return {
            "id": layer_id,
            "changes": self.attribute(filter_paths(self._changes(layer_id), list(paths)), layer_id),
        }

    def changes_since(self, layer_id: int, paths: Iterable[str] = ()) -> Changes:
        """Net changes since layer *layer_id* was opened (what a rollback
        --to it would undo), under *paths* if given."""
        changes = self._changes(layer_id, since=True)
        return self.attribute(filter_paths(changes, list(paths)), layer_id)

    def undone(self) -> Changes:
        """What the rollback planned now undoes (``changes_since`` its
        layer), for its audit.  The records read for it, when they were
        read afresh, serve the rollback's steps too (one reading of a large
        layer after a mount instead of two)."""
        to = self.planned()["to"]
        collect: list[tuple[int, S.Record]] = []
        changes = self.attribute(self._changes(to, since=True, collect=collect), to)
        if len(collect) > self.WHO_BATCH:
            # (the reading is garbage in cycles -- a tree of slots -- that the
            # rollback about to run would otherwise carry through its peak)
            gc.collect()
        st = self.store
        self._ahead = (st.epoch, st.get_layer(to).start, st.next_seq, collect) if collect else None
        return changes

    def _records_from(self, start: int) -> list[tuple[int, S.Record]]:
        """The records from *start* on, last first: those `undone` read, if
        the journal is still as it was then."""
        st = self.store
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[:3] == (st.epoch, start, st.next_seq):
            return ahead[3][::-1]
        return list(st.records(start, st.next_seq, reverse=True))

    def reading(self, layer_id: int, since: bool = False, collect: list | None = None) -> Reading:
        """What the records of layer *layer_id* (with *since*: those
        since it was opened) say; kept while they are read up to now.
        *collect*: see ``Kept.get``."""
        layer = self.store.get_layer(layer_id)
        end = self.store.next_seq if since else self.store.layer_end(layer_id)
        if end == self.store.next_seq:
            return self.kept.get(layer.start, collect)
        return Reading(self.store.records(layer.start, end), self.store.chunk_size)

    def _changes(self, layer_id: int, since: bool = False, collect: list | None = None) -> Changes:
        """Net changes of a layer (with *since*: since it was opened),
        like ``git status --short``: A added, D deleted, M modified, T type
        changed, R renamed, m attributes only.

        Records name paths as they were when written; ``journal.Reading``
        maps them to the layer's start and to now, in one pass."""
        j = self.reading(layer_id, since, collect)
        with self.resolver.reading():
            changes = self._net(j)
        if len(changes) > self.WHO_BATCH and not self.kept.holds(j):
            # (a reading not kept is garbage in cycles -- a tree of slots --
            # now: collected before the changes are sorted and sent, not
            # after, at the peak of the request)
            del j
            gc.collect()
        changes.sort()  # (stable: a deletion before what stands there now)
        return changes

    def _net(self, j: Reading) -> Changes:
        """The net changes *j* describes (unsorted), compared with the tree now.  An
        object counts as renamed (R) when its own name or directory changed,
        not when it moved only with a directory above it; one that is gone
        is deleted (D, at its path then) unless another object stands where
        it would be now (M, T, m or nothing, as they compare); other new
        objects are added (A)."""
        names = j.names

        def now(path: bytes | None) -> os.stat_result | None:
            return self.resolver.lstat(path) if path is not None else None

        def was_dir(ino: int) -> bool:
            """Whether the object *ino* the layer removed was a directory."""
            m = j.meta.get(ino)
            if m is not None:
                return stat.S_ISDIR(m.rec.mode)
            gids = j.graves.get(ino)
            st = B.lstat_at(self.store.grave_fd, str(gids[0]).encode()) if gids else None
            return st is not None and stat.S_ISDIR(st.st_mode)

        def place(sp: bytes) -> bytes | None:
            """Where path *sp* (at T) is now: its directory moved or not."""
            head, _, name = sp.rpartition(b"/")
            if not head:
                return sp
            here = names.now(head)
            return None if here is None else (here + b"/" + name if here else name)

        # path -> (path, kind, from, is a directory, ino): see listing.Changes
        out: dict[bytes, tuple] = {}
        deleted: dict[bytes, tuple] = {}  # (at their paths then: kept apart)
        present: set[int] = set()
        gone: list[tuple[bytes, int]] = []
        for sp, was in j.start.items():
            if was is None:
                continue
            cur = names.now(sp)
            st = now(cur)
            if cur is None or st is None or st.st_ino != was:  # (no path, no object)
                gone.append((sp, was))
                continue
            present.add(was)
            if cur != place(sp):
                out[cur] = (cur, "R", sp, stat.S_ISDIR(st.st_mode), was)
            elif cur:
                kind = self.same.modified(
                    cur, st, j.meta.get(was), j.chunks.get(was), j.xattrs.get(was)
                )
                if kind:
                    out[cur] = (cur, kind, None, stat.S_ISDIR(st.st_mode), was)
        stands_in: set[bytes] = set()  # where a new object replaced the one there at T
        for sp, was in gone:
            at = place(sp)
            st = now(at)
            if at is None or st is None or at in out:  # (no path, no object)
                if st is None or st.st_ino not in present:
                    if sp not in deleted:
                        deleted[sp] = (sp, "D", None, was_dir(was), was)
                continue  # (else: a renamed object took its place)
            m = j.meta.get(was)
            gids = j.graves.get(was)
            kind = self.same.replaced(
                at,
                st,
                gids[0] if gids else None,
                m.rec if m is not None else None,
                j.xattrs.get(was),
            )
            stands_in.add(at)
            if kind:
                out[at] = (at, kind, None, stat.S_ISDIR(st.st_mode), st.st_ino)
        # (no two slots are at one path: what was made is listed, not looked up)
        rows = Changes([*deleted.values(), *out.values()])
        del deleted
        # (a new file's row holds the reading's name, in its directory's)
        last: bytes | None = None
        head = -1
        for where, name in names.made_in():
            cur = name if where is None else where + b"/" + name if where else name
            if cur in out or cur in stands_in:
                continue
            st = now(cur)
            if st is not None and st.st_ino not in present:
                if where is None:
                    rows.append(cur, "A", None, stat.S_ISDIR(st.st_mode), st.st_ino)
                    continue
                if where is not last:
                    head, last = rows.parent(where), where
                rows.append_in(head, name, "A", None, stat.S_ISDIR(st.st_mode), st.st_ino)
        return rows


def _as_recorded(fp: list | None, was: list | None) -> list | None:
    """*fp* in the form of *was*: a drift record of an older cowfs kept
    [size, mtime_ns, ctime_ns, ino] of each path."""
    if fp is not None and was is not None and len(was) == 4 and len(fp) == 7:
        return [fp[4], fp[5], fp[6], fp[0]]
    return fp


class Sameness:
    """Whether an object is as it was when a layer was opened: its bytes
    (compared with the captured pre-images, or with the whole object the
    layer removed), mode, owner, xattrs and mtime.  A path whose whole state
    is back as it was is no change; equal bytes with other attributes is an
    attribute change.  What was read is remembered while the object's ctime,
    size and mtime stay (every change of its bytes moves its ctime)."""

    CACHE = 100_000

    def __init__(self, store: Store, resolver: B.Resolver):
        self.store = store
        self.resolver = resolver
        self.cache: dict[tuple, bool] = {}

    def modified(
        self,
        path: bytes,
        st: os.stat_result,
        meta: MetaAt | None,
        chunks: ChunkMap | None,
        xattrs: bytes | None,
    ) -> str | None:
        """M, m or None for the object at *path* (*st*), which was there at
        the start: *meta* (and its seq), *chunks* and *xattrs* are the
        oldest records the range holds of it."""
        m = meta.rec if meta is not None else None
        if stat.S_ISREG(st.st_mode) and (chunks or (m is not None and m.size != st.st_size)):
            if (
                meta is None
                or m is None
                or m.size != st.st_size
                or not self._cached(
                    ("c", meta.seq, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns),
                    lambda: self._chunks_back(path, chunks or ChunkMap(self.store.chunk_size)),
                )
            ):
                return "M"
        if xattrs is not None and self._xattrs_now(path) != S.decode_xattrs(xattrs):
            return "m"
        if m is None:
            return None
        return "m" if self._attrs_differ(st, m.mode, m.uid, m.gid, m.mtime_ns) else None

    def replaced(
        self,
        path: bytes,
        st: os.stat_result,
        gid: int | None,
        meta: S.Meta | None,
        xattrs: bytes | None,
    ) -> str | None:
        """T, M, m or None for *path*, where another object (*st*) now stands
        in for the one the layer removed into grave *gid*."""
        old = B.lstat_at(self.store.grave_fd, str(gid).encode()) if gid is not None else None
        if gid is None or old is None:
            return "M"
        mode = meta.mode if meta is not None else old.st_mode
        if stat.S_IFMT(mode) != stat.S_IFMT(st.st_mode):
            return "T"
        gloc = S.grave_loc(gid)
        if stat.S_ISREG(mode):
            if old.st_size != st.st_size or not self._cached(
                ("g", gid, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns),
                lambda: self._same_file(gloc, path),
            ):
                return "M"
        elif stat.S_ISLNK(mode):
            if self._readlink(gloc) != self._readlink(path):
                return "M"
        elif not stat.S_ISDIR(mode) and old.st_rdev != st.st_rdev:
            return "M"
        was = S.decode_xattrs(xattrs) if xattrs is not None else self._xattrs_now(gloc)
        if was != self._xattrs_now(path):
            return "m"
        if meta is not None:
            differ = self._attrs_differ(st, meta.mode, meta.uid, meta.gid, meta.mtime_ns)
        else:
            differ = self._attrs_differ(st, old.st_mode, old.st_uid, old.st_gid, old.st_mtime_ns)
        return "m" if differ else None

    @staticmethod
    def _attrs_differ(st: os.stat_result, mode: int, uid: int, gid: int, mtime: int) -> bool:
        if (mode, uid, gid) != (st.st_mode, st.st_uid, st.st_gid):
            return True
        return not stat.S_ISDIR(st.st_mode) and mtime != st.st_mtime_ns

    def _cached(self, key: tuple, compute: Callable[[], bool]) -> bool:
        found = self.cache.get(key)
        if found is None:
            if len(self.cache) >= self.CACHE:
                self.cache.clear()
            try:
                found = self.cache[key] = compute()
            except OSError:
                return False
        return found

    def _open(self, loc: bytes) -> int:
        with self.resolver.at(loc) as (d, n):
            return B.open_noatime(n, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)

    def _chunks_back(self, path: bytes, chunks: ChunkMap) -> bool:
        """Whether every captured chunk of the file holds its pre-image again."""
        fd = self._open(path)
        try:
            size = self.store.chunk_size
            for index, (length, h) in chunks.one.items():
                data = os.pread(fd, length, index * size)
                if len(data) != length or (digest(data) != h if h else data.count(0) != length):
                    return False
            end = os.fstat(fd).st_size
            for lo, hi in chunks.zero_spans(end):  # (the size is compared apart)
                pos = lo
                while pos < hi:  # (reads only what holds data there now)
                    found = B.next_data(fd, pos, hi)
                    if found is None:
                        break
                    for off in range(found[0], found[1], 1 << 20):
                        if os.pread(fd, min(1 << 20, found[1] - off), off).count(0) != min(
                            1 << 20, found[1] - off
                        ):
                            return False
                    pos = found[1]
            return True
        finally:
            os.close(fd)

    def _same_file(self, a: bytes, b: bytes) -> bool:
        """Whether two files hold the same bytes, compared where either
        holds data (both read as zeros elsewhere): the cost follows their
        data, not their sizes."""
        fa, fb = self._open(a), self._open(b)
        try:
            size = os.fstat(fa).st_size
            if os.fstat(fb).st_size != size:
                return False
            spans = sorted(B.data_ranges(fa, size) + B.data_ranges(fb, size))
            off = 0
            for lo, hi in spans:
                for pos in range(max(lo, off), hi, 1 << 20):
                    n = min(1 << 20, hi - pos)
                    if os.pread(fa, n, pos) != os.pread(fb, n, pos):
                        return False
                off = max(off, hi)
            return True
        finally:
            os.close(fa)
            os.close(fb)

    def _readlink(self, loc: bytes) -> bytes | None:
        try:
            with self.resolver.at(loc) as (d, n):
                return os.readlink(n, dir_fd=d)
        except OSError:
            return None

    def _xattrs_now(self, loc: bytes) -> list[tuple[bytes, bytes]] | None:
        try:
            with self.resolver.at(loc) as (d, n):
                return sorted(B.list_xattrs(*B.xattr_target(d, n)))
        except OSError:
            return None
