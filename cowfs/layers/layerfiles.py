"""The file part of the group operations on the layers of a store: open a
layer (a checkpoint), merge one into the one below (a commit), check what
a rollback or a redo would do, and carry out its files (``apply``: the
undo steps, in cowfs/layers/rollback.py; a redo's steps, in cowfs/layers/redo.py).
They work the same inside the mount daemon and on an unmounted workspace.

The session (cowfs/service/session.py) drives every group operation: it plans the
pending record (cowfs/layers/pending.py), runs the provider steps, calls ``apply``
for the files and closes the record.  What is done here marks the record
only inside the transaction that does it (a merge plans the discards of
its snapshots; the file part is marked done or stopped with the layers it
drops or keeps), so that a crash leaves the record and the layers
agreeing.  The read-only views of the layers are in cowfs/layers/stackview.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from ..errors import NeedsConfirmation, NothingToDo, Refused, UnknownLayer
from ..storage import schema
from ..storage.schema import PendingRecord, RedoState
from ..storage.store import Layer, Store
from ..system import backing
from . import forkpoints, fsck, pending, redo
from .rollback import Acting, Rollback, RollbackReport, seal_redo
from .stackview import StackView
from .undo import Undoer, describe

log = logging.getLogger(__name__)


class LayerFiles:
    """The file part of the group operations on *store* (see the module's
    docstring).  *view*: the store's views, whose readings of the journal
    follow what is done here; *on_freed*: told the inodes of objects a
    discarded redo held in the grave."""

    def __init__(
        self,
        store: Store,
        resolver: backing.Resolver,
        view: StackView,
        on_freed: Callable[[list[int]], None] | None = None,
    ):
        self.store = store
        self.resolver = resolver
        self.view = view
        self.on_freed = on_freed
        self.redo_blocked: str | None = None  # why, when even noting it failed

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
        self.view.readings.opened(layer.start)
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
            if not self.layer_is_empty(top.id):
                forkpoints.refuse_below(
                    self.store,
                    top.start,
                    f"a commit of the base layer {top.id}",
                    end=self.store.layer_end(top.id),
                )
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

    def gc(self) -> dict:
        """Free what nothing needs: unused chunks, grave files no record
        holds, stale index entries, wrong reference counts (`cowfs check
        --repair` without asking, minus what needs judgement)."""
        before = self.view.usage()["bytes"]
        rep = fsck.check(self.store, hashes=False)
        done = fsck.repair(self.store, rep, self.discard_redo)
        after = self.view.usage()["bytes"]
        return {
            "done": done,
            "freed_bytes": max(0, before - after),
            "bytes": after,
            "problems": [str(p) for p in fsck.check(self.store, hashes=False).problems],
        }

    def _merge(self, top: Layer, below: Layer) -> None:
        store = self.store
        with store.write() as w:
            w.merge_index(top.id, below.id)
            for key in ("runs", "postmortems", "drift"):
                if getattr(top, key):
                    store.append_to_layer(below.id, key, list(getattr(top, key)), w)
            turns = [top.agent | {"layer": top.id, "message": top.message}] if top.agent else []
            turns += top.turns
            if turns:  # the agent events of a merged layer stay with the one below
                store.append_to_layer(below.id, "turns", turns, w)
            w.delete_layer_row(top.id)
            pending.plan_discards(w, top)
        store.forget_layer_cache()

    def _commit_base(self, base: Layer) -> list[int]:
        """Returns the inodes whose grave entries were deleted."""
        store = self.store
        graves, freed = [], []
        with store.write() as w:
            for seq, rec in store.records(base.start, store.layer_end(base.id)):
                if isinstance(rec, schema.Grave):
                    graves.append(rec.grave)
                    freed.append(rec.ino)
                w.delete_record(seq)
            w.drop_layer(base.id)
            pending.plan_discards(w, base)
        store.forget_layer_cache()
        for gid in graves:
            backing.remove_tree_at(store.grave_fd, str(gid).encode())
        return freed

    def sweep_graves(self) -> int:
        """Remove grave entries no record refers to (left by a crash during a
        base commit)."""
        fd = os.open(backing.proc(self.store.grave_fd), os.O_RDONLY | os.O_DIRECTORY)
        try:
            names = os.listdir(fd)
        finally:
            os.close(fd)
        removed = 0
        with self.store.read() as txn:
            live = {
                n
                for n in names
                if n.isdigit() and txn.get(schema.u64(int(n)), db=self.store.db_graves) is not None
            }
        for n in names:
            if n not in live:
                backing.remove_tree_at(self.store.grave_fd, os.fsencode(n))
                removed += 1
        return removed

    # -- rollback -------------------------------------------------------------------

    def rollback_layers(self, to: int | None, base: bool) -> tuple[int, list[Layer], list[int]]:
        """Check a rollback down to and including layer *to* (default: the
        top layer); returns *to*, the layers it drops (top layer first) and
        those it keeps.  Without *base*, a rollback of the top layer that is
        the base layer (everything since the mount or the last commit) is
        refused."""
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
        forkpoints.refuse_below(self.store, dropping[-1].start, f"a rollback to layer {to}")
        return to, dropping, [layer.id for layer in layers if layer.id < to]

    @staticmethod
    def why_no_redo(keep_redo: bool, dropping: list[Layer]) -> str | None:
        """Why a rollback dropping these layers keeps nothing for a redo
        (None: it keeps what a redo needs)."""
        if not keep_redo:
            return "it was made with --no-redo"
        if any(layer.snapshots for layer in dropping):
            return (
                "it restored provider snapshots, and the state of those containers or "
                "VMs before it was not kept"
            )
        return None

    def apply(self, record: PendingRecord, acting: Acting) -> RollbackReport:
        """The file part of the pending rollback or redo *record* (resumable)."""
        self.view.readings.clear()  # (what it reads of the journal now is moved or deleted)
        try:
            with self.resolver.acting():  # (file requests are held off meanwhile)
                if record.op == "redo":
                    return self._redo(acting)
                assert record.to is not None  # (a rollback's)
                report = RollbackReport()
                return Rollback(self, acting, record.to, record.skip_damaged, report).run()
        finally:
            self.view.forget_ahead()
            acting.board.end()

    def check_redo(self) -> RedoState:
        """Check that the last rollback can be undone now (its state)."""
        if self.redo_blocked is not None:
            raise Refused(f"cannot redo the last rollback: {self.redo_blocked}")
        return redo.check(self.store, self.resolver)

    def _redo(self, acting: Acting) -> RollbackReport:
        store = self.store
        report = RollbackReport()
        undo = Undoer(store, self.resolver, report.touched, acting.ignored)
        report.applied = redo.apply(store, undo, report.failures, describe)
        with store.write() as w:
            report.restored = redo.restore(w)
            pending.files_done(w)
        store.forget_layer_cache()
        report.top = self.ensure_base().id
        return report

    def seal_interrupted_redo(self) -> None:
        """A crash between the end of a rollback's files and the fingerprint
        of what a redo touches: take it now."""
        if redo.complete(self.store):
            seal_redo(self, redo.RedoInverses(self.store, self.resolver), self.ensure_base().id)
