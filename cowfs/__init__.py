"""cowfs: a FUSE filesystem that makes any directory undoable."""

__version__ = "0.1.0"
