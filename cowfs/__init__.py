"""cowfs: a FUSE filesystem that makes any directory undoable.

``from cowfs import Workspace`` (and the other names below) loads the API
on first use, so that importing a part of cowfs -- the command line, which
starts with every command -- stays cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the names as mypy sees them; at run time, __getattr__ loads them)
    from .api import Change as Change
    from .api import CommitResult as CommitResult
    from .api import LayerInfo as LayerInfo
    from .api import RollbackResult as RollbackResult
    from .api import RunResult as RunResult
    from .api import Status as Status
    from .api import Step as Step
    from .api import StepFailed as StepFailed
    from .api import Workspace as Workspace
    from .errors import CowfsError as CowfsError
    from .errors import NotAnswering as NotAnswering

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


def __getattr__(name: str) -> object:
    if name in _API:
        from . import api

        return getattr(api, name)
    if name in ("CowfsError", "NotAnswering"):
        from . import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'cowfs' has no attribute {name!r}")
