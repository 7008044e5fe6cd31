"""The Python API for agent harnesses: the same operations as the CLI.

    from cowfs import Workspace

    ws = Workspace.mount("/srv/project")          # or Workspace.attach(path)
    result = ws.run(["make", "test"])             # rolled back if it fails
    with ws.step("refactor", verify="pytest -q"):  # rolled back on an exception
        edit_files()                               # or a failing verification

Every method talks to the workspace's daemon over its control socket and
raises ``CowfsError`` (with the CLI's exit code in ``.code``) on failure;
a daemon that sends nothing for the deadline ($COWFS_DEADLINE, 30 s; it
is stopped, or hangs) raises ``NotAnswering`` (code 5, with its ``.pid``
and ``.mountpoint``), never leaving the caller waiting.
"""

from __future__ import annotations

import base64
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO, Literal, overload

from ..errors import USAGE, CowfsError, NotAnswering
from ..escalation.policy import RUN_SCOPES, ContainerWatch, Policy, Verdict, Where
from ..system.mounts import MountRecord
from ..text import printable, quote
from .client import Client

Command = Sequence[str] | str


@dataclass
class Change:
    """One net change of a layer, like a line of ``git status --short``:
    kind A added, D deleted, M modified, T type changed, R renamed (with
    ``source``), m attributes only."""

    path: str
    kind: str
    source: str | None = None
    who: dict | None = None  # the process that first made it: pid, uid, cmd
    dir: bool = False  # a directory (for D: it was one)

    @classmethod
    def from_dict(cls, d: dict) -> Change:
        return cls(d["path"], d["kind"], d.get("from"), d.get("who"), d.get("dir", False))

    def to_dict(self) -> dict:
        """As the JSON outputs have it."""
        return {
            "path": self.path,
            "kind": self.kind,
            **({"from": self.source} if self.source is not None else {}),
            **({"dir": True} if self.dir else {}),
            **({"who": self.who} if self.who is not None else {}),
        }

    def __str__(self) -> str:
        """'M a.txt', 'R old -> new', names quoted for people (text.quote)."""
        if self.kind == "R":
            return f"R {quote(self.source or '')} -> {quote(self.path)}"
        return f"{self.kind} {quote(self.path)}"


@dataclass
class Status:
    layer: int
    changes: list[Change]


@dataclass
class LayerInfo:
    id: int
    created: float
    message: str
    changes: int
    bytes: int
    runs: list[dict] = field(default_factory=list)
    agent: dict | None = None  # the agent event that opened it (cowfs hook), if any
    turns: list[dict] = field(default_factory=list)  # those of layers merged into it


@dataclass
class RollbackResult:
    dropped: list[int]
    applied: int
    failures: list[str]
    top: int


@dataclass
class RedoResult:
    restored: list[int]  # the layers brought back
    applied: int
    top: int


@dataclass
class CommitResult:
    committed: int
    into: int | None
    top: int


@dataclass
class RunResult:
    """What `Workspace.run` did: the command's and the verifier's exit
    statuses (128 + signal for a signal), what changed (``changes``, as
    `status` gives them), the outcome ("kept", "committed", "rolled back" or
    "no checkpoint") and ``layer``, the layer that holds the step (None
    once it is rolled back).  With ``capture_output``, the output of the
    command (``stdout``, ``stderr``) and of the verifier (``verify_stdout``,
    ``verify_stderr``), decoded as UTF-8 (invalid bytes replaced)."""

    command: str
    cwd: str
    layer: int | None
    exit_status: int
    verify: str | None
    verify_status: int | None
    duration: float
    outcome: str
    changes: list[Change]
    started: float = 0.0
    scope: str = "files"
    snapshots: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    uncaptured: dict[str, list[str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None  # why the command (or verifier) could not be started
    stdout: str | None = None
    stderr: str | None = None
    verify_stdout: str | None = None
    verify_stderr: str | None = None
    # the paths whose modification time alone differs (not in ``changes``;
    # a rollback puts their times back too)
    times_only: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_status == 0 and self.verify_status in (None, 0)

    @property
    def status(self) -> int:
        """The exit status to pass on: the command's, or the verifier's when
        only that failed."""
        return self.exit_status if self.exit_status != 0 else (self.verify_status or 0)

    def record(self) -> dict:
        """The run as kept on its layer (long lists cut short; its output is
        not kept)."""
        d = asdict(self)
        for key in OUTPUTS:
            del d[key]
        d["changes"] = len(self.changes)
        d["uncaptured"] = {
            name: lines[:50] + ([f"... and {len(lines) - 50} more"] if len(lines) > 50 else [])
            for name, lines in self.uncaptured.items()
        }
        return d


OUTPUTS = ("stdout", "stderr", "verify_stdout", "verify_stderr")


@dataclass
class Step:
    """What `Workspace.step` yields: ``layer`` holds the block's changes
    (the layer below once committed, None once rolled back); after the
    block, ``changes`` (as `status` gives them), ``outcome`` ("kept",
    "committed" or "rolled back") and the verifier's status and output (with
    ``capture_output``)."""

    message: str
    layer: int | None
    changes: list[Change] = field(default_factory=list)
    outcome: str = ""
    verify_status: int | None = None
    verify_stdout: str | None = None
    verify_stderr: str | None = None


@dataclass
class Plan:
    """What a run snapshots: decided by `Workspace.plan`."""

    scope: str
    verdict: Verdict
    checkpoint: bool
    providers: list[str] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)
    vms: list[str] = field(default_factory=list)
    watch: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class StepFailed(Exception):
    """A `Workspace.step` whose verification failed (it was rolled back):
    the step's ``changes`` (undone now), the verifier's ``verify_status``
    and, with ``capture_output``, its ``stdout`` and ``stderr``."""

    def __init__(
        self,
        message: str,
        verify_status: int,
        changes: list[Change] | None = None,
        stdout: str | None = None,
        stderr: str | None = None,
    ):
        super().__init__(message)
        self.verify_status = verify_status
        self.changes = changes or []
        self.stdout = stdout
        self.stderr = stderr


def command_line(cmd: Command) -> str:
    return cmd if isinstance(cmd, str) else shlex.join(cmd)


@dataclass
class Executed:
    """How a command ran: its exit status (128 + N for signal N; 124 when
    it was killed after its timeout), why it could not be started (as a
    shell says it: 127 not found, 126 not executable), and its output when
    captured."""

    status: int | None  # (None: not run)
    error: str | None = None
    stdout: str | None = None
    stderr: str | None = None


def execute(
    cmd: Command,
    cwd: str,
    capture: bool = False,
    timeout: float | None = None,
    limit: int = 64 << 10,
) -> Executed:
    """Run *cmd* (an argument list, or a shell string) with the terminal
    passed through; Ctrl-C goes to the command (the caller ignores it while
    the command runs).

    With *capture*, the command instead reads nothing (/dev/null), its
    stdout and stderr are kept (each past *limit* bytes: its beginning and
    end, see ``head_and_tail``) and it runs in a session of its own (so a
    thread may call this).  After *timeout* seconds the command (with
    *capture*: its whole session) is killed: status 124, as timeout(1)
    says it."""
    name = cmd if isinstance(cmd, str) else cmd[0]
    if not capture:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    with ExitStack() as files:
        sinks = [files.enter_context(tempfile.TemporaryFile()) for _ in range(2)] if capture else []
        try:
            if capture:
                proc = subprocess.Popen(
                    cmd,
                    cwd=cwd,
                    shell=isinstance(cmd, str),
                    stdin=subprocess.DEVNULL,
                    stdout=sinks[0],
                    stderr=sinks[1],
                    start_new_session=True,
                )
            else:
                proc = subprocess.Popen(
                    cmd,
                    cwd=cwd,
                    shell=isinstance(cmd, str),
                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                )
            try:
                rc, error = proc.wait(timeout), None
            except subprocess.TimeoutExpired:
                if capture:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
                proc.wait()
                rc, error = 124, f"timed out after {timeout:g} s; killed"
        except FileNotFoundError:
            if not os.path.isdir(cwd):
                return Executed(
                    127, f"the working directory {cwd} does not exist", *_empty(capture)
                )
            return Executed(127, f"{name}: command not found", *_empty(capture))
        except PermissionError as e:
            return Executed(
                126, f"{name}: cannot run it ({(e.strerror or str(e)).lower()})", *_empty(capture)
            )
        finally:
            if not capture:
                signal.signal(signal.SIGINT, old)
        return Executed(
            128 - rc if rc < 0 else rc, error, *(head_and_tail(f, limit) for f in sinks)
        )


def _empty(capture: bool) -> tuple:
    return ("", "") if capture else ()


def head_and_tail(f: BinaryIO, limit: int) -> str:
    """The text of file *f*, or, past *limit* bytes, its first quarter and
    last three quarters of *limit* with a line saying what was left out."""
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    if size <= limit:
        return f.read().decode(errors="replace")
    head = f.read(limit // 4)
    f.seek(size - (limit - limit // 4))
    tail = f.read()
    return (
        head.decode(errors="replace") + f"\n[... {size - len(head) - len(tail)} bytes "
        f"of output left out ...]\n" + tail.decode(errors="replace")
    )


def show_pages(first: dict, more: Callable[[int], dict]) -> Iterator[bytes]:
    """The bytes of the file a `show` answer (*first*) describes, page by
    page; *more(offset)* asks for the page at *offset*."""
    res, offset = first, 0
    while True:
        data = base64.b64decode(res["data"])
        yield data
        offset += len(data)
        if not data or offset >= res["size"]:
            return
        res = more(offset)


class Workspace(Client):
    """A mounted cowfs workspace (the control channel's client, with the
    harness's steps on top)."""

    record: MountRecord  # (attached or mounted: always)

    # -- getting one ------------------------------------------------------------

    @classmethod
    def mount(
        cls,
        path: str | os.PathLike,
        store: str | os.PathLike | None = None,
        mountpoint: str | os.PathLike | None = None,
        max_store: int | None = None,
        max_layers: int | None = None,
        allow: Sequence[str] | None = None,
    ) -> Workspace:
        """Mount *path* (over itself unless *mountpoint*) and return it;
        *max_store* (bytes), *max_layers* and *allow* (grants: USER[:OPS],
        @GROUP[:OPS]) as `cowfs mount` takes them."""
        from ..service.daemon import check_fuse
        from ..service.launch import spawn

        check_fuse()
        msg = spawn(
            os.fspath(path),
            os.fspath(mountpoint) if mountpoint is not None else None,
            os.fspath(store) if store is not None else None,
            max_store=max_store,
            max_layers=max_layers,
            allow=list(allow) if allow is not None else None,
        )
        return cls.attach(msg["mountpoint"])

    # -- the stack ----------------------------------------------------------------

    def checkpoint(
        self,
        message: str = "",
        providers: Sequence[str] = (),
        containers: Sequence[str] = (),
        vms: Sequence[str] = (),
        agent: dict | None = None,
    ) -> int:
        """Open a new layer, with snapshots of the named providers, docker
        containers and libvirt domains; return its id.  *agent*: the agent
        event the layer stands for ({"agent", "event", ...}; `cowfs.interface.agents`),
        kept on the layer (`log`, `rewind`)."""
        extra: dict[str, Any] = {"agent": agent} if agent is not None else {}
        return self.call(
            "checkpoint",
            message=message,
            providers=list(providers),
            containers=list(containers),
            vms=list(vms),
            **extra,
        )["id"]

    @overload
    def rollback(
        self,
        to: int | None = None,
        dry_run: Literal[False] = False,
        keep_redo: bool = True,
        yes: bool = False,
        skip_damaged: bool = False,
    ) -> RollbackResult: ...

    @overload
    def rollback(
        self,
        to: int | None = None,
        *,
        dry_run: Literal[True],
        keep_redo: bool = True,
        yes: bool = False,
        skip_damaged: bool = False,
    ) -> list[Change]: ...

    @overload
    def rollback(
        self,
        to: int | None,
        dry_run: Literal[True],
        keep_redo: bool = True,
        yes: bool = False,
        skip_damaged: bool = False,
    ) -> list[Change]: ...

    @overload
    def rollback(
        self,
        to: int | None = None,
        dry_run: bool = False,
        keep_redo: bool = True,
        yes: bool = False,
        skip_damaged: bool = False,
    ) -> RollbackResult | list[Change]: ...

    def rollback(
        self,
        to: int | None = None,
        dry_run: bool = False,
        keep_redo: bool = True,
        yes: bool = False,
        skip_damaged: bool = False,
    ) -> RollbackResult | list[Change]:
        """Undo the top layer, or every layer down to and including *to*.
        With *dry_run*, change nothing and return what would be undone.
        Without *keep_redo*, nothing is kept for `redo` (faster).  When the
        top layer is the base layer (everything since the mount), a rollback
        without *to* raises CowfsError (code 14, changing nothing) unless
        *yes*; naming the base layer with *to* is explicit and needs no *yes*.
        A step whose undo data is damaged leaves its layer in place (raising
        PartialFailure, code 10) unless *skip_damaged*; a full disk stops
        the rollback (the same call finishes it once there is room)."""
        if dry_run:
            return self.changes(since=to)
        extra: dict[str, Any] = {"skip_damaged": True} if skip_damaged else {}
        r = self.call("rollback", to=to, keep_redo=keep_redo, yes=yes, **extra)
        return RollbackResult(r["dropped"], r["applied"], r["failures"], r["top"])

    def redo(self) -> RedoResult:
        """Undo the last rollback, exactly, if nothing changed since; else
        raise (exit code 12: why not; 1: there was none) changing nothing."""
        r = self.call("redo")
        return RedoResult(r["restored"], r["applied"], r["top"])

    def commit(self) -> CommitResult:
        """Merge the top layer into the one below (the base: make permanent)."""
        r = self.call("commit")
        return CommitResult(r["committed"], r["into"], r["top"])

    def status(self) -> Status:
        r = self.call("status")
        return Status(r["id"], [Change.from_dict(c) for c in r["changes"]])

    def changes(self, since: int | None = None) -> list[Change]:
        """Net changes since layer *since* was opened (default: the top)."""
        return [Change.from_dict(c) for c in self.call("changes", since=since)["changes"]]

    def log(self) -> list[LayerInfo]:
        return [
            LayerInfo(
                d["id"],
                d["created"],
                d["message"],
                d["changes"],
                d["bytes"],
                d.get("runs", []),
                d.get("agent"),
                d.get("turns", []),
            )
            for d in self.call("log")["layers"]
        ]

    def show(self, path: str | bytes, layer: int | None = None) -> bytes:
        """The bytes of file *path* (workspace-relative; bytes: a name that
        need not be UTF-8) as they were when *layer* (default: the open
        layer) was opened."""
        return b"".join(self._pages(layer, os.fsdecode(path)))

    def _pages(self, layer: int | None, path: str, first: dict | None = None) -> Iterator[bytes]:
        res = first or self.call("show", layer=layer, path=path)
        if res["kind"] != "file":
            raise CowfsError(f"{quote(path)} was a {res['kind']}, not a file, then", USAGE)
        return show_pages(
            res, lambda offset: self.call("show", layer=layer, path=path, offset=offset)
        )

    def restore(self, paths: Sequence[str | bytes], layer: int | None = None) -> list[str]:
        """Put *paths* (files or whole subtrees, workspace-relative; bytes: a
        name that need not be UTF-8) back as they were when *layer*
        (default: the open layer) was opened.  The
        daemon does it, with the rights of the user who asks, as a change of
        the open layer like any other (it can itself be rolled back).
        Returns the paths it changed.  Names that were one object then (hard
        links) within what is restored are linked again; a name is never
        written through to others it shares its object with now."""
        return self.call("restore", paths=[os.fsdecode(p) for p in paths], layer=layer)["restored"]

    def top(self) -> int:
        return self.call("status")["id"]

    # -- steps ---------------------------------------------------------------------

    def _default_cwd(self) -> str:
        cwd = os.getcwd()
        inside = cwd == self.root or cwd.startswith(self.root.rstrip("/") + "/")
        return cwd if inside else self.root

    def plan(
        self,
        cmd: Command,
        scope: str = "files",
        cwd: str | None = None,
        providers: Sequence[str] = (),
        containers: Sequence[str] = (),
        vms: Sequence[str] = (),
        policy: Policy | None = None,
    ) -> Plan:
        """What `run` would snapshot for *cmd* under *scope* (see
        `cowfs.escalation.policy`), without running anything."""
        if scope not in RUN_SCOPES:
            raise ValueError(f"scope is one of {', '.join(RUN_SCOPES)}")
        policy = policy or Policy.load()
        cwd = os.path.realpath(cwd or self._default_cwd())
        roots = sorted({self.root, self.record.workspace})
        verdict = policy.classify(cmd, Where(cwd, roots))
        registered = self.call("provider_list")["providers"]
        docker = {p["container"]: p["name"] for p in registered if p["type"] == "docker"}
        libvirt = {p["domain"]: p["name"] for p in registered if p["type"] == "libvirt"}
        plan = Plan(scope, verdict, checkpoint=True, providers=list(providers))
        containers, vms = list(containers), list(vms)
        if scope == "container" or (scope == "auto" and verdict.scope == "system"):
            containers += verdict.containers or ([] if scope == "auto" else list(docker))
        if scope == "vm":
            vms += list(libvirt)
        if scope == "auto" and verdict.scope == "system" and not verdict.containers:
            containers += list(docker)
            vms += list(libvirt)
        for names, known, attr in ((containers, docker, "containers"), (vms, libvirt, "vms")):
            for target in dict.fromkeys(names):
                if target in known:
                    plan.providers.append(known[target])
                else:
                    getattr(plan, attr).append(target)
        plan.providers = list(dict.fromkeys(plan.providers))
        snapshots = plan.providers + plan.containers + plan.vms
        if scope in ("container", "vm") and not (
            plan.containers
            or plan.vms
            or any(p in docker.values() or p in libvirt.values() for p in plan.providers)
        ):
            what = "container" if scope == "container" else "VM"
            raise CowfsError(
                f"--scope {scope}: no {what} configured (name one with "
                f"--{'container' if scope == 'container' else 'vm'} or register "
                f"one with 'cowfs provider add')",
                USAGE,
            )
        if scope == "auto" and verdict.scope == "none" and not snapshots:
            plan.checkpoint = False
        if scope == "auto" and verdict.scope == "system" and not snapshots:
            why = "; ".join(verdict.reasons)
            if policy.settings["unescalated"] == "refuse":
                raise CowfsError(
                    f"{command_line(cmd)!r} changes the system outside the "
                    f"workspace ({why}) and no container or VM is configured "
                    f"to snapshot; refused by the policy",
                    USAGE,
                )
            plan.warnings.append(
                f"this command changes the system outside the workspace "
                f"({why}) and no container or VM is configured: only the "
                f"workspace files are captured"
            )
        captured = {c for c in plan.containers} | {
            c for c, name in docker.items() if name in plan.providers
        }
        plan.watch = [
            c for c in dict.fromkeys(verdict.containers + list(docker)) if c not in captured
        ]
        return plan

    def run(
        self,
        cmd: Command,
        verify: Command | None = None,
        on_fail: str = "rollback",
        on_success: str = "keep",
        message: str | None = None,
        cwd: str | None = None,
        decide: Callable[[RunResult], str] | None = None,
        providers: Sequence[str] = (),
        containers: Sequence[str] = (),
        vms: Sequence[str] = (),
        scope: str = "files",
        policy: Policy | None = None,
        capture_output: bool = False,
        timeout: float | None = None,
        output_limit: int = 64 << 10,
    ) -> RunResult:
        """Run *cmd* as a step in its own layer.  If it exits non-zero, or
        *verify* does, the step is rolled back (``on_fail="keep"`` keeps it);
        otherwise its layer stays, an undo point of its own (with *message*,
        default "run: CMD", and the run recorded on it), so that it can be
        rolled back or diffed later (``on_success="commit"`` merges it into
        the layer below instead).  *decide*, given the result of a
        successful step, may return "commit", "keep" or "rollback" instead.
        With *capture_output*, the command and the verifier read nothing
        and what they write goes to ``stdout``/``stderr`` and
        ``verify_stdout``/``verify_stderr`` (each past *output_limit* bytes:
        its beginning and end) instead of the terminal; the command then
        runs in a session of its own, so ``run`` may be called from a
        thread.  After *timeout* seconds a command (or verifier) is killed
        (with *capture_output*: its session) and counts as failed (exit
        status 124).

        *scope* "files" snapshots the files (and the named providers,
        containers and VMs); "container" and "vm" also every configured
        container or VM; "auto" asks the escalation *policy*: read-only
        commands take no checkpoint (outcome "no checkpoint"), commands that
        change the system escalate to the configured containers and VMs.
        Containers the run did not snapshot are watched with ``docker diff``:
        what changed in them is reported in ``uncaptured`` and ``warnings``."""
        if on_fail not in ("rollback", "keep") or on_success not in ("commit", "keep"):
            raise ValueError("on_fail is rollback|keep, on_success is commit|keep")
        cwd = cwd or self._default_cwd()
        plan = self.plan(cmd, scope, cwd, providers, containers, vms, policy)
        line = command_line(cmd)
        started = time.time()
        layer, before = self._open_step(plan, message or f"run: {line}")
        watch = ContainerWatch(plan.watch)
        t0 = time.monotonic()
        ran = execute(*self._in_place(cmd, cwd), capture_output, timeout, output_limit)
        assert ran.status is not None  # (what execute() ran has a status)
        checked = (
            execute(*self._in_place(verify, cwd), capture_output, timeout, output_limit)
            if verify is not None and ran.status == 0
            else Executed(None)
        )
        duration = round(time.monotonic() - t0, 3)
        times_only = 0
        if plan.checkpoint:
            found = self.call("changes", since=layer)
            changes = [Change.from_dict(c) for c in found["changes"]]
            times_only = found.get("times_only") or 0
        else:
            changes = [c for c in self.status().changes if _key(c) not in before]
        result = RunResult(
            line,
            cwd,
            layer,
            ran.status,
            command_line(verify) if verify is not None else None,
            checked.status,
            duration,
            "",
            changes,
            started,
            plan.verdict.scope if scope == "auto" else scope,
            plan.providers + plan.containers + plan.vms,
            plan.verdict.reasons,
            watch.changes(),
            list(plan.warnings),
            ran.error or (checked.error and f"the verifier: {checked.error}"),
            ran.stdout,
            ran.stderr,
            checked.stdout,
            checked.stderr,
            times_only,
        )
        result.warnings += uncaptured_warnings(result.uncaptured)
        if not plan.checkpoint:
            result.outcome = "no checkpoint"
            self.call("annotate", layer=layer, run=result.record())
            return result
        action = (decide(result) if decide else on_success) if result.ok else on_fail
        result.layer, result.outcome, into = self._conclude(layer, action)
        self.call("annotate", layer=into, run=result.record())
        return result

    def _in_place(self, cmd: Command, cwd: str) -> tuple[Command, str]:
        """How *cmd* runs in *cwd* (a fork runs it where it is seen at its
        workspace's path)."""
        return cmd, cwd

    # -- forks -------------------------------------------------------------------

    def fork(self, name: str, message: str = "") -> Fork:
        """Make fork *name* of the workspace as it is now (see `cowfs fork`):
        a Workspace of its own, whose ``run`` runs commands where the fork is
        seen at this workspace's path."""
        res = self.call("fork", name=name, message=message)
        return Fork.of(self, name, res["path"])

    def forks(self) -> list[dict]:
        """Every fork: name, layer, created, message, changes, bytes, users."""
        return self.call("forks", changes=True)["forks"]

    def adopt(
        self, name: str, prefer: str | None = None, paths: Mapping[str, str] | None = None
    ) -> dict:
        """Make fork *name*'s changes here as one layer and drop it (see
        `cowfs adopt`); CowfsError code 15 with ``details["conflicts"]``
        when paths both changed are left undecided (*prefer* "fork" or
        "parent", *paths*: path -> side)."""
        return self.call("adopt", name=name, prefer=prefer, paths=dict(paths or {}))

    def drop(self, name: str, force: bool = False) -> dict:
        return self.call("drop", name=name, force=force)

    def best_of(
        self,
        commands: Sequence[Command],
        verify: Command | None = None,
        pick: Callable[[list[Candidate]], int | None] | None = None,
        parallel: int | None = None,
        timeout: float | None = None,
        prefer: str | None = None,
    ) -> BestOf:
        """Run each of *commands* in a fork of its own, *parallel* at once
        (default: all), each verified by *verify*; adopt the winner -- the
        first that succeeded, in the order given, or the index *pick*
        returns from the candidates (None: none) -- and drop the others.
        Every candidate's result is returned (its outcome, output, changes).
        *prefer* decides conflicts with changes made here meanwhile."""
        from concurrent.futures import ThreadPoolExecutor

        if not commands:
            raise CowfsError("best_of needs at least one command", USAGE)
        tag = f"best-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
        forks: list[Fork] = []
        try:
            for i in range(len(commands)):
                forks.append(self.fork(f"{tag}-{i + 1}", f"best of {len(commands)}: {i + 1}"))

            def attempt(i: int) -> Candidate:
                r = forks[i].run(
                    commands[i],
                    verify=verify,
                    on_fail="keep",
                    capture_output=True,
                    timeout=timeout,
                )
                return Candidate(i, command_line(commands[i]), forks[i].name, r)

            with ThreadPoolExecutor(max_workers=parallel or len(commands)) as pool:
                candidates = list(pool.map(attempt, range(len(commands))))
            if pick is not None:
                winner = pick(candidates)
            else:
                winner = next((c.index for c in candidates if c.result.ok), None)
            adopted = None
            if winner is not None:
                adopted = self.adopt(forks[winner].name, prefer=prefer)["layer"]
            return BestOf(candidates, winner, adopted)
        finally:
            for f in forks:
                if any(row["name"] == f.name for row in self.forks()):
                    self.drop(f.name, force=True)

    def _open_step(self, plan: Plan, message: str) -> tuple[int, set[tuple]]:
        """The layer a step runs in: a new one (with *plan*'s snapshots), or
        the open one when the plan takes no checkpoint, with the changes
        it holds before the step."""
        if plan.checkpoint:
            return self.checkpoint(message, plan.providers, plan.containers, plan.vms), set()
        return self.top(), {_key(c) for c in self.status().changes}

    def _conclude(self, layer: int, action: str) -> tuple[int | None, str, int]:
        """Roll back, commit or keep the step in *layer*: returns the layer
        that holds it now (None: rolled back), the outcome, and the layer
        to record it on."""
        if action == "rollback":
            return None, "rolled back", self.rollback(to=layer).top
        if action == "commit":
            into = self.commit_down_to(layer)
            return into, "committed", into
        return layer, "kept", layer

    @contextmanager
    def step(
        self,
        message: str,
        verify: Command | None = None,
        cwd: str | None = None,
        providers: Sequence[str] = (),
        containers: Sequence[str] = (),
        vms: Sequence[str] = (),
        on_success: str = "keep",
        capture_output: bool = False,
    ) -> Iterator[Step]:
        """A block of work in its own layer (a checkpoint with *message*):
        rolled back if the block raises (the exception propagates) or
        *verify* fails (raises StepFailed, with the step's changes and the
        verifier's status and output); otherwise kept as a layer of its own
        (``on_success="commit"``: merged into the layer below).  Yields a
        `Step`: its ``layer`` while the block runs; after it, what changed
        and how it ended.  The step is recorded on the layer that ends up
        holding it (``runs`` in `log`)."""
        if on_success not in ("commit", "keep"):
            raise ValueError("on_success is commit|keep")
        layer = self.checkpoint(message, providers, containers, vms)
        step = Step(message, layer)
        t0 = time.monotonic()
        record = {
            "command": f"step: {message}",
            "kind": "step",
            "exit_status": 0,
            "started": time.time(),
            "verify": verify and command_line(verify),
            "verify_status": None,
        }
        try:
            yield step
        except BaseException as e:
            step.changes = self.changes(since=layer)
            step.layer, step.outcome, into = self._conclude(layer, "rollback")
            self._note_step(
                into,
                step,
                record | {"exit_status": 1, "error": f"{type(e).__name__}: {e}"[:1000]},
                t0,
            )
            raise
        if verify is not None:
            checked = execute(verify, cwd or self._default_cwd(), capture_output)
            step.verify_status = record["verify_status"] = checked.status
            step.verify_stdout, step.verify_stderr = checked.stdout, checked.stderr
            if checked.error:
                record["error"] = f"the verifier: {checked.error}"
        step.changes = self.changes(since=layer)
        if step.verify_status:
            assert verify is not None  # (a status only from a verifier)
            step.layer, step.outcome, into = self._conclude(layer, "rollback")
            self._note_step(into, step, record, t0)
            raise StepFailed(
                f"step {message!r}: verification {command_line(verify)!r} "
                f"exited {step.verify_status}; rolled back",
                step.verify_status,
                step.changes,
                step.verify_stdout,
                step.verify_stderr,
            )
        step.layer, step.outcome, into = self._conclude(layer, on_success)
        self._note_step(into, step, record, t0)

    def _note_step(self, layer: int, step: Step, record: dict, t0: float) -> None:
        self.call(
            "annotate",
            layer=layer,
            run=record
            | {
                "outcome": step.outcome,
                "layer": step.layer,
                "changes": len(step.changes),
                "duration": round(time.monotonic() - t0, 3),
            },
        )


class Fork(Workspace):
    """A fork of a workspace (``Workspace.fork``): a workspace of its own,
    mounted where only root reaches it; its commands run in a mount
    namespace of their own in which the workspace's path shows the fork
    (absolute paths in virtual environments and build caches keep working)."""

    name: str
    parent: Workspace

    @classmethod
    def of(cls, parent: Workspace, name: str, path: str) -> Fork:
        f = cls.attach(path)
        f.name, f.parent = name, parent
        return f

    def _default_cwd(self) -> str:
        cwd = os.getcwd()
        root = self.parent.root
        inside = cwd == root or cwd.startswith(root.rstrip("/") + "/")
        return cwd if inside else root

    def _in_place(self, cmd: Command, cwd: str) -> tuple[Command, str]:
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        return seen_at(self.root, self.parent.root, cwd, argv), self.parent.root


def seen_at(source: str, where: str, cwd: str, argv: Sequence[str]) -> list[str]:
    """*argv* run from *cwd* in a mount namespace of its own in which the
    directory *source* is bound over *where* (a fork at its workspace's
    path); every other process still sees *where* as it is."""
    return [
        "unshare",
        "--mount",
        "--propagation",
        "slave",
        "--",
        "sh",
        "-c",
        'mount --bind -- "$1" "$2" && cd -- "$3" && shift 3 && exec "$@"',
        "cowfs-fork",
        source,
        where,
        cwd,
        *argv,
    ]


@dataclass
class Candidate:
    """One command of ``Workspace.best_of``: its place, the fork it ran in,
    and how it went (``result.ok``, its output and its changes)."""

    index: int
    command: str
    fork: str
    result: RunResult


@dataclass
class BestOf:
    """What ``Workspace.best_of`` did: every candidate, the winner's index
    (None: none succeeded) and the layer its adoption made here."""

    candidates: list[Candidate]
    winner: int | None
    layer: int | None


def uncaptured_warnings(uncaptured: dict[str, list[str]]) -> list[str]:
    """What a run says of the containers that changed without a snapshot."""
    warnings = []
    for name, lines in uncaptured.items():
        shown = ", ".join(map(printable, lines[:5])) + (
            f" and {len(lines) - 5} more" if len(lines) > 5 else ""
        )
        warnings.append(
            f"container {name} changed outside the workspace and this "
            f"was not captured (run with --scope container to "
            f"snapshot it): {shown}"
        )
    return warnings


def _key(c: Change) -> tuple:
    return c.path, c.kind, c.source


__all__ = [
    "Change",
    "CommitResult",
    "CowfsError",
    "LayerInfo",
    "NotAnswering",
    "Plan",
    "Policy",
    "RollbackResult",
    "RunResult",
    "Status",
    "Step",
    "StepFailed",
    "Workspace",
]
