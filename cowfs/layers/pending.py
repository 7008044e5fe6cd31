"""The pending record: the group operation under way, kept in the store
(``schema``, key ``pending``) so that the next session finishes it after
a crash.  Every change of it is made here, in this order:

* planned (`plan`), in the transaction that starts the operation: a
  rollback (`rollback`: the provider restores of the dropped layers'
  snapshots, last taken first, then the files, then the snapshots'
  discards) or a redo (`redo`: the files) by the session, which drives
  every group operation; the discards of a merged or committed layer's
  snapshots (`plan_discards`) in the merge's transaction
  (``LayerFiles``); a checkpoint's captures (`checkpoint`) by the session;
* each provider step marked before it runs and after it (`mark_step`,
  durably), by the session, which runs them;
* the file part marked done (`files_done`) or stopped (`stopped`) in the
  transaction that ends it (cowfs/layers/rollback.py, ``LayerFiles`` for a redo);
* closed (`close`) by the session: the restores' post-mortems move to the
  layer open then.

The record is a ``schema.PendingRecord``; its JSON is the one it always
was (see cowfs/storage/schema.py).

A session opened on a store with a pending record finishes it first
(``Session.open``): a checkpoint's captures are discarded and its layer
merged away; anything else is carried out from where it stands.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..storage.schema import PendingRecord, PendingStep
from ..storage.store import Layer, Store, Writer

FINISHED = ("done", "failed")


def _steps(do: str, layers: list[Layer]) -> tuple[PendingStep, ...]:
    """Provider steps for *layers* (in the order given), each layer's
    snapshots last taken first."""
    return tuple(
        PendingStep(do, snap["provider"], layer.id, snap["data"], "todo")
        for layer in layers
        for snap in reversed(layer.snapshots)
    )


def rollback(to: int, dropping: list[Layer], skip_damaged: bool = False) -> PendingRecord:
    """A rollback down to layer *to*, of *dropping* (top layer first)."""
    return PendingRecord(
        "rollback",
        to=to,
        files=False,
        steps=_steps("restore", dropping) + _steps("discard", dropping),
        skip_damaged=skip_damaged,
    )


def redo() -> PendingRecord:
    return PendingRecord("redo", files=False, steps=())


def plan_discards(w: Writer, layer: Layer) -> None:
    """In the transaction that merges or commits *layer*: plan the discards
    of its snapshots, if it has any."""
    if layer.snapshots:
        steps = _steps("discard", [layer])
        plan(w, PendingRecord("commit", layer=layer.id, files=True, steps=steps))


def checkpoint(layer_id: int, providers: list[str]) -> PendingRecord:
    """The captures of a checkpoint (a crash meanwhile: what they took is
    discarded and the layer merged into the one below)."""
    return PendingRecord("checkpoint", layer=layer_id, providers=providers)


def plan(w: Writer, record: PendingRecord) -> None:
    w.set_pending(record)


def files_left(record: PendingRecord) -> bool:
    """Whether the record's file part is still to be done."""
    return record.op in ("rollback", "redo") and not record.files


def steps_left(record: PendingRecord) -> list[PendingStep]:
    return [step for step in record.all_steps if step.state not in FINISHED]


def files_done(w: Writer) -> None:
    w.update_pending(files=True)


def stopped(w: Writer) -> None:
    """In the transaction that ends a rollback that could not take every
    step: its file part is over (what is left stays in its layers, for the
    same command to finish), and its snapshots are not discarded (they stay
    with their layers, which stay)."""
    record = w.pending()
    if record is None:
        return
    steps = tuple(step for step in record.all_steps if step.do != "discard")
    w.set_pending(replace(record, steps=steps, files=True))


def mark_step(store: Store, index: int, **fields: Any) -> None:
    """Update step *index*, durably (even against a power loss) before the
    step runs or anything follows it."""
    with store.write() as w:
        w.update_pending(index, **fields)
    store.sync()


def close(w: Writer, top: int) -> PendingRecord | None:
    """Close the record (the operation is over), keeping the restores'
    post-mortems with layer *top*, the one open now.  Returns the record
    as it was."""
    record = w.pending()
    if record is None:
        return None
    postmortems = [step.postmortem for step in record.all_steps if step.postmortem]
    if postmortems:
        w.store.append_to_layer(top, "postmortems", postmortems, w)
    w.set_pending(None)
    return record
