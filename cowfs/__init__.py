"""cowfs: a FUSE filesystem that makes any directory undoable.

``from cowfs import Workspace`` (and the other names below) loads the API
on first use, so that importing a part of cowfs -- the command line, which
starts with every command -- stays cheap."""

from __future__ import annotations

__version__ = "0.1.0"

_API = (
    "Change",
    "CommitResult",
    "LayerInfo",
    "RollbackResult",
    "RunResult",
    "Status",
    "Step",
    "StepFailed",
    "Workspace",
)
__all__ = [*_API, "CowfsError", "NotAnswering", "__version__"]


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    if name in ("CowfsError", "NotAnswering"):
        from . import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'cowfs' has no attribute {name!r}")
