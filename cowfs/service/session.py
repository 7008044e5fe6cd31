"""The session: one workspace's store opened for control operations --
checkpoint, rollback, commit, redo, providers, audit, status, log, gc,
check -- and the group operation a crash interrupted (the pending record),
resumed when the session opens.

The session is the one orchestrator of the layer lifecycle: it alone plans,
carries out and closes a group operation (checkpoint, rollback, redo,
commit) and its pending record (cowfs/layers/pending.py), running the provider
steps itself and the file part through ``layerfiles.LayerFiles``; what
it shows of the layers comes from ``stackview.StackView``.

A session is transport-neutral: the daemon serves its operations over the
control socket while the workspace is mounted, and offline commands call
them directly on an unmounted workspace.  The mount is a set of hooks the
session calls (``MountHooks``); a session without a mount has the base
class's, which do nothing.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import logging
import os
import resource
import time
from collections.abc import Callable, Sequence
from typing import Any

import trio

from .. import errors
from ..errors import (
    AlreadyMounted,
    BadWorkspace,
    CowfsError,
    Drift,
    NoStore,
    NothingToDo,
    StoreError,
)
from ..escalation.providers import Registry
from ..fuse.ops import Ops
from ..layers import forkpoints, fsck, pending, redo
from ..layers.capture import Recorder
from ..layers.ignore import IgnoreRules
from ..layers.layerfiles import Acting, LayerFiles, RollbackReport
from ..layers.listing import Changes, Encoded, plain_list
from ..layers.past import SHOW_PAGE, History, describe_past, diff_entry, diff_sides, wpath
from ..layers.stackview import StackView
from ..layers.steps import Helper
from ..storage import schema
from ..storage.schema import PendingRecord, RedoState
from ..storage.store import DEFAULT_CHUNK_SIZE, Store
from ..system import backing, progress
from ..system.access import BadGrant, Requester, parse_grant
from ..system.mounts import (
    VIEW_FSTYPE,
    default_store,
    finishing_daemon,
    is_cowfs_mount,
    mount_table,
    recover_stale_mount,
    store_in_use,
    wait_gone,
)
from ..text import count, quote
from . import operations
from .forkops import Forking
from .launch import start_view
from .restore import Denied, Invalid, restore

AUDIT_HASH_LIMIT = 64 << 20  # larger files get sizes only in the audit log
AUDIT_LEVELS = ("hashes", "changes", "events")
FINISHING_WAIT = 60  # seconds a mount waits for the last mount's daemon to exit
MAX_VIEWS = 4  # views a user other than the owner may have mounted at once
MAX_TEXT = 64 << 20  # the largest file `diff` reads whole for a text diff
MAX_TEXT_HELD = 256 << 20  # text one `diff` reads before it diffs the rest by size
# texts this small (both sides) are diffed as they are read: keeping their
# entry and bytes for later costs more than the diff (some 1 KB an entry)
SMALL_TEXT = 4096

log = logging.getLogger("cowfs.session")

# the control operations a session carries out (methods of these names)
OPS = operations.SESSION_OPS
TREE_OPS = operations.TREE_OPS  # refused on drift; the drift record follows them


def raise_fd_limit() -> None:
    """As many descriptors as this process may have: root raises its hard
    limit up to the kernel's ceiling (fs.nr_open; it needs
    CAP_SYS_RESOURCE), anyone the soft limit to the hard one.  The daemon
    keeps its backing descriptors below what it got, less a reserve
    (``inodes.fd_cache_size``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        with open("/proc/sys/fs/nr_open") as f:
            ceiling = int(f.read())
    except (OSError, ValueError):
        ceiling = 1 << 20
    if os.geteuid() == 0 and hard != resource.RLIM_INFINITY and hard < ceiling:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, ceiling))
            return
        except (ValueError, OSError):
            pass
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class MountHooks:
    """What a session asks of the mount that serves its workspace.  This
    base class is no mount at all (an offline session): nothing to flush,
    no kernel cache to invalidate."""

    async def flush(self) -> None:
        """Write the kernel's dirty pages of the mount to the daemon, so that
        every write completed so far belongs to the current layer."""

    async def blocking(self, fn: Callable, *args: Any) -> Any:
        """Run *fn* in a worker thread (file requests are served meanwhile)."""
        return await trio.to_thread.run_sync(fn, *args)

    async def wait(self, fn: Callable, *args: Any) -> Any:
        """Run *fn*, a wait the user may interrupt: offline in the command
        itself (Ctrl-C must reach it)."""
        return fn(*args)

    def layer_switched(self) -> None:
        """The open layer changed: files written through passthrough are
        captured whole in the new one."""

    async def after_undo(self, touched: Any) -> None:
        """An undo put things back: the inode table follows, and the
        kernel forgets what it cached of them."""

    def after_commit(self, freed: list) -> None:
        """A commit freed these grave entries (the inode table forgets them)."""

    def removed(self, inos: list) -> None:
        """A rollback removed these objects to make room: nothing of the
        mount may keep them (and their blocks) any longer."""

    def refused(self) -> dict | None:
        """The changes --max-store refused since the mount, if any."""
        return None

    def engine_info(self) -> dict | None:
        """Which FUSE engine serves the mount, why, and what it negotiated."""
        return None

    def operations(self) -> Ops | None:
        """The operations serving the mount (None: not mounted)."""
        return None

    async def invalidate(self, invalid: Invalid) -> None:
        """Changes made through the operations, not through the kernel: it
        forgets what it cached of these names and inodes."""


NO_MOUNT = MountHooks()


class Session(Forking):
    def __init__(
        self,
        workspace: str,
        mountpoint: str | None = None,
        store: str | None = None,
        chunk_size: int | None = None,
        max_store: int | None = None,
        max_layers: int | None = None,
        accept_drift: bool = False,
        ignore: list[str] | None = None,
        audit: str | None = None,
        allow: list[str] | None = None,
    ):
        self.workspace = os.path.abspath(workspace)
        self.mountpoint = os.path.abspath(mountpoint or workspace)
        self.store_dir = os.path.abspath(store or default_store(self.workspace))
        self.chunk_size = chunk_size
        self.limits: dict[str, int | str | None] = {
            "max_store": max_store,
            "max_layers": max_layers,
            "audit": audit,
        }
        self.accept_drift = accept_drift
        self.ignore_patterns = ignore  # None: the store's, as the last mount set them
        self.allow = allow  # --allow specs (None: the store's grants, as the last mount set them)
        self.grants: list[dict] = []
        self.warnings: list[str] = []
        self.hooks = NO_MOUNT
        # who asks for the operation under way (the daemon sets it for each
        # control request; offline, the command's own user)
        self.requester = Requester.this_process()
        self._offline_ops: Ops | None = None
        self._views: list[tuple[int, str]] = []  # (uid, mount point) of views started
        self._history_cache: tuple | None = None  # (store state, History) for show/diff
        self.rules: IgnoreRules | None = None  # the capture filter (None: not opened yet)
        # the mount daemon's helper process for a rollback's steps (see
        # cowfs/layers/steps.py), and where a rollback notes how far it has
        # got: given by ``attach``
        self.helper: Helper | None = None
        self.board: progress.Board = progress.LOCAL

    # -- opening and closing ------------------------------------------------------

    def open(self, create: bool = True, recovering: bool = False) -> None:
        """Open the workspace and its store (*create*: for a mount, which
        sets the store's limits and checks drift), and finish the group
        operation a crash interrupted.  *recovering*: a dead mount was
        cleared, so the stack is checked too."""
        if not os.path.isdir(self.workspace):
            raise BadWorkspace(f"workspace {self.workspace} does not exist or is not a directory")
        if not os.path.isdir(self.mountpoint):
            raise BadWorkspace(f"mount point {self.mountpoint} is not a directory")
        raise_fd_limit()
        self.rootfd = os.open(self.workspace, backing.DIR_FLAGS)

        def open_store() -> Store:
            return Store.open(
                self.store_dir,
                self.workspace,
                create=create,
                chunk_size=self.chunk_size or DEFAULT_CHUNK_SIZE,
            )

        try:
            self.store = open_store()
        except AlreadyMounted:
            # the daemon of the last mount may still be recording its state
            pid = finishing_daemon(self.store_dir)
            if pid is None:
                raise store_in_use(self.store_dir, self.workspace) from None
            t0 = time.monotonic()
            if not wait_gone(pid, FINISHING_WAIT):
                raise AlreadyMounted(
                    f"the daemon of the last mount of {self.workspace} (pid {pid}) is still "
                    f"finishing its unmount after {FINISHING_WAIT} s (recording the "
                    "workspace's state, closing the store); mount again once it has "
                    "exited"
                ) from None
            self.warnings.append(
                f"waited {time.monotonic() - t0:.1f} s for the daemon of the "
                f"last mount (pid {pid}) to finish its unmount"
            )
            self.store = open_store()
        inside = os.path.dirname(self.store_dir) == self.workspace
        self.hidden = os.fsencode(os.path.basename(self.store_dir)) if inside else None
        if create:  # a mount: its options (0 clears) change the store's limits
            self.store.set_limits(**{k: v for k, v in self.limits.items() if v is not None})
        resolver = backing.Resolver(self.rootfd, self.store.grave_fd)
        self.stackview = StackView(self.store, resolver)
        self.files = LayerFiles(self.store, resolver, self.stackview, on_freed=self._freed)
        if recovering:
            self.warnings += [f"store check: {p}" for p in self.stackview.check()]
        self.registry = Registry(self.store.dirfd, self.mountpoint)
        if create:
            self._check_drift()
        # An interrupted rollback resumes under the filters its layers were
        # captured with; a mount's new --ignore patterns apply from then on.
        self._load_ignore_rules()
        self.recorder = Recorder(self.store)  # (what resuming switches, it follows)
        record = self.pending()
        if record is not None and record.op == "checkpoint":
            self.warnings += self._resume_checkpoint(record)
        elif record is not None:
            self.warnings += trio.run(self._resume)
        if create and self.ignore_patterns is not None:
            self.store.set_meta_json(schema.K_IGNORE, self.ignore_patterns)
            self._load_ignore_rules()
        if create and self.allow is not None:
            try:
                grants = [parse_grant(spec) for spec in self.allow if spec]
            except BadGrant as e:
                raise CowfsError(str(e), errors.USAGE) from None
            self.store.set_meta_json(schema.K_GRANTS, grants)
        self.grants = self.store.get_meta_json(schema.K_GRANTS) or []
        self.resume_files()
        self.recorder = Recorder(self.store)
        self.capture_filter()

    def inspect(self, readonly: bool = True) -> None:
        """Open the workspace and its store as they are, for `cowfs check`
        (whose store may be damaged): nothing is resumed or changed (with
        *readonly*, nothing can be)."""
        self.rootfd = os.open(self.workspace, backing.DIR_FLAGS)
        try:
            self.store = Store.open(self.store_dir, self.workspace, create=False, readonly=readonly)
        except BaseException:
            os.close(self.rootfd)
            raise
        inside = os.path.dirname(self.store_dir) == self.workspace
        self.hidden = os.fsencode(os.path.basename(self.store_dir)) if inside else None
        resolver = backing.Resolver(self.rootfd, self.store.grave_fd)
        self.stackview = StackView(self.store, resolver)
        self.files = LayerFiles(self.store, resolver, self.stackview, on_freed=self._freed)
        self.recorder = Recorder(self.store, follow=False)
        try:
            self.recorder.reset(fresh=False)
        except StoreError:
            pass  # (layer records that fail their checksum: the check reports them)

    def attach(
        self,
        hooks: MountHooks,
        helper: Helper | None = None,
        board: progress.Board = progress.LOCAL,
    ) -> None:
        """The workspace is mounted: the session calls *hooks* from now on;
        *helper*: the process that takes rollback steps in batches (forked
        by the daemon before its threads start); *board*: where long
        operations post their progress for other clients."""
        self.hooks = hooks
        self.helper = helper
        self.board = board

    def close(self) -> None:
        if not self.store.readonly:
            self.store.sync()
        self.store.close()
        os.close(self.rootfd)

    def _load_ignore_rules(self) -> None:
        self.rules = IgnoreRules(self.rootfd, self.store.get_meta_json(schema.K_IGNORE) or [])

    def request_starts(self) -> None:
        """A control request starts: .cowfsignore applies as it is now."""
        if self.rules is not None:
            self.rules.stale = True

    def _check_drift(self) -> None:
        """Paths the layers changed that were changed again while the
        workspace was not mounted make the mount refuse (their undo data no
        longer fits them), unless accepted; accepted drift is logged."""
        recorded = self.store.get_meta_json(schema.K_DRIFT)
        if recorded is None:
            return
        drift = self.stackview.drift(recorded)
        if drift and self.accept_drift and forkpoints.forks(self.store):
            raise Drift(
                f"{len(drift)} path(s) the layers changed were changed while the workspace "
                "was not mounted, and it has forks "
                f"({', '.join(sorted(forkpoints.forks(self.store)))}) whose fork points "
                "that would change: drop them first, or put the paths back"
            )
        if drift and not self.accept_drift:
            shown = ", ".join(map(quote, drift[:10])) + (
                f" and {len(drift) - 10} more" if len(drift) > 10 else ""
            )
            raise Drift(
                f"{count(len(drift), 'path')} the layers changed "
                f"{'was' if len(drift) == 1 else 'were'} changed while the workspace "
                f"was not mounted: {shown}; a "
                "rollback would mix both; mount with --accept-drift to go on anyway"
            )
        if drift:
            self.files.discard_redo(
                "the workspace was changed while not mounted (mounted with --accept-drift)"
            )
            top = self.files.ensure_base()
            self.store.append_to_layer(top.id, "drift", [{"time": time.time(), "paths": drift}])
            self.warnings.append(
                f"accepted drift of {count(len(drift), 'path')} "
                "(recorded in the log): " + ", ".join(map(quote, drift[:10]))
            )
        # (no write: the first change captured makes the record stale)

    def holds_changes(self) -> bool:
        """Whether any layer holds a change."""
        return any(not self.files.layer_is_empty(layer.id) for layer in self.store.layers())

    def current_drift(self) -> list[str]:
        """Paths the layers changed that were changed again since the
        workspace's state was recorded (at the last unmount)."""
        recorded = self.store.get_meta_json(schema.K_DRIFT)
        return self.stackview.drift(recorded) if recorded else []

    def record_fingerprint(self) -> None:
        """At a clean unmount: what the layers' paths look like now."""
        try:
            self.store.set_meta_json(schema.K_DRIFT, self.stackview.fingerprint())
        except Exception:
            log.exception("could not record the workspace's state for drift detection")

    # -- the open layer --------------------------------------------------------------

    async def flush(self) -> None:
        """Every write completed so far belongs to the current layer: what
        the recorder holds, and what the mount's page cache holds."""
        self.recorder.flush()
        await self.hooks.flush()

    def _switched(self, fresh: bool, undo: bool = False) -> None:
        """The open layer changed: the recorder follows it (*fresh*: opened
        by this process), and files written through passthrough are
        captured whole in it (after an *undo*, the caller does that once the
        inode table knows where the undo put everything)."""
        self.recorder.reset(fresh=fresh)
        if not undo:
            self.hooks.layer_switched()

    def give_back_room(self) -> bool:
        """A change found no room (--max-store, a full disk) while the last
        rollback still holds what a redo needs: that goes (the change is
        tried again).  False when nothing was held."""
        note = redo.state(self.store)
        if note is None or (note.state != redo.READY and note.segment is None):
            return False
        self.recorder.flush()
        self.files.discard_redo(
            "the store needed the room it held for a change made since", fallback=True
        )
        self.recorder.reset(fresh=False)
        return True

    # -- checkpoint -------------------------------------------------------------------

    async def checkpoint(
        self,
        message: str = "",
        providers: list | None = None,
        containers: list | None = None,
        vms: list | None = None,
        agent: dict | None = None,
    ) -> dict:
        """Open a layer (with snapshots of *providers*, *containers* and
        *vms*).  *agent*: the agent event it stands for (see `agents`), kept
        on the layer: {"agent": str, "event": str, ...}, at most 16 KiB."""
        if agent is not None:
            check_agent_record(agent)
        providers = list(providers or [])
        for kind, key, names in (
            ("docker", "container", containers or []),
            ("libvirt", "domain", vms or []),
        ):
            for target in names:
                if not isinstance(target, str) or not target:
                    raise CowfsError(
                        "bad request: container and VM names are strings", errors.USAGE
                    )
                known = next(
                    (
                        name
                        for name, config in self.registry.configs().items()
                        if config.get("type") == kind and config.get(key) == target
                    ),
                    None,
                )
                if known is None and self.requester.uid not in (0, os.geteuid()):
                    # (snapshotting and recreating a container or VM acts as
                    # the daemon: only the owner names new ones)
                    raise errors.NotOwner(
                        f"the {kind} {key} {target!r} is not one of this workspace's "
                        "providers; only the workspace's owner may add one"
                    )
                providers.append(known or self.registry.ensure(kind, key, target))
        if not all(isinstance(p, str) for p in providers) or len(set(providers)) != len(providers):
            raise CowfsError("bad request: providers must be distinct names", errors.USAGE)
        chosen = [self.registry.get(name) for name in providers]  # unknown names fail first
        await self.flush()
        layer = self.files.checkpoint(message, agent)
        self._switched(fresh=True)
        taken: list[dict] = []
        t0 = time.perf_counter()
        if chosen:  # a crash while capturing: the next open removes what was taken
            with self.store.write() as w:
                pending.plan(w, pending.checkpoint(layer.id, providers))
        try:
            for provider in chosen:
                ctx = self.registry.context(provider.name, layer.id)
                data = await self.hooks.blocking(provider.capture, ctx)
                taken.append(
                    {
                        "provider": provider.name,
                        "data": data,
                        "seconds": round(time.perf_counter() - t0, 3),
                    }
                )
                t0 = time.perf_counter()
            if taken:
                with self.store.write() as w:
                    self.store.set_snapshots(layer.id, taken, w)
                    pending.close(w, layer.id)
        except Exception as e:
            # All or nothing: discard what was taken and drop the new layer.
            failed = chosen[min(len(taken), len(chosen) - 1)].name
            leftovers = []
            for snap in reversed(taken):
                try:
                    await self._apply("discard", snap["provider"], layer.id, snap["data"])
                except Exception as e2:
                    leftovers.append(f"; discarding {snap['provider']}'s snapshot failed: {e2}")
            self.registry.drop_state(self.registry.context(failed, layer.id))
            self._drop_checkpoint(layer.id)
            raise CowfsError(
                f"checkpoint failed: provider {failed!r}: {e}; "
                "nothing was taken" + "".join(leftovers),
                errors.DAEMON_ERROR,
            ) from None
        info = self.store.get_layer(layer.id).to_dict()
        self.store.audit(
            "checkpoint",
            layer=layer.id,
            message=message,
            snapshots=[t["provider"] for t in taken],
            **({"agent": agent} if agent else {}),
        )
        merged = await self._enforce_max_layers()
        if merged:
            info["merged"] = merged
        return info

    def _drop_checkpoint(self, layer_id: int) -> None:
        """Undo a checkpoint that failed (or a crash interrupted) while taking
        snapshots: its layer merges into the one below, so changes programs
        made meanwhile are kept, and the pending record is cleared."""
        top = self.store.top()
        if top is not None and top.id == layer_id and len(self.store.layers()) > 1:
            self.files.commit()
        self.finish_pending()
        self._switched(fresh=False)

    def _resume_checkpoint(self, record: PendingRecord) -> list[str]:
        """A crash interrupted a checkpoint's captures: discard what each
        provider may have taken for that layer, and drop the checkpoint."""
        layer, problems = record.layer, []
        assert layer is not None  # (a checkpoint's record names its layer)
        for name in record.providers or []:
            try:
                ctx = self.registry.context(name, layer)
                self.registry.get(name).forget(ctx)
                self.registry.drop_state(ctx)
            except Exception as e:
                problems.append(
                    f"discarding what provider {name} took for layer {layer} failed: {e}"
                )
        self._drop_checkpoint(layer)
        return [
            f"a checkpoint (layer {layer}) was interrupted while taking snapshots of "
            f"{', '.join(record.providers or [])}: what they took was discarded and "
            f"the layer merged into the one below"
        ] + problems

    async def _enforce_max_layers(self) -> list[int]:
        """--max-layers: merge the oldest layers above the base into it
        (their snapshots are discarded), so undo back to the base is kept."""
        merged = []
        limit = self.store.limits().get("max_layers")
        while limit and len(self.store.layers()) - 1 > limit:
            merged.append(self.files.merge_into_base())
            await self._carry_out()
        return merged

    # -- group operations: the pending record (see cowfs/layers/pending.py) ------------------
    # The session plans it, carries out its provider steps and has the files
    # carried out (cowfs/layers/layerfiles.py), and closes it.

    def pending(self) -> PendingRecord | None:
        return self.store.pending()

    def planned(self) -> PendingRecord:
        """The pending record, where one must be (an operation planned it
        and it is not finished yet)."""
        record = self.pending()
        if record is None:
            raise StoreError("no group operation is pending")
        return record

    def finish_pending(self) -> PendingRecord | None:
        """Close the pending group operation: keep the restores' post-mortems
        with the layer the workspace is now at, and clear the record.
        Returns the record as it was."""
        if self.pending() is None:
            return None
        top = self.files.ensure_base()
        with self.store.write() as w:
            return pending.close(w, top.id)

    def plan_rollback(
        self,
        to: int | None = None,
        keep_redo: bool = True,
        base: bool = True,
        skip_damaged: bool = False,
    ) -> PendingRecord:
        """Check a rollback (down to and including layer *to*; default: the
        top layer) and write its pending record: the restores of the dropped
        layers' snapshots (top layer first, last taken first), the files,
        then the discards of those snapshots.  Nothing is changed yet but
        freeing what an earlier rollback kept for a redo.  *keep_redo*: keep
        what a redo of this one needs (impossible with provider snapshots).
        Without *base*, a rollback of the top layer that is the base layer
        (everything since the mount or the last commit) is refused."""
        to, dropping, below = self.files.rollback_layers(to, base)
        record = pending.rollback(to, dropping, skip_damaged)
        self.files.discard_redo("another rollback was made")
        why = self.files.why_no_redo(keep_redo, dropping)
        try:
            with self.store.write() as w:
                pending.plan(w, record)
                redo.begin(w, to, sorted(layer.id for layer in dropping), below, why)
        except OSError:
            # a full disk: the rollback itself must still be possible
            with self.store.write() as w:
                pending.plan(w, record)
        return record

    def plan_redo(self) -> RedoState:
        """Check that the last rollback can be undone now and write the
        pending record of its redo."""
        state = self.files.check_redo()
        with self.store.write() as w:
            redo.start(w)
            pending.plan(w, pending.redo())
        return state

    def resume_files(self) -> RollbackReport | None:
        """Finish the file part of a group operation that was interrupted by
        a crash.  Provider steps left in the pending record are run before
        and after this (``_resume``); the record is closed here only when
        none is left."""
        record = self.pending()
        report = None
        if record is not None:
            if pending.files_left(record):
                report = self.files.apply(record, self._acting())
            if not pending.steps_left(record):
                self.finish_pending()
        if self.pending() is None:
            self.files.seal_interrupted_redo()
        self.files.sweep_graves()
        self.files.ensure_base()
        return report

    def _acting(self) -> Acting:
        """How the files of the group operation under way are put back."""
        return Acting(
            ignored=self.rules.matches if self.rules is not None else None,
            on_removed=self.hooks.removed,
            helper=self.helper,
            board=self.board,
        )

    def _freed(self, inos: list[int]) -> None:
        """What a discarded redo held in the grave is gone (the mount's
        inode table forgets it)."""
        self.hooks.after_commit(inos)

    async def _apply(self, do: str, name: str, layer: int, data: dict) -> dict | None:
        """Restore or discard one provider snapshot; a restore may return a
        post-mortem."""
        provider = self.registry.get(name)
        ctx = self.registry.context(name, layer)
        if do == "restore":
            return await self.hooks.blocking(provider.restore, ctx, data)
        await self.hooks.blocking(provider.discard, ctx, data)
        self.registry.drop_state(ctx)
        return None

    async def _provider_steps(self, do: str) -> list[str]:
        """Run the pending record's *do* steps that have not finished, each
        marked in the store before it runs and after it; return what ran."""
        ran = []
        for i, step in enumerate(self.planned().all_steps):
            if step.do != do or step.state in pending.FINISHED:
                continue
            what = f"{do} {step.provider} of layer {step.layer}"
            ran.append(what + (" (again: it was interrupted)" if step.state == "started" else ""))
            self._mark_step(i, state="started")
            t0 = time.perf_counter()
            result: dict[str, Any]
            try:
                postmortem = await self._apply(do, step.provider, step.layer, step.data)
                result = {"state": "done"}
            except Exception as e:
                postmortem = getattr(e, "postmortem", None)
                result = {"state": "failed", "error": f"{what}: {e}"}
            if postmortem:  # kept (with the layer the workspace is back at) even on failure
                result["postmortem"] = {**postmortem, "layer": step.layer, "time": time.time()}
            self._mark_step(i, seconds=round(time.perf_counter() - t0, 3), **result)
        return ran

    def _mark_step(self, index: int, **fields: Any) -> None:
        pending.mark_step(self.store, index, **fields)

    async def _carry_out(self) -> tuple[PendingRecord | None, RollbackReport | None, list[str]]:
        """Carry out the pending group operation from where it stands:
        provider restores, the files, provider discards.  Returns the closed
        pending record, the file rollback's report (when it ran now) and the
        provider steps that ran now."""
        if self.pending() is None:
            return None, None, []
        ran = await self._provider_steps("restore")
        report = None
        record = self.planned()
        if pending.files_left(record):
            before = self.store.top()
            try:
                report = self.files.apply(record, self._acting())
            finally:
                # a rollback of every layer opens a fresh base, one that
                # keeps what a redo needs a segment: memory knows all they
                # hold (nothing); a redo's layers are known from the store
                top = self.store.top()
                self._switched(
                    fresh=record.op == "rollback"
                    and top is not None
                    and before is not None
                    and (top.id > before.id or redo.segment(self.store) is not None),
                    undo=True,
                )
            await self.hooks.after_undo(report.touched)
        ran += await self._provider_steps("discard")
        return self.finish_pending(), report, ran

    async def _resume(self) -> list[str]:
        """Finish the group operation a crash interrupted (when the session
        opens); the warnings that say what was done."""
        op = self.planned().op or "operation"
        record, report, ran = await self._carry_out()
        warnings = []
        if report is not None:
            warnings.append(
                f"finished an interrupted {op} ({count(report.applied, 'step')}"
                + (f", {len(report.failures)} failed" if report.failures else "")
                + ")"
            )
            warnings += report.failures
            if report.stopped:
                warnings.append(f"the interrupted {op} did not finish: {report.stopped}")
        if ran:
            warnings.append(f"finished the provider work of an interrupted {op}: " + ", ".join(ran))
        return warnings + step_failures(record)

    async def _finish_leftover(self) -> None:
        """A group operation left pending by an unexpected error is carried
        out before a new one is planned over it."""
        if self.pending() is not None:
            record, report, _ = await self._carry_out()
            assert record is not None  # (it was pending: now closed)
            log.warning(
                "finished a pending %s: %s",
                record.op,
                step_failures(record) + (report.failures if report else []),
            )

    async def commit(self) -> dict:
        await self.flush()
        await self._finish_leftover()
        kept = self._audit_changes(
            self.store.open_layer().id, hashes=self._audit_level() == "hashes"
        )
        info = self.files.commit()
        self._audit_events(
            {
                "event": "commit",
                "layer": info["committed"],
                "into": info["into"],
                "changes": len(kept),
            },
            kept,
            layer=info["committed"],
        )
        self._switched(fresh=info["into"] is None)
        self.hooks.after_commit(info.pop("freed", []))
        # The merged (or now permanent) layer's snapshots are no longer needed:
        # a rollback goes back to the older snapshots of the layer below.  The
        # commit recorded their discards as pending; carry them out.
        record, _, _ = await self._carry_out()
        failures = step_failures(record)
        if failures:
            info["warnings"] = failures
        return info

    async def rollback(
        self,
        to: int | None = None,
        keep_redo: bool = True,
        yes: bool = False,
        skip_damaged: bool = False,
    ) -> dict:
        """Roll back the top layer, or down to and including layer *to*.  A
        rollback of the top layer when it is the base layer (everything
        since the mount) is refused unless *yes* (naming it with *to* is
        explicit enough).  A step that cannot be taken (a damaged record, a
        corrupt pre-image) leaves its layer in place with what it could not
        undo, unless *skip_damaged* gives that up; a full disk or an I/O
        error stops the rollback, which the same call finishes later."""
        await self.flush()
        await self._finish_leftover()
        # An unknown id, or nothing to roll back, fails before anything runs.
        planned = self.plan_rollback(to, keep_redo=keep_redo, base=yes, skip_damaged=skip_damaged)
        assert planned.to is not None  # (a rollback's record names its layer)
        undone = self._audit_changes(planned.to, hashes=False, planned=True)
        # Providers first (they were taken after their layer was opened), last
        # first; then the files; then the dropped snapshots are discarded.
        record, report, _ = await self._carry_out()
        # (planned just now, with its file part still to do)
        assert record is not None and report is not None
        provider_steps = record.all_steps
        result = report.to_dict()
        result["restored"] = [
            {"provider": s.provider, "layer": s.layer, "seconds": s.seconds}
            for s in provider_steps
            if s.do == "restore" and s.state == "done"
        ]
        # (kept with the layer the workspace is back at)
        result["postmortems"] = [s.postmortem for s in provider_steps if s.postmortem]
        failures = report.failures + step_failures(record)
        self._audit_events(
            {
                "event": "rollback",
                "layer": result["top"],
                "dropped": result["dropped"],
                "failures": failures,
            }
            | ({"stopped": report.stopped} if report.stopped else {}),
            undone,
            undone=True,
        )
        if report.stopped:
            raise errors.PartialFailure(
                "rollback did not finish: " + report.stopped + "".join(f"\n  {f}" for f in failures)
            )
        if failures:
            raise errors.PartialFailure(
                "rollback finished with failures:\n  " + "\n  ".join(failures)
            )
        return result

    async def redo(self) -> dict:
        """Undo the last rollback, exactly, if nothing changed since;
        otherwise say why not and change nothing."""
        await self.flush()
        await self._finish_leftover()
        state = self.plan_redo()
        _, report, _ = await self._carry_out()
        assert report is not None  # (planned just now, with its file part still to do)
        result = report.to_dict()
        redone = self._audit_changes(state.to, hashes=False)
        self._audit_events(
            {
                "event": "redo",
                "layer": result["top"],
                "restored": result["restored"],
                "failures": report.failures,
            },
            redone,
            redone=True,
        )
        if report.failures:
            raise errors.PartialFailure(
                "redo finished with failures:\n  " + "\n  ".join(report.failures)
            )
        return result

    # -- providers ----------------------------------------------------------------------

    def provider_add(
        self,
        name: str,
        type: str,
        capture: str = "",
        restore: str = "",
        discard: str = "",
        container: str = "",
        domain: str = "",
        diagnostics: str = "",
        health: str = "",
    ) -> dict:
        if type == "docker":
            config = {"type": type, "container": container}
        elif type == "libvirt":
            config = {"type": type, "domain": domain, "diagnostics": diagnostics, "health": health}
        else:
            config = {"type": type, "capture": capture, "restore": restore, "discard": discard}
        self.registry.add(name, config)
        return {"name": name}

    def provider_remove(self, name: str) -> dict:
        in_use = [
            layer.id
            for layer in self.store.layers()
            if any(s["provider"] == name for s in layer.snapshots)
        ]
        if in_use:
            raise CowfsError(
                f"provider {name!r} has snapshots in layers "
                f"{', '.join(map(str, in_use))}; roll back or commit them first",
                errors.USAGE,
            )
        self.registry.remove(name)
        return {"name": name}

    def provider_list(self) -> dict:
        return {"providers": [{"name": n, **c} for n, c in self.registry.configs().items()]}

    # -- looking at the stack -------------------------------------------------------------

    async def status(self, paths: list | None = None, times: bool = False) -> dict:
        """The open layer's net changes (under *paths*; with *times*, also
        the paths whose modification time alone differs), the store's
        usage, the changes --max-store refused since the mount, the redo
        note."""
        await self.flush()
        result = self.stackview.status(paths=path_list(paths), times=bool(times))
        self._paths_found(None, path_list(paths), result["changes"])
        result["changes"] = self._writers_shown(result["changes"])
        return result | {
            "usage": self.stackview.usage(),
            "refused": self.hooks.refused(),
            "redo": self.stackview.redo_note(),
            "engine": self.hooks.engine_info(),
        }

    async def gc(self) -> dict:
        """Free what nothing needs: unused chunks, grave files no record
        holds, stale index entries; report what was freed."""
        await self.flush()
        result = self.files.gc()
        self.recorder.reset(fresh=False)
        return result

    async def changes(
        self, since: int | None = None, paths: list | None = None, times: bool = False
    ) -> dict:
        """Net changes since layer *since* was opened (default: the top),
        under *paths* if given (*times*: see ``status``)."""
        await self.flush()
        since = self.store.open_layer().id if since is None else since
        changes = self.stackview.changes_since(since, path_list(paths), bool(times))
        self._paths_found(since, path_list(paths), changes)
        return {
            "since": since,
            "changes": self._writers_shown(changes),
            "times_only": changes.times_only,
        }

    def _paths_found(self, layer: int | None, paths: list[str], changes: Sequence[dict]) -> None:
        """Each of *paths* (that *changes*, since *layer* was opened, were
        filtered by) that no change is under names something, now or then;
        else NothingToDo naming it (as git's "pathspec did not match")."""
        left = {os.fsdecode(wpath(p)) for p in paths}
        if "" in left:  # (the root)
            return
        for c in changes:
            if not left:
                return
            for p in (c["path"], c.get("from")):
                if p is not None:
                    left = {w for w in left if p != w and not p.startswith(w + "/")}
        if not left:
            return
        h = self._history(layer)
        for w in sorted(left):
            if not h.named(os.fsencode(w), self.requester):
                raise NothingToDo(f"no such path, now or when layer {h.layer} was opened", path=w)

    def _writers_shown(self, changes: Sequence[dict]) -> Sequence[dict]:
        """*changes* as the requester may see them: the command line of a
        writer that is another user's process is its own business (it may
        carry a password); a user other than the owner sees its pid and
        uid only."""
        who = self.requester
        if who.uid in (0, os.geteuid()):
            return changes
        return [
            c | {"who": {k: v for k, v in c["who"].items() if k != "cmd"}}
            if isinstance(c.get("who"), dict) and c["who"].get("uid") != who.uid
            else c
            for c in changes
        ]

    async def log(self, limit: int | None = None) -> dict:
        """The layers, oldest first (with *limit*: that many of the newest)."""
        await self.flush()
        if limit is not None and limit < 1:
            raise CowfsError("bad request: limit must be positive", errors.USAGE)
        return {"layers": self.stackview.log(limit), "redo": self.stackview.redo_note()}

    # -- reading the past (cowfs/layers/past.py) ---------------------------------------------

    def _history(self, layer: int | None) -> History:
        """The history since *layer* (default: the open layer) was opened,
        kept while the store does not change."""
        layer = self.store.open_layer().id if layer is None else layer
        key = (layer, self.store.next_seq, tuple(x.id for x in self.store.layers()))
        cached = self._history_cache
        if cached is None or cached[0] != key:
            cached = (
                key,
                History(
                    self.store,
                    self.stackview.resolver,
                    layer,
                    self.hidden,
                    self.stackview.reading(layer, since=True),
                ),
            )
            self._history_cache = cached
        return cached[1]

    async def show(
        self,
        layer: int | None = None,
        path: str = "",
        offset: int = 0,
        size: int = SHOW_PAGE,
        missing_ok: bool = False,
    ) -> dict:
        """What *path* was when *layer* was opened: its status, and a page of
        its bytes (base64), its symlink target or its directory entries."""
        await self.flush()
        h = self._history(layer)
        if not h.readable(wpath(path), self.requester):
            raise Denied(
                f"not yours to read as it was when layer {h.layer} was opened "
                f"(uid {self.requester.uid})",
                path=os.fsdecode(wpath(path)) or ".",
            )
        obj = h.need(wpath(path)) if not missing_ok else h.object_at(wpath(path))
        if obj is None:
            return {"path": path, "kind": None, "layer": h.layer}
        return describe_past(h, obj, offset, max(0, min(size, SHOW_PAGE))) | {"layer": h.layer}

    async def diff(
        self,
        since: int | None = None,
        paths: list | None = None,
        text_limit: int = 8 << 20,
        times: bool = False,
    ) -> dict:
        """Changes since layer *since* was opened, each with both sides'
        sizes and hashes and, for text, a unified diff (*times*: see
        ``status``)."""
        await self.flush()
        text_limit = max(0, min(text_limit, MAX_TEXT))
        h = self._history(since)
        changes = self.stackview.changes_since(h.layer, path_list(paths), bool(times))
        self._paths_found(h.layer, path_list(paths), changes)
        who = self.requester

        # Every side is read while the tree holds still (one instant); the
        # text diffs are computed afterwards, while file requests are served,
        # from at most MAX_TEXT_HELD bytes of text held at once (those of
        # small texts at once).  An entry that is complete is kept as its
        # JSON text (a third of its dicts).
        entries: list[dict | Encoded] = []
        todo: list[tuple[int, Callable[[], None]]] = []
        held = 0
        for c in self._writers_shown(changes):
            new = wpath(c["path"]) if c["path"] != "." else b""
            old = wpath(c["from"]) if c.get("from") else new
            if (c["kind"] == "A" or h.readable(old, who)) and (
                c["kind"] == "D" or h.readable_now(new, who)
            ):
                room = text_limit if held < MAX_TEXT_HELD else 0
                out, finish = diff_sides(h, c, room, sample=True)
                if finish is not None:
                    size = sum(out.get(s, {}).get("size", 0) for s in ("old", "new"))
                    if size <= SMALL_TEXT:
                        finish()
                        finish = None
                    else:
                        todo.append((len(entries), finish))
                        held += size
                        entries.append(out)
                if finish is None:
                    entries.append(Encoded.of(out))
            else:
                entries.append(Encoded.of(c | {"binary": False, "unreadable": True}))  # (names)

        def texts() -> None:
            for i, finish in todo:
                finish()
                entries[i] = Encoded.of(entries[i])

        if todo:
            await self.hooks.blocking(texts)
        return {"since": h.layer, "changes": entries, "times_only": changes.times_only}

    async def restore(self, paths: list, layer: int | None = None) -> dict:
        """Put *paths* back as they were when *layer* (default: the open
        layer) was opened, as a change of the open layer (see
        cowfs/service/restore.py), with the requester's rights."""
        await self.flush()
        rels = [wpath(p) for p in path_list(paths)]
        layer = self.store.open_layer().id if layer is None else layer
        self.store.get_layer(layer)
        ops = self.hooks.operations()
        if ops is None:
            if self._offline_ops is None:
                self._offline_ops = Ops(self.rootfd, self.store, self.recorder, hidden=self.hidden)
            ops = self._offline_ops
        h = History(self.store, self.stackview.resolver, layer, self.hidden)
        try:
            done, invalid = restore(ops, h, self.requester, rels)
        finally:
            self.recorder.flush()
        await self.hooks.invalidate(invalid)
        self.store.audit(
            "restore",
            layer=self.store.open_layer().id,
            paths=list(paths),
            uid=self.requester.uid,
            restored=done[:1000],
            **{"from": layer},
        )
        return {"restored": done, "from": layer}

    async def view(self, layer: int, mountpoint: str) -> dict:
        """`cowfs view`: mount the tree as it was when *layer* was opened,
        read-only, at *mountpoint*, in a process of its own.  A user other
        than the owner (granted `read`) has at most MAX_VIEWS at once: each
        is a process of the daemon's that only the owner can end."""
        self.store.get_layer(layer)
        uid = self.requester.uid
        if uid not in (0, os.geteuid()):
            table = mount_table()
            self._views = [(u, mp) for u, mp in self._views if table.get(mp) == VIEW_FSTYPE]
            if sum(u == uid for u, _ in self._views) >= MAX_VIEWS:
                raise AlreadyMounted(
                    f"uid {uid} has {MAX_VIEWS} views of this workspace mounted already; "
                    "the workspace's owner ends them (cowfs unmount DIR)"
                )
        await self.flush()
        result = await self.hooks.wait(
            start_view,
            self.rootfd,
            self.store.dirfd,
            layer,
            mountpoint,
            self.hidden,
            uid,
        )
        self._views.append((uid, result["mountpoint"]))
        return result

    # -- the audit log --------------------------------------------------------------------

    def _audit_level(self) -> str:
        return self.store.limits().get("audit") or "hashes"

    def _audit_events(self, event: dict, changes: Sequence[dict], **fields: Any) -> None:
        """Write *event* and a change event for each of *changes* (with
        *fields*) to the audit log, made as they are written (a rollback of
        200,000 changes held two lists of as many dicts)."""
        self.store.audit_many(
            itertools.chain([event], ({"event": "change", **c, **fields} for c in changes))
        )

    def _audit_changes(self, since: int, hashes: bool, planned: bool = False) -> Sequence[dict]:
        """Change events for what changed since layer *since* opened: path,
        kind, writer and, with *hashes*, both sides' sizes and xxh3 (files
        up to AUDIT_HASH_LIMIT; larger ones get sizes only; a sparse file
        holding up to AUDIT_HASH_LIMIT of data gets the digest of what it
        holds, ``xxh3_data``, reading only that: see ``past.diff_sides``).
        What it reads follows the files' data, not their sizes.  None at audit
        level "events".  *planned*: for the rollback planned now (to
        *since*: see ``StackView.undone``)."""
        if self._audit_level() == "events":
            return []
        try:
            if not hashes:  # (each made into a dict as it is written: ``_audit_events``)
                return (
                    self.stackview.undone(since) if planned else self.stackview.changes_since(since)
                )
            h = History(
                self.store,
                self.stackview.resolver,
                since,
                self.hidden,
                self.stackview.reading(since, since=True),
            )
            out = []
            for c in self.stackview.changes_since(since):
                d = diff_entry(
                    h, c, text_limit=0, hash_limit=AUDIT_HASH_LIMIT, data_limit=AUDIT_HASH_LIMIT
                )
                out.append(
                    {
                        "event": "change",
                        "path": d["path"],
                        "kind": d["kind"],
                        "from": d.get("from"),
                        "who": d.get("who"),
                        "before": d.get("old"),
                        "after": d.get("new"),
                    }
                )
            return out
        except Exception:
            log.exception("audit: could not list the changes of layer %s", since)
            return []

    def audit(self, after: int = 0, since_layer: int | None = None, limit: int = 10000) -> dict:
        """Audit events after number *after* (or from layer *since_layer*'s
        checkpoint on), at most *limit*."""
        if since_layer is not None and not self.store.layer_existed(since_layer):
            raise errors.UnknownLayer(
                f"no layer {since_layer} (layers so far: 1 to {self.store.last_layer_id()})"
            )
        events = []
        started = since_layer is None
        for e in self.store.audit_events(after):
            if not started and since_layer is not None:  # (not started: a layer given)
                started = (
                    e.get("event") == "checkpoint"
                    and e.get("layer") == since_layer
                    or (e.get("layer") or 0) >= since_layer
                )
                if not started:
                    continue
            events.append(e)
            if len(events) >= limit:
                break
        return {"events": events}

    def audit_prune(self, days: float) -> dict:
        """Drop audit events older than *days* (the audit's own retention)."""
        if days < 0:
            raise CowfsError("bad request: days must not be negative", errors.USAGE)
        return {"pruned": self.store.prune_audit(time.time() - days * 86400)}

    def audit_note(self, event: str, fields: dict) -> dict:
        """An event a client carried out through the mount (restore)."""
        if event not in ("restore",) or len(json.dumps(fields)) > 1 << 20:
            raise CowfsError("bad request: unknown audit event", errors.USAGE)
        self.store.audit(event, layer=self.store.open_layer().id, **fields)
        return {}

    def annotate(self, layer: int, run: dict) -> dict:
        """Record a `cowfs run` step on a layer."""
        required = {"command": str, "outcome": str, "exit_status": int}
        for key, kind in required.items():
            if not isinstance(run.get(key), kind) or isinstance(run.get(key), bool):
                raise CowfsError(
                    f"bad request: a run record needs {key!r} ({kind.__name__})", errors.USAGE
                )
        # (what `log` reads of a record, of the type it expects: any user
        # granted `step` may annotate)
        optional: dict[str, tuple[type, ...]] = {
            "verify_status": (int, type(None)),
            "started": (int, float),
            "duration": (int, float),
            "changes": (int,),
            "layer": (int, type(None)),
        }
        for key, kinds in optional.items():
            if key in run and (not isinstance(run[key], kinds) or isinstance(run[key], bool)):
                raise CowfsError(
                    f"bad request: a run record's {key!r} has the wrong type", errors.USAGE
                )
        if len(json.dumps(run)) > 64 << 10:
            raise CowfsError("bad request: the run record is too large", errors.USAGE)
        self.store.get_layer(layer)
        self.store.append_to_layer(layer, "runs", [run])
        return {"layer": layer}

    # -- checking the store ---------------------------------------------------------------

    async def check(self, full: bool = False) -> dict:
        """The stack's quick consistency check, or with *full* `cowfs check`
        (chunk hashes too).  Both run on the trio thread: the file system's
        handlers wait, so the store cannot change while it is read."""
        await self.flush()
        if not full:
            return {"problems": self.stackview.check()}
        return fsck.check(self.store).to_dict()

    async def repair(self) -> dict:
        """`cowfs check --repair`: check, repair what can be repaired without
        inventing data, check again (with the handlers waiting throughout)."""
        await self.flush()
        done = fsck.repair(self.store, fsck.check(self.store), self.files.discard_redo)
        self.recorder.reset(fresh=False)
        return {"repaired": done, **fsck.check(self.store).to_dict()}


async def invoke(fn: Callable, **args: Any) -> Any:
    """Call a session operation, plain or async."""
    result = fn(**args)
    return await result if inspect.isawaitable(result) else result


def path_list(paths: list | None) -> list[str]:
    """Workspace-relative paths from a request."""
    if not all(isinstance(p, str) for p in paths or ()):
        raise CowfsError("bad request: paths are strings", errors.USAGE)
    return list(paths or ())


def check_agent_record(agent: dict) -> None:
    """An agent record (checkpoint) names its agent and event (strings)
    and is small."""
    for key in ("agent", "event"):
        if not isinstance(agent.get(key), str) or not agent[key]:
            raise CowfsError(f"bad request: an agent record needs {key!r} (a string)", errors.USAGE)
    if len(json.dumps(agent)) > 16 << 10:
        raise CowfsError("bad request: the agent record is too large", errors.USAGE)


def step_failures(record: PendingRecord | None) -> list[str]:
    """The failed provider steps of a closed pending record, by name."""
    steps = record.all_steps if record is not None else ()
    return [s.error for s in steps if s.state == "failed" and s.error is not None]


def open_offline(workspace: str, store: str | None) -> Session:
    """A session on the store of a workspace that is not mounted (a dead
    mount is cleared first), to run control operations on it directly:
    recovery never depends on FUSE."""
    session = Session(workspace, store=store)
    if not os.path.isdir(session.store_dir) and not is_cowfs_mount(session.workspace):
        raise NoStore(
            f"{session.workspace} is not mounted and has no cowfs store ({session.store_dir})"
        )
    cleared = recover_stale_mount(session.mountpoint)
    if cleared:
        session.warnings.append(cleared)
    session.open(create=False, recovering=cleared is not None)
    return session


def offline(workspace: str, store: str | None, op: str, **args: Any) -> dict:
    """Run control operation *op* on the store of an unmounted workspace;
    the result carries the warnings of opening it (a resumed rollback, a
    cleared dead mount) in "warnings"."""
    if op not in OPS:
        raise CowfsError(f"no operation {op!r}", errors.USAGE)
    session = open_offline(workspace, store)
    try:
        recorded = False
        if op in TREE_OPS:
            drift = session.current_drift()
            if drift:
                raise Drift(
                    f"{', '.join(map(quote, drift[:10]))}: changed while not mounted, after the "
                    "layers changed them; mount with --accept-drift first"
                )
            recorded = session.store.get_meta_json(schema.K_DRIFT) is not None
        try:
            result = trio.run(functools.partial(invoke, getattr(session, op), **args))
        finally:  # what a rollback or commit changed (also when it partly failed)
            if recorded:
                session.record_fingerprint()
    finally:
        session.close()
    result["warnings"] = session.warnings + result.get("warnings", [])
    result["mounted"] = False
    # (what the daemon sends as lists: listing.Changes, listing.Encoded items)
    return {k: plain_list(v) if isinstance(v, (Changes, list)) else v for k, v in result.items()}


def inspect_offline(workspace: str, store: str | None, readonly: bool = True) -> Session:
    """A session on the store of an unmounted workspace as it is (see
    Session.inspect): for `cowfs check`, and to look at a store."""
    session = Session(workspace, store=store)
    session.inspect(readonly)
    return session
