"""The benchmark: a Bench holds a run's settings, scratch file system,
resources and results, and runs every workload on every target."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import traceback

from .cowfs_only import CowfsRuns
from .forks import ForkRuns
from .helpers import BenchError, GiB, LoadWatch, MiB, mounted, perf, rotate, run, try_run
from .providers import ProviderRuns
from .report import Report
from .targets import Cowfs, Native, Overlay, Target
from .workloads import PREPARE, WORKLOADS, Ctx


class Bench(CowfsRuns, ForkRuns, ProviderRuns, Report):
    def __init__(self, args):
        self.args = args
        self.scratch = ""
        self.fsroot = ""
        self.image = ""
        self.fs_desc = ""
        # mountpoints and engine objects -> the callable that removes them,
        # called last-registered first (a container before the mount it binds)
        self.resources: dict[str, object] = {}
        self.notes: list[str] = []
        self.warnings: set[str] = set()
        self.failures: list[dict] = []
        # step -> placement -> target -> seconds, one a repetition
        self.samples: dict[str, dict[str, dict[str, list[float]]]] = {}
        self.meta: dict[str, dict] = {}
        self.order: list[str] = []
        self.latency: dict[str, dict[int, dict[str, list[float]]]] = {}
        self.startup: dict[str, list[float]] = {}  # what -> wall ms, one a sample
        self.memory: dict = {}  # engine -> figures
        self.scaling: dict[str, dict[str, dict[int, float]]] = {}  # kind -> op -> n -> s
        self.forks: dict = {}  # (run_forks)
        self.digests: dict = {}
        self.counter = 0
        s = args.scale
        self.n_small = max(100, int(10_000 * s))
        self.seq_size = max(16, int(1024 * s)) * MiB
        self.rand_size = max(16, int(256 * s)) * MiB
        self.rand_count = max(500, int(20_000 * s))
        self.lat_files = max(50, int(1000 * s))
        self.mem_files = max(1000, int(100_000 * s))
        self.grave_big = max(1, round(4 * s))  # 64 MiB files in the grave workload
        self.null_count = max(1000, int(20_000 * s))
        self.npm_packages = max(10, int(200 * s))
        # pinned: CPU 0 (or the first the bench may use); unpinned: all it may use
        self.all_cpus = os.sched_getaffinity(0)
        self.cpus = {"pinned": {min(self.all_cpus)}, "unpinned": self.all_cpus}
        self.placement = "unpinned"
        self.load = LoadWatch(self)
        self.tarball = ""
        self.tree_info: dict = {}
        self.providers: dict = {
            "reps": args.provider_reps,
            "info": {},
            "skipped": {},
            "stopped": {},
            "samples": {},
        }
        self.prov_tag = 0  # names the changes of the provider cycles

    # resources and notes
    def register(self, key, fn):
        self.resources[key] = fn

    def unregister(self, key):
        self.resources.pop(key, None)

    def note(self, msg):
        self.notes.append(msg)
        print(f"bench: {msg}", file=sys.stderr)

    def fresh_dir(self, tag: str) -> str:
        self.counter += 1
        d = os.path.join(self.fsroot, f"{self.counter:04d}-{tag}")
        os.makedirs(d)
        return d

    def add_sample(self, workload, name, placement, target, secs, meta):
        if name not in self.meta:
            self.meta[name] = {"workload": workload, **meta}
            self.order.append(name)
        self.samples.setdefault(name, {}).setdefault(placement, {}).setdefault(target, []).append(
            secs
        )

    # placement
    def place(self, placement: str) -> None:
        """Run what follows -- the bench's own loops, the commands it starts
        and the daemons they start, which inherit it -- on *placement*'s CPUs."""
        os.sched_setaffinity(0, self.cpus[placement])
        self.placement = placement

    def place_daemon(self, pid: int) -> None:
        """Give every thread of a daemon just started the placement's CPUs
        (it inherited them from the bench already: this makes sure)."""
        want = self.cpus[self.placement]
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), want)
                if os.sched_getaffinity(int(tid)) != want:
                    raise BenchError(f"could not give thread {tid} of pid {pid} CPUs {want}")

    def fail(self, workload, target, rep, exc):
        tb = traceback.format_exception(exc)
        entry = {
            "workload": workload,
            "target": target,
            "rep": rep,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(tb[-6:]),
        }
        self.failures.append(entry)
        print(
            f"bench: FAILED {workload} on {target} (rep {rep}): {entry['error']}", file=sys.stderr
        )

    # set-up
    def make_fs(self):
        self.scratch = os.path.realpath(tempfile.mkdtemp(prefix="cowfs-bench-", dir="/tmp"))
        self.fsroot = os.path.join(self.scratch, "fs")
        os.mkdir(self.fsroot)
        size = max(4 * GiB, 3 * self.seq_size + 2 * self.rand_size + 3 * GiB)
        # (--fork-sizes: room and inodes for the largest workspace, and its adopt)
        most = max(self.args.fork_sizes or [0]) if "forks" in self.args.workloads else 0
        size = max(size, most * 2 * 4096 + 2 * GiB)
        inodes = ["-N", str(3 * most)] if 3 * most > size // 16384 else []
        if self.args.fs == "tmpfs":
            self.register(self.fsroot, self._unmount_fs)
            run(
                [
                    "mount",
                    "-t",
                    "tmpfs",
                    "-o",
                    f"size={size // MiB}m,mode=0755",
                    "cowfs-bench",
                    self.fsroot,
                ]
            )
            self.fs_desc = f"tmpfs (size={size // MiB} MiB) at {self.fsroot}"
            return
        self.image = os.path.join(self.scratch, "ext4.img")
        with open(self.image, "wb") as f:
            f.truncate(size)
        run(
            [
                "mkfs.ext4",
                "-q",
                "-F",
                "-O",
                "has_journal",
                "-E",
                "lazy_itable_init=0,lazy_journal_init=0",
                "-L",
                "cowfs-bench",
                *inodes,
                self.image,
            ]
        )
        self.register(self.fsroot, self._unmount_fs)
        run(["mount", "-o", "loop", self.image, self.fsroot])
        dev = run(["losetup", "-j", self.image]).stdout.decode().split(":")[0] or "?"
        feats = ""
        for line in run(["dumpe2fs", "-h", self.image]).stdout.decode().splitlines():
            if line.startswith("Filesystem features:"):
                feats = line.split(":", 1)[1].strip()
        opts = ""
        with open("/proc/self/mountinfo") as f:
            for line in f:
                if line.split(" ")[4] == self.fsroot:
                    opts = line.split(" ")[5]
        host = self._host_fs(self.scratch)
        self.fs_desc = (
            f"ext4 on {dev} (loop, buffered) mounted {opts} at {self.fsroot}; "
            f"journal: {'yes' if 'has_journal' in feats else 'NO'}; "
            f"sparse image {self.image} ({size // GiB} GiB) on {host}"
        )

    @staticmethod
    def _host_fs(path):
        best, desc = "", "?"
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mp = left.split(" ")[4]
                if (path == mp or path.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
                    best = mp
                    fstype, src = right.split(" ")[:2]
                    desc = f"{src} ({fstype}, mounted at {mp})"
        return desc

    def _unmount_fs(self):
        if mounted(self.fsroot):
            err = try_run(["umount", self.fsroot], timeout=120)
            if err:
                self.note(f"{err}; lazy unmount")
                try_run(["umount", "-l", self.fsroot], timeout=60)
        if self.image:
            attached = run(["losetup", "-j", self.image], check=False).stdout.decode()
            for line in attached.splitlines():
                try_run(["losetup", "-d", line.split(":")[0]], timeout=60)

    def make_tarball(self):
        src = os.path.realpath(self.args.tree)
        entries = []
        for root, dirs, files in os.walk(src):
            dirs.sort()
            rel = os.path.relpath(root, src)
            if rel != ".":
                entries.append(rel)
            for name in sorted(files):
                entries.append(os.path.normpath(os.path.join(rel, name)))
        if self.args.scale < 1:
            entries = entries[: max(50, int(len(entries) * self.args.scale))]
        lst = os.path.join(self.scratch, "tree.list")
        with open(lst, "w") as f:
            f.write("\n".join(entries) + "\n")
        self.tarball = os.path.join(self.scratch, "tree.tar")
        run(["tar", "-C", src, "-cf", self.tarball, "--no-recursion", "-T", lst])
        files = symlinks = dirs = nbytes = 0
        for e in entries:
            st = os.lstat(os.path.join(src, e))
            if os.path.islink(os.path.join(src, e)):
                symlinks += 1
            elif os.path.isdir(os.path.join(src, e)):
                dirs += 1
            else:
                files += 1
                nbytes += st.st_size
        self.tree_info = {
            "source": src,
            "files": files,
            "dirs": dirs,
            "symlinks": symlinks,
            "bytes": nbytes,
            "tar_bytes": os.path.getsize(self.tarball),
        }

    def check_tree(self, tree, extra: int = 0):
        found = 0
        for _root, dirs, names in os.walk(tree):
            found += len(dirs) + len(names)
        ti = self.tree_info
        want = ti["files"] + ti["dirs"] + ti["symlinks"] + extra
        if found != want:
            raise BenchError(f"extracted tree has {found} entries, expected {want}")

    # running
    def targets(self) -> list[Target]:
        ts: list[Target] = [Native(self), *(Cowfs(self, e) for e in self.args.engines)]
        if not self.args.no_overlay and shutil.which("fuse-overlayfs"):
            ts.append(Overlay(self))
        return ts

    def cowfs(self) -> Cowfs:
        """The target of the cowfs-only workloads: the first engine asked for."""
        return Cowfs(self, self.args.engines[0])

    def run_workload(self, wl: str, target: Target, rep: int) -> None:
        base = self.fresh_dir(f"{wl}-{target.name}-{self.placement}")
        where = f"{target.name} {self.placement}"
        prepare = PREPARE.get(wl)
        try:
            kw = {"store": True} if wl == "grave" and isinstance(target, Cowfs) else {}
            # (the bench reads the grave workload's backlog from the store)
            target.setup(base, (lambda d: prepare(self, d)) if prepare else None, **kw)
            WORKLOADS[wl](Ctx(self, target, wl, rep))
        except KeyboardInterrupt:
            raise
        except Exception as e:
            self.fail(wl, where, rep, e)
        finally:
            try:
                target.teardown()
            except Exception as e:
                self.fail(wl, where, rep, e)

    def run_all(self) -> None:
        targets = self.targets()
        placements = self.args.placement
        wls = [w for w in self.args.workloads if w in WORKLOADS]
        for rep in range(self.args.reps if wls or "latency" in self.args.workloads else 0):
            order = rotate(targets, rep)
            places = rotate(placements, rep)
            print(
                f"bench: repetition {rep + 1}/{self.args.reps} "
                f"(order: {', '.join(places)} x {', '.join(t.name for t in order)})",
                file=sys.stderr,
            )
            for wl in wls:
                for placement in places:
                    self.place(placement)
                    for t in order:
                        t0 = perf()
                        self.run_workload(wl, t, rep)
                        print(
                            f"bench:   {wl:<6} {t.name:<14} {placement:<8} {perf() - t0:7.1f} s",
                            file=sys.stderr,
                        )
            self.place("unpinned")  # the cowfs-only workloads
            if "latency" in self.args.workloads:
                t0 = perf()
                self.run_latency(rep)
                print(f"bench:   latency cowfs    {perf() - t0:7.1f} s", file=sys.stderr)
        self.place("unpinned")
        if "memory" in self.args.workloads and not self.args.no_memory:
            for engine in self.args.engines:
                t0 = perf()
                self.run_memory(engine)
                print(f"bench:   memory cowfs-{engine} {perf() - t0:7.1f} s", file=sys.stderr)
        if "scaling" in self.args.workloads:
            t0 = perf()
            self.run_scaling()
            print(f"bench:   scaling cowfs    {perf() - t0:7.1f} s", file=sys.stderr)
        if "forks" in self.args.workloads:
            t0 = perf()
            self.run_forks()
            print(f"bench:   forks cowfs      {perf() - t0:7.1f} s", file=sys.stderr)
        if "providers" in self.args.workloads:  # last: it may start dockerd and libvirtd
            t0 = perf()
            self.run_providers()
            print(f"bench:   providers        {perf() - t0:7.1f} s", file=sys.stderr)
        for (wl, rep), by_target in sorted(self.digests.items()):
            if len(set(by_target.values())) > 1:
                self.failures.append(
                    {
                        "workload": wl,
                        "target": "*",
                        "rep": rep,
                        "error": f"the targets disagree on the result: {by_target}",
                    }
                )

    def cleanup(self) -> None:
        for key, fn in reversed(list(self.resources.items())):
            try:
                fn()
            except Exception as e:
                self.note(f"cleanup of {key} failed: {e}")
        self.resources.clear()
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
        with open("/proc/self/mountinfo") as f:
            left = [
                line.split(" ")[4]
                for line in f
                if self.scratch and self.scratch in line.split(" ")[4]
            ]
        if left:
            self.note(f"STILL MOUNTED after cleanup: {left}")
