"""cowfs: a FUSE filesystem that makes any directory undoable.

``from cowfs import Workspace`` (and the other names below) loads the API
on first use, so that importing a part of cowfs -- the command line, which
starts with every command -- stays cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the names as mypy sees them; at run time, __getattr__ loads them)
    from .errors import CowfsError as CowfsError
    from .errors import NotAnswering as NotAnswering
    from .interface.api import Change as Change
    from .interface.api import CommitResult as CommitResult
    from .interface.api import LayerInfo as LayerInfo
    from .interface.api import RollbackResult as RollbackResult
    from .interface.api import RunResult as RunResult
    from .interface.api import Status as Status
    from .interface.api import Step as Step
    from .interface.api import StepFailed as StepFailed
    from .interface.api import Workspace as Workspace

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
        from .interface import api

        return getattr(api, name)
    if name in ("CowfsError", "NotAnswering"):
        from . import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'cowfs' has no attribute {name!r}")
