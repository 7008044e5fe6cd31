"""The fork operations of a session: fork, forks, drop, and the forks'
part in a mount and an unmount of their workspace (the registry and the
pins are cowfs/layers/forkpoints.py, the mounts cowfs/service/forks.py).

While a workspace has forks its ignore rules are suspended: changes at
ignored paths are captured too (the forks read the fork point through the
records, and an ignored `node_modules` or build directory is part of it).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from .. import errors
from ..errors import AlreadyMounted, CowfsError, NotOwner
from ..layers import forkpoints
from ..storage import schema
from ..system.mounts import mount_users, mounts
from . import forks as stacks
from .launch import fd_path, open_view_dir

if TYPE_CHECKING:
    from ..layers.capture import Recorder
    from ..layers.ignore import IgnoreRules
    from ..layers.layerfiles import LayerFiles
    from ..storage.store import Store
    from ..system.access import Requester

log = logging.getLogger("cowfs.forks")


class Forking:
    """The fork operations of a session (``Session`` is one)."""

    workspace: str
    store: Store
    rootfd: int
    hidden: bytes | None
    rules: IgnoreRules | None
    recorder: Recorder
    files: LayerFiles
    requester: Requester
    hooks: Any  # (the session's MountHooks)

    async def flush(self) -> None:
        raise NotImplementedError

    def _switched(self, fresh: bool, undo: bool = False) -> None:
        raise NotImplementedError

    def _drop_checkpoint(self, layer_id: int) -> None:
        raise NotImplementedError

    def capture_filter(self) -> None:
        """The recorder ignores what the rules say, unless the workspace has forks."""
        self.recorder.ignore = None if forkpoints.forks(self.store) else self.rules

    def _require_root(self) -> None:
        if os.geteuid() != 0:
            raise CowfsError(
                "forks need the workspace's daemon to run as root (a fork is an overlay "
                "mount); mount the workspace as root",
                errors.USAGE,
            )
        if self.requester.uid not in (0, os.geteuid()):
            raise NotOwner("only the workspace's owner makes, adopts and drops forks")

    def _mount_args(self) -> list[str]:
        """What the fork's own mount takes over from its workspace's settings."""
        args = []
        for pattern in self.store.get_meta_json(schema.K_IGNORE) or []:
            args += ["--ignore", pattern]
        limits = self.store.limits()
        if limits.get("audit"):
            args += ["--audit", str(limits["audit"])]
        return args

    async def fork(self, name: str, message: str = "", at: str | None = None) -> dict:
        """`cowfs fork NAME`: a layer opens (the fork point) and fork NAME of
        the tree as it is now is mounted."""
        self._require_root()
        forkpoints.check_name(name)
        if name in forkpoints.forks(self.store):
            raise CowfsError(f"fork {name} exists already", errors.ALREADY_MOUNTED)
        if at is not None:
            # (checked before anything is made, and kept as the kernel names
            # the directory: not a mount point already, no planted link)
            fd = open_view_dir(at, self.rootfd, self.store.dirfd, 0)
            try:
                at = fd_path(fd)
            finally:
                os.close(fd)
        await self.flush()
        layer = self.files.checkpoint(message or f"fork {name}")
        self._switched(fresh=True)
        row = forkpoints.add(self.store, name, layer.id, layer.start, message, at)
        self.capture_filter()  # (from the fork point on, ignored paths too)
        try:
            where = await self.hooks.blocking(
                stacks.start,
                self.rootfd,
                self.store.dirfd,
                self.hidden,
                self.workspace,
                row,
                self._mount_args(),
            )
        except BaseException:
            stacks.remove(self.workspace, self.store.dirfd, row["id"])
            forkpoints.remove(self.store, name)
            self.capture_filter()
            self._drop_checkpoint(layer.id)  # (its changes, if any, stay in the one below)
            raise
        forkpoints.set_state(self.store, name, forkpoints.LIVE)
        self.store.audit("fork", layer=layer.id, fork=name, message=message)
        return {"fork": name, "id": row["id"], "layer": layer.id, "path": where, "at": at}

    async def forks(self) -> dict:
        """`cowfs forks`: every fork, with where it is mounted, the disk space
        its own layer takes and the processes using it."""
        table = {m.mountpoint: m for m in mounts()}
        out = []
        for name, row in sorted(forkpoints.forks(self.store).items(), key=lambda i: i[1]["id"]):
            _, merged = stacks.paths(self.workspace, row["id"])
            m = table.get(merged)
            users = mount_users(m) if m is not None and m.fstype == "fuse.cowfs" else []
            for where in row.get("at", []):
                if where in table:
                    users += mount_users(table[where])
            out.append(
                {
                    "name": name,
                    "id": row["id"],
                    "layer": row["layer"],
                    "created": row["created"],
                    "message": row["message"],
                    "state": row["state"],
                    "path": merged,
                    "at": row.get("at", []),
                    "mounted": m is not None and m.fstype == "fuse.cowfs",
                    "bytes": stacks.upper_bytes(self.store.dirfd, row["id"]),
                    "users": sorted(set(users) - {os.getpid()}),
                }
            )
        return {"forks": out}

    async def drop(self, name: str, force: bool = False) -> dict:
        """`cowfs drop NAME`: unmount fork NAME and free everything it holds;
        refused while processes use it (AlreadyMounted, naming them) unless
        *force* (they lose the fork: its mounts are detached)."""
        self._require_root()
        row = forkpoints.get(self.store, name)
        if not force:
            users = next(f for f in (await self.forks())["forks"] if f["name"] == name)["users"]
            if users:
                raise AlreadyMounted(
                    f"fork {name} is in use by process{'es' if len(users) > 1 else ''} "
                    f"{', '.join(map(str, users[:10]))}; stop them, or drop it with --force"
                )
        forkpoints.set_state(self.store, name, forkpoints.DROPPING)
        await self.hooks.blocking(self._take_down, name, row, force)
        self.capture_filter()
        self.store.audit("drop", fork=name, layer=row["layer"])
        return {"dropped": name, "layer": row["layer"]}

    def _take_down(self, name: str, row: dict, lazy: bool) -> None:
        stacks.stop(self.workspace, {**row, "name": name}, lazy=lazy)
        stacks.remove(self.workspace, self.store.dirfd, row["id"])
        forkpoints.remove(self.store, name)

    def resume(self) -> list[str]:
        """At a mount: every fork is mounted again (one still mounted, its
        daemons having outlived the workspace's, is left as it is); one whose
        making or dropping a crash interrupted is removed.  Returns warnings."""
        warnings: list[str] = []
        if not forkpoints.forks(self.store):
            return warnings
        if os.geteuid() != 0:
            return ["this workspace has forks, which need its daemon to run as root: not mounted"]
        args = self._mount_args()
        for name, row in sorted(forkpoints.forks(self.store).items(), key=lambda i: i[1]["id"]):
            t0 = time.monotonic()
            try:
                if row["state"] == forkpoints.LIVE:
                    stacks.start(
                        self.rootfd,
                        self.store.dirfd,
                        self.hidden,
                        self.workspace,
                        row,
                        args,
                    )
                    log.info("fork %s mounted in %.2f s", name, time.monotonic() - t0)
                else:
                    self._take_down(name, row, True)
                    warnings.append(
                        f"fork {name} was interrupted while being "
                        f"{'made' if row['state'] == forkpoints.CREATING else 'dropped'}: removed"
                    )
            except (OSError, CowfsError) as e:
                warnings.append(f"fork {name} could not be mounted: {e}")
        self.capture_filter()
        return warnings

    def stop_all(self, lazy: bool) -> None:
        """Before the workspace is unmounted: its forks are unmounted (they are
        mounted again with it).  Without *lazy*, one in use is AlreadyMounted
        and nothing is unmounted past it."""
        for name, row in sorted(forkpoints.forks(self.store).items(), key=lambda i: i[1]["id"]):
            try:
                stacks.stop(self.workspace, {**row, "name": name}, lazy=lazy)
            except AlreadyMounted as e:
                raise AlreadyMounted(
                    f"fork {name} is in use ({str(e).removeprefix(f'fork {name}: ')}): "
                    "stop what uses it, or use --lazy"
                ) from None
