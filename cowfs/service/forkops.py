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
from typing import TYPE_CHECKING, Any, cast

from .. import errors
from ..errors import AlreadyMounted, CowfsError, NotOwner
from ..layers import forkpoints, redo
from ..layers.past import History
from ..storage import schema
from ..system.mounts import mounts, mounts_users
from . import adopt, forkdiff
from . import forks as stacks
from .launch import fd_path, open_view_dir
from .restore import Restore
from .zygote import ZYGOTE

if TYPE_CHECKING:
    from ..layers.capture import Recorder
    from ..layers.ignore import IgnoreRules
    from ..layers.layerfiles import LayerFiles
    from ..layers.stackview import StackView
    from ..storage.store import Layer, Store
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
    stackview: StackView

    async def flush(self) -> None:
        raise NotImplementedError

    async def rollback(
        self,
        to: int | None = None,
        keep_redo: bool = True,
        yes: bool = False,
        skip_damaged: bool = False,
    ) -> dict:
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

    def _mount_args(self) -> dict:
        """What the fork's own mount takes over from its workspace's settings
        (the options of a mount)."""
        # (the zygote: the fork's view and daemon are forks of it, not new
        # interpreters; started at the first fork, it stays while this
        # daemon runs)
        ZYGOTE.start()
        limits = self.store.limits()
        return {
            "ignore": self.store.get_meta_json(schema.K_IGNORE) or [],
            "audit": limits.get("audit") or None,
        }

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
        # (from the fork point on, ignored paths are captured too: from
        # before the fork point is taken, so that no change at one slips in
        # between)
        self.recorder.ignore = None
        try:
            await self.flush()
            layer = self._shared_fork_point()
            opened = layer is None
            if layer is None:
                layer = self.files.checkpoint(message or f"fork {name}")
                self._switched(fresh=True)
            row = forkpoints.add(self.store, name, layer.id, layer.start, message, at)
        except BaseException:
            self.capture_filter()
            raise
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
            if opened:
                self._drop_checkpoint(layer.id)  # (its changes, if any, stay in the one below)
            raise
        forkpoints.set_state(self.store, name, forkpoints.LIVE)
        self.store.audit("fork", layer=layer.id, fork=name, message=message)
        return {"fork": name, "id": row["id"], "layer": layer.id, "path": where, "at": at}

    def _shared_fork_point(self) -> Layer | None:
        """The open layer, where it is another live fork's fork point and
        nothing was recorded since it opened: the tree is as it was there,
        ignored paths included (captured since, while that fork lives), so
        this fork starts there too rather than at an empty layer of its own
        (``best-of`` makes its forks at one layer)."""
        top = self.store.top()
        if top is None or self.store.next_seq != top.start or redo.segment(self.store) is not None:
            return None
        rows = forkpoints.forks(self.store).values()
        if any(r["layer"] == top.id and r["state"] == forkpoints.LIVE for r in rows):
            return top
        return None

    async def forks(self, changes: bool = False, brief: bool = False) -> dict:
        """`cowfs forks`: every fork, with where it is mounted, the disk space
        its own layer takes and the processes using it (and with *changes*,
        how many paths it changed since its fork point; *brief*: neither
        space nor processes, for a command's ``--fork``)."""
        table = {m.mountpoint: m for m in mounts()}
        rows = sorted(forkpoints.forks(self.store).items(), key=lambda i: i[1]["id"])
        # (the processes using each, in one pass over them all)
        users_of = {} if brief else self._users([row for _, row in rows], table)
        out = []
        for name, row in rows:
            _, merged = stacks.paths(self.workspace, row["id"])
            m = table.get(merged)
            users = users_of.get(row["id"], [])
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
                    "bytes": 0 if brief else stacks.upper_bytes(self.store.dirfd, row["id"]),
                    "users": users,
                }
            )
            if changes and out[-1]["mounted"]:
                found = await self.hooks.blocking(self._fork_changes, row)
                out[-1]["changes"] = len(found)
        return {"forks": out}

    def _users(self, rows: list[dict], table: dict | None = None) -> dict[int, list[int]]:
        """The processes using each fork of *rows*, by fork id (any
        namespace: ``run --fork`` binds the fork over the workspace's path)."""
        if table is None:
            table = {m.mountpoint: m for m in mounts()}
        live = {}
        for row in rows:
            m = table.get(stacks.paths(self.workspace, row["id"])[1])
            if m is not None and m.fstype == "fuse.cowfs":
                live[row["id"]] = m
        found = mounts_users(list(live.values()), any_namespace=True)
        me = {os.getpid()}
        return {fid: sorted(set(pids) - me) for fid, pids in zip(live, found, strict=True)}

    async def fork_changes(self, name: str) -> dict:
        """What fork *name* changed since its fork point, path by path
        (ignored paths included): its net changes, as `status` lists a
        layer's."""
        row = forkpoints.get(self.store, name)
        found = await self.hooks.blocking(self._fork_changes, row)
        return {
            "fork": name,
            "changes": [{"path": os.fsdecode(c.path), "kind": c.kind} for c in found],
        }

    async def fork_compare(self, a: str, b: str) -> dict:
        """`cowfs diff --fork A --fork B`: every path whose state differs
        between fork *a* and fork *b* as they are now, the kind of each as
        from *a* to *b*: found among what each changed since its fork
        point and what the workspace changed between their fork points
        (a path none of those holds is the same in both)."""
        rows = [forkpoints.get(self.store, name) for name in (a, b)]
        since = min(row["start"] for row in rows)
        ours = [os.fsencode(c["path"]) for c in self.stackview.changes_from(since)]
        found = await self.hooks.blocking(self._fork_compare, rows, ours)
        return {
            "forks": [a, b],
            "changes": [{"path": os.fsdecode(c.path), "kind": c.kind} for c in found],
        }

    def _fork_compare(self, rows: list[dict], ours: list[bytes]) -> list[forkdiff.Change]:
        paths = set(ours)
        for row in rows:
            paths.update(c.path for c in self._fork_changes(row))
        fds: list[int] = []
        try:
            for row in rows:
                merged = stacks.paths(self.workspace, row["id"])[1]
                try:
                    fds.append(os.open(merged, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
                except OSError as e:
                    why = f"fork {row['id']} is not mounted: {e.strerror}"
                    raise CowfsError(why, errors.NOT_MOUNTED) from None
            return forkdiff.compare_trees(fds[0], fds[1], paths)
        finally:
            for fd in fds:
                os.close(fd)

    def _fork_changes(self, row: dict) -> list[forkdiff.Change]:
        lower, merged = stacks.paths(self.workspace, row["id"])
        fds = []
        try:
            fds.append(stacks.open_upper(self.store.dirfd, row["id"]))
            for where in (lower, merged):
                fds.append(os.open(where, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        except OSError as e:
            for fd in fds:
                os.close(fd)
            why = f"fork {row['id']} is not mounted: {e.strerror}"
            raise CowfsError(why, errors.NOT_MOUNTED) from None
        try:
            return forkdiff.changes(*fds)
        finally:
            for fd in fds:
                os.close(fd)

    async def adopt(
        self,
        name: str,
        prefer: str | None = None,
        paths: dict | None = None,  # (str -> str: the control channel checks the outer type)
        force: bool = False,
    ) -> dict:
        """`cowfs adopt NAME`: fork *name*'s net changes since its fork point
        made in the workspace as one new layer, then the fork dropped (see
        cowfs/service/adopt.py).  A path both changed is a conflict, decided
        by *paths* (path -> "fork" or "parent"), else *prefer*; one left
        undecided refuses the adopt (exit 15) and nothing changes.  The fork
        is unmounted first (refused while processes use it, unless *force*).
        A failure, or a crash, leaves the workspace as it was before (the
        layer is rolled back) and the fork as it was."""
        self._require_root()
        paths = paths or {}
        for path, side in [(None, prefer), *paths.items()]:
            if not isinstance(path, str | None) or side not in (None, "fork", "parent"):
                raise CowfsError(f"bad choice {side!r}: fork or parent", errors.USAGE)
        row = forkpoints.get(self.store, name)
        if row["state"] != forkpoints.LIVE:
            raise CowfsError(f"fork {name} is {row['state']}", errors.NOT_MOUNTED)
        await self.flush()
        took = [time.monotonic()]
        if not force:
            await self._not_in_use(name, "adopt")
        took.append(time.monotonic())
        # the fork is quiet from now on: its own mount goes (the overlay stays)
        await self.hooks.blocking(stacks.stop_cowfs, self.workspace, {**row, "name": name}, force)
        took.append(time.monotonic())
        try:
            # (read once the fork is quiet; refused, it is mounted again as it was)
            chosen, skip, theirs = self._decide(name, row, prefer, paths or {})
            whole, attrs = adopt.plan([c for c in theirs if not _under(c.path, skip)])
        except BaseException:
            await self.hooks.blocking(self._remount_fork, name)
            raise
        took.append(time.monotonic())
        layer = self.files.checkpoint(f"adopt {name}")
        self._switched(fresh=True)
        self.store.set_meta_json(schema.K_ADOPTING, {"fork": name, "layer": layer.id})
        try:
            done = await self._apply_fork(name, row, whole, attrs)
        except BaseException as e:
            log.warning("adopt of fork %s failed (%s): rolling it back", name, e)
            await self._undo_adopt(layer.id)
            await self.hooks.blocking(self._remount_fork, name)
            raise
        took.append(time.monotonic())
        self.store.set_meta_json(schema.K_ADOPTING, None)
        forkpoints.set_state(self.store, name, forkpoints.DROPPING)
        await self.hooks.blocking(self._take_down, name, row, True)
        self.capture_filter()
        took.append(time.monotonic())
        log.info(
            "adopt of fork %s, %d paths: checked %.2f s, unmounted %.2f s, read %.2f s, "
            "made %.2f s, dropped %.2f s",
            name,
            len(done),
            *(b - a for a, b in zip(took, took[1:], strict=False)),
        )
        self.store.audit("adopt", fork=name, layer=layer.id, changed=done[:1000])
        return {"adopted": name, "layer": layer.id, "changed": done, "conflicts": chosen}

    def _decide(
        self, name: str, row: dict, prefer: str | None, paths: dict[str, str]
    ) -> tuple[list[dict], set[bytes], list[forkdiff.Change]]:
        """The conflicts, each with the side chosen; the paths whose
        changes in the fork are left out (the workspace's side chosen, or
        the fork changed their time alone and the workspace more); and the
        fork's changes.  Conflicts (exit 15) where one is left undecided."""
        ours = [dict(c) for c in self.stackview.changes_from(row["start"])]
        theirs = self._fork_changes(row)
        found = adopt.conflicts(theirs, ours)
        open_ = []
        for c in found:
            c["chosen"] = paths.get(c["path"]) or prefer
            if c["chosen"] is None:
                open_.append(c)
        if open_:
            raise adopt.Conflicts(name, open_)
        keep = {os.fsencode(c["path"]) for c in found if c["chosen"] == "parent"}
        return found, keep | adopt.yielded(theirs, ours), theirs

    async def _apply_fork(
        self, name: str, row: dict, whole: list[bytes], attrs: list[bytes]
    ) -> list[str]:
        _, merged = stacks.paths(self.workspace, row["id"])
        root = os.open(merged, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        source = adopt.ForkSource(self.store, root, name)
        ops = self.hooks.operations()
        r = Restore(ops, cast(History, source), self.requester)
        try:
            done = r.run(whole, attrs)
        finally:
            r.close()
            source.close()
            os.close(root)
            self.recorder.flush()
        await self.hooks.invalidate(r.invalid)
        return done

    async def _undo_adopt(self, layer: int) -> None:
        """Roll back an adopt's layer (what it made so far)."""
        await self.rollback(to=layer, keep_redo=False, yes=True)
        self.store.set_meta_json(schema.K_ADOPTING, None)

    async def resume_adopt(self) -> list[str]:
        """At a mount: an adopt a crash interrupted is rolled back (its fork
        is mounted again as it was)."""
        marker = self.store.get_meta_json(schema.K_ADOPTING)
        if marker is None:
            return []
        if marker["layer"] in {layer.id for layer in self.store.layers()}:
            await self._undo_adopt(marker["layer"])
        else:
            self.store.set_meta_json(schema.K_ADOPTING, None)
        return [
            f"the adopt of fork {marker['fork']} was interrupted: what it had made was "
            "rolled back; the fork is as it was"
        ]

    def _remount_fork(self, name: str) -> None:
        row = forkpoints.forks(self.store).get(name)
        if row is not None:
            stacks.start(
                self.rootfd,
                self.store.dirfd,
                self.hidden,
                self.workspace,
                row,
                self._mount_args(),
            )

    async def _not_in_use(self, name: str, what: str) -> None:
        """AlreadyMounted (exit 5), naming them, while processes use fork *name*."""
        row = forkpoints.get(self.store, name)
        users = self._users([row]).get(row["id"], [])
        if users:
            raise AlreadyMounted(
                f"fork {name} is in use by process{'es' if len(users) > 1 else ''} "
                f"{', '.join(map(str, users[:10]))}; stop them, or {what} it with --force"
            )

    async def drop(self, name: str, force: bool = False) -> dict:
        """`cowfs drop NAME`: unmount fork NAME and free everything it holds;
        refused while processes use it (AlreadyMounted, naming them) unless
        *force* (they lose the fork: its mounts are detached)."""
        self._require_root()
        row = forkpoints.get(self.store, name)
        if not force:
            await self._not_in_use(name, "drop")
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
        """At a mount: a fork still mounted is left as it is (forks outlive
        their workspace's mount and daemon), one whose own daemon died is
        mounted again; one whose making or dropping a crash interrupted is
        removed.  Returns warnings."""
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


def _under(path: bytes, tops: set[bytes]) -> bool:
    return any(path == t or path.startswith(t + b"/") for t in tops)
