"""Providers: state outside the files (a command's file, a docker container,
libvirt domains), snapshotted with a checkpoint; the cycles that time them."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
import uuid
from typing import TYPE_CHECKING

from .helpers import BenchError, perf, provider_daemons, summarize
from .targets import Cowfs
from .workloads import Ctx

if TYPE_CHECKING:
    from .bench import Bench


PROVIDER_KINDS = ("command", "docker", "libvirt-running", "libvirt-off")
PROVIDER_OPS = (
    ("capture", "checkpoint (capture)"),
    ("restore", "rollback (restore)"),
    ("discard", "commit (merge: discard)"),
)
WS_FILE = "bench.txt"
# The benchmark's containers, domains and image are named and labelled apart
# from the tests' (a test session's cleanup removes everything of its own).
BENCH_PREFIX = "cowfs-bench-"
BENCH_LABEL = "org.cowfs.bench"
BENCH_IMAGE = "cowfs-bench/busybox:1"


class Subject:
    """What a checkpoint snapshots besides the files, through one provider:
    set up once per run, then changed and checked in every cycle.  This base
    class is the files-only baseline (no provider)."""

    kind = "files"
    label = "files only"
    provider_type = ""

    def __init__(self, bench: Bench):
        self.b = bench
        self.provider: str | None = None  # the registered provider's name
        self.info = "the workspace file alone, no provider"

    def register(self, t: Cowfs, name: str, *options: str) -> None:
        t.cli("provider", "add", name, "--type", self.provider_type, *options)
        self.provider = name

    def setup(self, t: Cowfs) -> None:
        pass

    def taken(self, data: dict) -> None:
        """A checkpoint took this snapshot (*data* as the reply has it)."""

    def change(self, tag: int) -> None:
        """Change the state (the change is called *tag*)."""

    def check(self, tag: int, present: bool) -> None:
        """Raise BenchError unless change *tag* is there (*present*) or undone."""

    def check_discarded(self, data: dict) -> None:
        """Raise BenchError if the snapshot *data* still exists."""

    def cleanup(self) -> None:
        """Remove all this made; callable again, and after a partial set-up."""


class CommandState(Subject):
    """A small file outside the workspace, copied to $COWFS_STATE_DIR."""

    kind = label = "command"
    provider_type = "command"

    def __init__(self, bench):
        super().__init__(bench)
        self.dir = os.path.join(bench.scratch, "command-state")
        self.path = os.path.join(self.dir, "state.txt")
        self.before = ""

    def _write(self, text: str) -> None:
        with open(self.path, "w") as f:
            f.write(text)

    def _read(self) -> str:
        with open(self.path) as f:
            return f.read()

    def setup(self, t):
        os.makedirs(self.dir, exist_ok=True)
        self._write("initial state\n" * 64)
        q = shlex.quote(self.path)
        self.register(
            t,
            "cmd",
            "--capture",
            f'cp {q} "$COWFS_STATE_DIR/state"',
            "--restore",
            f'cp "$COWFS_STATE_DIR/state" {q}',
        )
        self.info = (
            f"`cp` of a {os.path.getsize(self.path)}-byte file outside the workspace "
            "to $COWFS_STATE_DIR and back"
        )

    def change(self, tag):
        self.before = self._read()
        self._write(f"state {tag}\n" * 64)

    def check(self, tag, present):
        got = self._read()
        want = f"state {tag}\n" * 64 if present else self.before
        if got != want:
            raise BenchError(
                f"command state holds {summarize(got, 1)!r}, expected {summarize(want, 1)!r}"
            )

    def cleanup(self):
        shutil.rmtree(self.dir, ignore_errors=True)


class DockerState(Subject):
    """A running busybox container with the workspace bind-mounted at /work
    that has written a file into its own root file system."""

    kind = "docker"
    label = "docker container"
    provider_type = "docker"

    def __init__(self, bench):
        super().__init__(bench)
        self.client = None
        self.name = f"{BENCH_PREFIX}{uuid.uuid4().hex[:8]}"
        self.repo = ""  # where the provider tags its snapshot images
        self.images: list[str] = []  # every snapshot image, oldest first
        self.built_base = False
        self.ws_file = ""

    def _container(self):
        return self.client.containers.get(self.name)

    def _sh(self, cmd: str) -> tuple[int, bytes]:
        r = self._container().exec_run(["sh", "-c", cmd])
        return r.exit_code, r.output

    def setup(self, t):
        import docker.errors

        daemons = provider_daemons()
        self.client = daemons.ensure_docker()
        try:
            self.client.images.get(BENCH_IMAGE)
        except docker.errors.ImageNotFound:
            self.built_base = True
        image = daemons.busybox_image(self.client, BENCH_IMAGE, BENCH_LABEL)
        self.repo = f"cowfs/{os.path.basename(t.dir).lower()}"
        self.ws_file = os.path.join(t.dir, WS_FILE)
        # Created after the mount, so the bind mount sees the cowfs view.
        self.client.containers.run(
            image,
            ["sleep", "86400"],
            name=self.name,
            detach=True,
            working_dir="/work",
            network_mode="none",
            volumes={t.dir: {"bind": "/work", "mode": "rw"}},
        )
        code, out = self._sh("echo installed > /usr/local/bin/state")
        if code:
            raise BenchError(f"writing into the container failed ({code}): {summarize(out)}")
        self.register(t, "box", "--container", self.name)
        info = self.client.info()
        self.info = (
            f"running busybox container ({image}), workspace bind-mounted at /work, "
            f"a file written in its rootfs; dockerd {info.get('ServerVersion')}, "
            f"storage driver {info.get('Driver')}"
        )

    def taken(self, data):
        self.images.append(data["image"])

    def change(self, tag):
        code, out = self._sh(f"echo {tag} > /usr/local/bin/change-{tag}")
        if code:
            raise BenchError(f"changing the container failed ({code}): {summarize(out)}")

    def check(self, tag, present):
        c = self._container()
        if c.status != "running":
            raise BenchError(f"container {self.name} is {c.status}, not running")
        if self._sh("test -e /usr/local/bin/state")[0]:
            raise BenchError(f"container {self.name} lost the file written before the run")
        if (self._sh(f"test -e /usr/local/bin/change-{tag}")[0] == 0) != present:
            raise BenchError(
                f"container {self.name}: change {tag} is {'missing' if present else 'still there'}"
            )
        with open(self.ws_file, "rb") as f:
            want = f.read()
        code, out = self._sh(f"cat /work/{WS_FILE}")
        if code or out != want:
            raise BenchError(
                f"container {self.name} sees {out[:80]!r} in /work/{WS_FILE}, "
                f"the workspace has {want[:80]!r}"
            )

    def check_discarded(self, data):
        import docker.errors

        try:
            self.client.images.get(data["tag"])
        except docker.errors.ImageNotFound:
            return
        raise BenchError(f"snapshot image {data['tag']} is still there after its layer went")

    def cleanup(self):
        if self.client is None:
            return
        import docker.errors

        errs = []
        with contextlib.suppress(docker.errors.NotFound):
            self._container().remove(force=True, v=True)
        # Newest first: each snapshot image is the parent of the next one.
        left = [i.id for i in self.client.images.list(name=self.repo)] if self.repo else []
        for image in [*reversed(self.images), *left] + ([BENCH_IMAGE] if self.built_base else []):
            try:
                self.client.images.remove(image, force=True)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as e:
                errs.append(f"image {image}: {e}")
        if errs:
            raise BenchError("; ".join(errs))
        self.client.close()
        self.client = None


class LibvirtState(Subject):
    """A tiny qemu domain (it boots nothing): running (snapshots hold memory
    and disk) or shut off (disk only); a marker written on its disk is the
    change."""

    provider_type = "libvirt"

    def __init__(self, bench, running: bool):
        super().__init__(bench)
        self.running = running
        self.kind = "libvirt-running" if running else "libvirt-off"
        self.label = f"libvirt, {'running' if running else 'shut off'}"
        self.conn = None
        self.dom = None
        self.name = f"{BENCH_PREFIX}{self.kind}-{uuid.uuid4().hex[:8]}"

    @staticmethod
    def pattern(tag: int) -> int:
        return 1 + tag % 255

    def setup(self, t):
        daemons = provider_daemons()
        self.conn = daemons.ensure_libvirt()
        vtype = daemons.virt_type(self.conn)
        self.dom = daemons.tiny_domain(
            self.conn,
            self.name,
            self.b.fresh_dir(self.kind),
            start=self.running,
            vtype=vtype,
            prefix=BENCH_PREFIX,
        )
        self.register(t, "vm-on" if self.running else "vm-off", "--domain", self.name)
        self.info = (
            f"tiny domain ({vtype}, 64 MiB memory, 64 MiB qcow2 disk on the bench "
            f"fs), {'running: memory + disk' if self.running else 'shut off: disk'}"
        )

    def change(self, tag):
        provider_daemons().write_marker(self.dom, self.pattern(tag))

    def check(self, tag, present):
        if bool(self.dom.isActive()) != self.running:
            raise BenchError(
                f"domain {self.name} is {'running' if self.dom.isActive() else 'shut off'}"
            )
        if provider_daemons().has_marker(self.dom, self.pattern(tag)) != present:
            raise BenchError(
                f"domain {self.name}: the disk marker of change {tag} is "
                f"{'missing' if present else 'still there'}"
            )

    def check_discarded(self, data):
        if data["snapshot"] in self.dom.snapshotListNames():
            raise BenchError(f"domain {self.name} still has snapshot {data['snapshot']}")

    def cleanup(self):
        if self.conn is None:
            return
        provider_daemons().remove_domain(self.conn, self.name, delete_disk=True)
        self.conn.close()
        self.conn = None


def provider_subjects(bench: Bench, kinds) -> list[Subject]:
    make = {
        "command": CommandState,
        "docker": DockerState,
        "libvirt-running": lambda b: LibvirtState(b, True),
        "libvirt-off": lambda b: LibvirtState(b, False),
    }
    return [Subject(bench)] + [make[k](bench) for k in kinds]


class ProviderRuns:
    """The provider runs of a Bench (a part of it: Bench derives from this)."""

    def run_providers(self) -> None:
        p = self.providers
        subjects = provider_subjects(self, self.args.provider_kinds)
        t = self.cowfs()
        base = self.fresh_dir("providers-cowfs")

        def prepare(ws):
            with open(os.path.join(ws, WS_FILE), "w") as f:
                f.write("initial\n")

        try:
            # A name of its own: the docker provider tags its images after it.
            t.setup(base, prepare, name=f"bench-{uuid.uuid4().hex[:8]}")
            for s in subjects:
                self.register(s.label, s.cleanup)  # also after a partial set-up
                try:
                    s.setup(t)
                    p["info"][s.kind] = s.info
                except provider_daemons().DaemonUnavailable as e:
                    p["skipped"][s.kind] = str(e)
                    self.note(f"providers: {s.label} skipped: {summarize(str(e), 1)}")
                except KeyboardInterrupt:
                    raise
                except Exception as e:
                    p["skipped"][s.kind] = f"set-up failed: {summarize(str(e), 1)}"
                    self.fail("providers (set-up)", s.label, -1, e)
            ready = [s for s in subjects if s.kind in p["info"]]
            for rep in range(p["reps"]):
                k = rep % len(ready)
                for s in ready[k:] + ready[:k]:
                    if s.kind in p["stopped"]:
                        continue
                    t0 = perf()
                    try:
                        self.provider_cycle(t, s, rep)
                    except KeyboardInterrupt:
                        raise
                    except Exception as e:
                        p["stopped"][s.kind] = f"stopped by a failure in repetition {rep + 1}"
                        self.fail("providers", s.label, rep, e)
                        self.back_to_base(t)
                    print(
                        f"bench:   providers {s.kind:<16} rep {rep + 1}/{p['reps']} "
                        f"{perf() - t0:6.1f} s",
                        file=sys.stderr,
                    )
        except KeyboardInterrupt:
            raise
        except Exception as e:
            self.fail("providers", t.name, -1, e)
        finally:
            for s in reversed(subjects):  # containers first: they bind-mount the workspace
                try:
                    s.cleanup()
                    self.unregister(s.label)
                except Exception as e:
                    self.fail("providers (clean-up)", s.label, -1, e)
            try:
                t.teardown()
            except Exception as e:
                self.fail("providers", t.name, -1, e)

    @staticmethod
    def back_to_base(t: Cowfs) -> None:
        """Drop every layer above the base one, after a failed cycle."""
        ids = sorted(layer["id"] for layer in t.cli("log")[0])
        if len(ids) > 1:
            with contextlib.suppress(BenchError):  # a provider's failure; the files still go
                t.cli("rollback", "--to", str(ids[1]))
            if len(t.cli("log")[0]) > 1:
                raise BenchError("could not roll back to the base layer after a failure")

    def provider_cycle(self, t: Cowfs, s: Subject, rep: int) -> None:
        """checkpoint + changes + rollback, then checkpoint + changes + commit,
        each result checked; then the times of the first checkpoint, the
        rollback and the commit are recorded."""
        c = Ctx(self, t, "providers", rep)
        path = os.path.join(t.dir, WS_FILE)
        snap_args = ["--provider", s.provider] if s.provider else []
        times = {}

        def write(text):
            with open(path, "w") as f:
                f.write(text)

        def read():
            with open(path) as f:
                return f.read()

        def op(name, *args):
            """Run a control command as a timed step; the reply and the
            provider's own entry in it."""
            with c.step(f"{s.kind} {name}"):
                res, wall = t.cli(*args)
            own = None
            if s.provider and name != "discard":
                key = "snapshots" if name == "capture" else "restored"
                mine = [e for e in res.get(key, []) if e["provider"] == s.provider]
                if len(mine) != 1:
                    raise BenchError(
                        f"{args[0]} reply lists {len(mine)} {key} of {s.provider}: {res.get(key)}"
                    )
                own = mine[0]
            times.setdefault(name, (own["seconds"] * 1000 if own else None, res["daemon_ms"], wall))
            return res, own

        self.prov_tag += 1
        tag = self.prov_tag
        write(f"{s.kind} rep {rep}: before\n")
        _, snap = op("capture", "checkpoint", "-m", f"bench {s.kind}", *snap_args)
        if snap:
            s.taken(snap["data"])
        write(f"{s.kind} rep {rep}: rolled back\n")
        s.change(tag)
        s.check(tag, present=True)
        op("restore", "rollback")
        if read() != f"{s.kind} rep {rep}: before\n":
            raise BenchError(f"rollback left {read()!r} in {WS_FILE}")
        s.check(tag, present=False)
        if snap:
            s.check_discarded(snap["data"])

        self.prov_tag += 1
        tag = self.prov_tag
        _, snap = op("capture", "checkpoint", "-m", f"bench {s.kind} 2", *snap_args)
        if snap:
            s.taken(snap["data"])
        write(f"{s.kind} rep {rep}: committed\n")
        s.change(tag)
        res, _ = op("discard", "commit")
        if res.get("into") is None or res.get("warnings"):
            raise BenchError(f"commit did not merge cleanly: {res}")
        if read() != f"{s.kind} rep {rep}: committed\n":
            raise BenchError(f"commit left {read()!r} in {WS_FILE}")
        s.check(tag, present=True)
        if snap:
            s.check_discarded(snap["data"])
        if len(t.cli("log")[0]) != 1:
            raise BenchError("layers left above the base layer after the cycle")
        for name, (own, daemon, wall) in times.items():
            d = (
                self.providers["samples"]
                .setdefault(s.kind, {})
                .setdefault(name, {"provider_ms": [], "daemon_ms": [], "wall_ms": []})
            )
            if own is not None:
                d["provider_ms"].append(own)
            d["daemon_ms"].append(daemon)
            d["wall_ms"].append(wall)
