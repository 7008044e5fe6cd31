"""How long a client of the control channel waits for a sign of life from
a daemon (below ``mounts`` and ``control``, which both wait)."""

from __future__ import annotations

import math
import os

from .. import errors

DEADLINE = 30.0  # seconds a client waits for a sign of life from a daemon


def deadline() -> float:
    """How long a client waits for a sign of life from a daemon (seconds):
    $COWFS_DEADLINE, else DEADLINE."""
    text = os.environ.get("COWFS_DEADLINE")
    if not text:
        return DEADLINE
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise errors.CowfsError(
            f"COWFS_DEADLINE is {text!r}; it takes a number of seconds above 0", errors.USAGE
        )
    return value
