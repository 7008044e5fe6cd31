"""The one client of the control channel: a workspace's daemon when it is
mounted, else (for the operations that work offline, see ``operations``)
its store, through the same session code.  The API's ``Workspace`` is one
(with the harness's steps on top); the command line and the MCP server
speak to workspaces through it.  Cheap to import: every command loads it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Self

from ..errors import NotMounted
from ..service import control, operations
from ..system import progress
from ..system.mounts import MountRecord, find_mount, finish_unmount, locate


class Client:
    """A workspace: mounted (*record*: its daemon), or not (*unmounted*:
    the path given and the store named, if any, with the NotMounted that
    finding its mount raised)."""

    def __init__(
        self,
        record: MountRecord | None,
        unmounted: tuple[str, str | None, NotMounted] | None = None,
    ):
        self.record = record
        self._unmounted = unmounted

    @classmethod
    def attach(cls, path: str | os.PathLike) -> Self:
        """The mounted workspace containing *path* (NotMounted if none)."""
        return cls(find_mount(os.fspath(path)))

    @classmethod
    def find(cls, path: str, store: str | None = None) -> Self:
        """The workspace containing *path*, mounted or not; *store*: the
        store of an unmounted one (default: the outermost trusted
        WORKSPACE/.cowfs above *path*)."""
        try:
            return cls(find_mount(path))
        except NotMounted as e:
            return cls(None, (path, store, e))

    @property
    def mounted(self) -> bool:
        return self.record is not None

    @property
    def root(self) -> str:
        """Where the workspace is mounted."""
        if self.record is None:
            raise self._not_mounted()
        return self.record.mountpoint

    def _not_mounted(self) -> NotMounted:
        assert self._unmounted is not None
        return self._unmounted[2]

    def offline_dirs(self) -> tuple[str, str | None]:
        """The workspace directory and store of an unmounted workspace."""
        assert self._unmounted is not None
        path, store = self._unmounted[:2]
        if store:
            return os.path.realpath(path), store
        return locate(path).unmounted(path)

    def call(
        self,
        op: str,
        timeout: float | None = None,
        on_interrupt: Callable[[], None] | None = None,
        **args: Any,
    ) -> dict:
        """Carry out control operation *op*: by the daemon (see control.call
        for *timeout* and *on_interrupt*), or, unmounted and where the
        operation works offline, on the store here (the result's
        "warnings" then carry those of opening it); else NotMounted."""
        if self.record is not None:
            return control.call(self.record, op, timeout=timeout, on_interrupt=on_interrupt, **args)
        if op not in operations.OFFLINE_OPS:
            raise self._not_mounted()
        from ..service.session import offline

        workspace, store = self.offline_dirs()
        return offline(workspace, store, op, **args)

    def check(self, repair: bool = False) -> dict:
        """Check the whole store (*repair*: repair what can be): by the
        daemon, or here on the store of an unmounted workspace as it is
        (see Session.inspect: nothing is resumed; read-only unless
        *repair*)."""
        if self.record is not None:
            return self.call("repair") if repair else self.call("check", full=True)
        import functools

        import trio

        from ..service.session import inspect_offline
        from ..system.mounts import default_store

        workspace, found = self.offline_dirs()
        session = inspect_offline(workspace, found or default_store(workspace), readonly=not repair)
        try:
            if repair:
                return trio.run(session.repair)
            return trio.run(functools.partial(session.check, full=True))
        finally:
            session.close()

    def progress(self) -> Callable[[], tuple[int, int] | None]:
        """What reads the progress of the long operation under way."""
        if self.record is None:
            return progress.LOCAL.read
        path = progress.path_for(self.record.socket)
        return lambda: progress.read(path)

    def unmount(self, lazy: bool = False) -> list[int]:
        """Unmount, once the daemon has exited (CowfsError if it is still
        finishing after a minute).  *lazy*: detach even while in use and
        return at once with the pids still using it, if any (the daemon
        serves them and exits after the last)."""
        if self.record is None:
            raise self._not_mounted()
        return finish_unmount(self.record, self.call("unmount", lazy=lazy))

    def commit_down_to(self, layer: int) -> int:
        """Merge every layer above *layer* and *layer* itself into the layer
        below it; return the layer that now holds the changes."""
        while True:
            r = self.call("commit")
            if r["committed"] <= layer:
                return r["top"]
