"""The forks of a workspace as its store records them, and the layers they pin.

A fork is made from the tree as it was when its layer (the fork point) was
opened: it reads that state through a view of the layer for as long as it
exists.  So while a fork exists every record from its layer's start on must stay
(records are only ever appended after it by the workspace's own changes).

So a fork point is a journal position, ``start``: the tree it stands for is
the tree when the first record from there on was written.  What would take
records from there on away is refused while the fork exists: a rollback to
a layer opened before it, and a commit of the base layer that holds records
from it on.  A rollback to the fork's own layer (or one opened after it)
and every commit that merges a layer into the one below keep it: the tree
then is the fork point's again, or the records are kept as they were.

The registry is the meta entry ``forks`` (see schema): ``{"next": the next
fork id, "forks": {NAME: {"id", "layer", "start", "created", "message",
"state", "at"}}}`` (``layer``: the layer opened for it, ``start``: that
layer's start, ``at``: directories it is also mounted at)
with ``state`` "creating" (its layer is open, its stack not yet started),
"live" or "dropping" (being removed: a crash then finishes the removal).
"""

from __future__ import annotations

import re
import time
from typing import Any

from .. import errors
from ..errors import CowfsError, Refused, UnknownLayer
from ..storage import schema
from ..storage.store import Store, Writer

CREATING, LIVE, DROPPING = "creating", "live", "dropping"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def registry(store: Store) -> dict[str, Any]:
    return store.get_meta_json(schema.K_FORKS) or {"next": 1, "forks": {}}


def forks(store: Store) -> dict[str, dict]:
    """Every fork by name (its row as the registry holds it)."""
    return dict(registry(store)["forks"])


def get(store: Store, name: str) -> dict:
    """Fork *name*'s row (UnknownFork when there is none)."""
    found = forks(store).get(name)
    if found is None:
        raise UnknownFork(name, sorted(forks(store)))
    return found


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise CowfsError(
            f"bad fork name {name!r}: 1 to 64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
            errors.USAGE,
        )
    return name


def add(
    store: Store, name: str, layer: int, start: int, message: str, at: str | None = None
) -> dict:
    """Record fork *name* of the tree at journal position *start*, where
    *layer* was opened (state creating); its row."""
    with store.write() as w:
        reg = w.meta_json(schema.K_FORKS) or {"next": 1, "forks": {}}
        if name in reg["forks"]:
            raise CowfsError(f"fork {name} exists already", errors.ALREADY_MOUNTED)
        row = {
            "id": reg["next"],
            "layer": layer,
            "start": start,
            "created": time.time(),
            "message": message,
            "state": CREATING,
            "at": [at] if at else [],
        }
        reg["next"] += 1
        reg["forks"][name] = row
        _put(w, reg)
    return row


def set_state(store: Store, name: str, state: str) -> None:
    with store.write() as w:
        reg = w.meta_json(schema.K_FORKS)
        if reg is not None and name in reg["forks"]:
            reg["forks"][name]["state"] = state
            _put(w, reg)


def remove(store: Store, name: str) -> None:
    with store.write() as w:
        reg = w.meta_json(schema.K_FORKS)
        if reg is not None and reg["forks"].pop(name, None) is not None:
            _put(w, reg)


def _put(w: Writer, reg: dict) -> None:
    w.set_meta(schema.K_FORKS, schema.to_json(reg))


def refuse_below(store: Store, seq: int, what: str, end: int | None = None) -> None:
    """ForkPoint (exit 12) when *what* would take the tree back to before
    a fork point or delete records from one on (*seq*: the first record it
    deletes: a rollback to layer X deletes those from X's start on, and
    takes the tree back to that start).  Given *end*, *what* deletes the
    records from *seq* up to *end* and leaves the tree as it is (a commit of
    the base layer): every fork that has one of them from its start on is hit,
    one whose start is *seq* too (made while the base layer had no changes)."""
    rows = forks(store)
    hit = sorted(
        (
            name
            for name, row in rows.items()
            if (
                row["start"] > seq
                if end is None
                else store.count_records(max(row["start"], seq), end, 1) > 0
            )
        ),
        key=lambda n: rows[n]["id"],
    )
    if hit:
        them = "them" if len(hit) > 1 else "it"
        raise ForkPoint(
            f"{what} would take away the state fork{'s' if len(hit) > 1 else ''} "
            f"{', '.join(hit)} {'are' if len(hit) > 1 else 'is'} made from: adopt or drop "
            f"{them} first (cowfs adopt / cowfs drop); nothing was changed"
        )


class ForkPoint(Refused):
    """An operation that would take away the layer a fork is made from."""


class UnknownFork(UnknownLayer):
    def __init__(self, name: str, known: list[str]):
        super().__init__(
            f"no fork {name}" + (f" (forks: {', '.join(known)})" if known else " (no forks)")
        )
