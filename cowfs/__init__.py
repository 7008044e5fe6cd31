"""cowfs: a FUSE filesystem that makes any directory undoable."""

from .api import (Change, CommitResult, LayerInfo, RollbackResult, RunResult, Status,
                  Step, StepFailed, Workspace)
from .errors import CowfsError

__version__ = "0.1.0"

__all__ = ["Change", "CommitResult", "CowfsError", "LayerInfo", "RollbackResult",
           "RunResult", "Status", "Step", "StepFailed", "Workspace", "__version__"]
