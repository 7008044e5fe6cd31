"""The forks workload (cowfs alone, the first engine of --engines): what a
fork costs to make and to drop by the workspace's size, the disk space
forks take, reads and writes inside a fork against the same in its
workspace (pinned and unpinned), and an adopt of many changed files."""

from __future__ import annotations

import os

from cowfs.interface.api import Workspace
from cowfs.system.mounts import MountRecord

from .helpers import COWFS, BenchError, balloon, drop_caches, perf, run, summarize

FORK_SIZES = (1_000, 10_000, 100_000)  # files in the workspace
FORKS_EACH = 4  # forks made (and dropped) at each size
DISK_FORKS, DISK_CHANGES = 8, 10
IO_FILES = 2_000  # files read, and files written, inside a fork and in its workspace
ADOPT_FILES = 10_000


def _tree(ws: str, n: int) -> None:
    for i in range(0, n, 100):
        d = os.path.join(ws, f"d{i // 100:05d}")
        os.mkdir(d)
        for j in range(i, min(n, i + 100)):
            with open(os.path.join(d, f"f{j:07d}"), "wb") as f:
                f.write(b"x" * 256)


def _du(path: str) -> int:
    total = 0
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _ms(t0: float) -> float:
    return (perf() - t0) * 1000


class ForkRuns:
    """The forks runs of a Bench (a part of it: Bench derives from this)."""

    def run_forks(self) -> None:
        f = self.forks = {"make": {}, "drop": {}, "cli": {}, "io": {}, "disk": {}, "adopt": {}}
        sizes = FORK_SIZES[:2] if self.args.quick else FORK_SIZES
        sizes = tuple(self.args.fork_sizes or sizes)
        for size in sizes:
            n = max(100, int(size * self.args.scale)) if not self.args.fork_sizes else size
            t = self.cowfs()
            base = self.fresh_dir(f"forks-{n}")
            ws = None
            try:
                # (the store beside the workspace: its forks' space can be read)
                t.setup(base, lambda d, n=n: _tree(d, n), store=True)
                ws = Workspace.attach(t.dir)
                self._fork_times(f, t, ws, n)
                if size == sizes[-1]:
                    self._fork_disk(f, t, ws, n)
                    self._fork_io(f, t, ws, min(n, IO_FILES))
                    self._fork_adopt(f, t, ws)
            except KeyboardInterrupt:
                raise
            except Exception as e:
                self.fail(f"forks ({n})", t.name, 0, e)
            finally:
                try:
                    if ws is not None:
                        for row in ws.call("forks")["forks"]:
                            ws.drop(row["name"], force=True)
                    t.teardown()
                except Exception as e:
                    self.fail(f"forks ({n})", t.name, 0, e)

    def _fork_times(self, f: dict, t, ws: Workspace, n: int) -> None:
        """FORKS_EACH forks by the API (the daemon's operation and its
        answer), the first one starting the workspace's zygote; one by the
        CLI (a process of its own: its start-up included); each dropped.
        The workspace changes a file before each fork, so that each opens
        a fork point of its own (forks made with nothing changed between
        share one, and skip opening a layer)."""

        def change(why: str) -> None:
            with open(os.path.join(t.dir, "between-forks"), "w") as fh:
                fh.write(f"before {why}\n")

        def api(op: str) -> list[float]:
            took = []
            for i in range(FORKS_EACH):
                if op == "fork":
                    change(f"fork {i}")
                balloon()
                t0 = perf()
                ws.call(op, name=f"b{i}")
                took.append(_ms(t0))
            return took

        def cli(op: str) -> None:
            if op == "fork":
                change("the CLI's fork")
            t0 = perf()
            r = run([COWFS, "-C", t.dir, op, "cli"], timeout=300, check=False)
            if r.returncode:
                raise BenchError(f"cowfs {op}: {summarize(r.stderr)}")
            f["cli"].setdefault(op, {})[n] = _ms(t0)

        made = api("fork")
        cli("fork")
        dropped = api("drop")
        cli("drop")
        f["make"][n] = made
        f["drop"][n] = dropped

    def _fork_disk(self, f: dict, t, ws: Workspace, n: int) -> None:
        """DISK_FORKS forks each changing DISK_CHANGES files: the store's
        growth (the forks' upper layers and stores, the workspace's
        records of their fork points)."""
        store = t.store
        before = _du(store)
        for i in range(DISK_FORKS):
            root = ws.call("fork", name=f"disk{i}")["path"]
            for j in range(DISK_CHANGES):
                k = j * max(1, n // DISK_CHANGES)
                p = os.path.join(root, f"d{k // 100:05d}", f"f{k:07d}")
                with open(p, "r+b") as fh:
                    fh.write(b"fork %d" % i)
        os.sync()
        grown = _du(store) - before
        f["disk"] = {"files": n, "forks": DISK_FORKS, "changes": DISK_CHANGES, "bytes": grown}
        for i in range(DISK_FORKS):
            ws.drop(f"disk{i}")

    def _fork_io(self, f: dict, t, ws: Workspace, count: int) -> None:
        """Reads (cold and warm) of *count* files unchanged since the fork
        point, and creates of *count* files, in the fork and in the
        workspace, in each placement (every process of the workspace and
        of the fork given the placement's CPUs)."""
        root = ws.call("fork", name="io")["path"]
        names = [f"d{i // 100:05d}/f{i:07d}" for i in range(count)]
        f["io_files"] = count
        for placement in self.args.placement:
            self.place(placement)
            for pid in self._cowfs_pids(t.dir):
                self.place_daemon(pid)
            for side, top in (("workspace", t.dir), ("fork", root)):
                out = f["io"].setdefault(placement, {}).setdefault(side, {})
                for cold in (True, False):
                    if cold:
                        drop_caches()
                    balloon()
                    t0 = perf()
                    for name in names:
                        with open(os.path.join(top, name), "rb") as fh:
                            fh.read()
                    out["read cold" if cold else "read warm"] = _ms(t0)
                d = os.path.join(top, f"new-{placement}")
                os.mkdir(d)
                balloon()
                t0 = perf()
                for i in range(count):
                    fd = os.open(os.path.join(d, f"n{i}"), os.O_WRONLY | os.O_CREAT, 0o644)
                    os.write(fd, b"y" * 4096)
                    os.close(fd)
                out["create 4 KiB"] = _ms(t0)
        self.place("unpinned")
        ws.drop("io")

    def _cowfs_pids(self, workspace: str) -> list[int]:
        """The workspace's daemon and every process of its forks (views,
        daemons, the zygote)."""
        pids = []
        rec = MountRecord.load(workspace)
        if rec is not None:
            pids.append(rec.pid)
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/cmdline", "rb") as fh:
                    cmd = fh.read()
            except OSError:
                continue
            if b"cowfs.service.zygote" in cmd or b"/run/cowfs/forks/" in cmd:
                pids.append(int(d))
        return pids

    def _fork_adopt(self, f: dict, t, ws: Workspace) -> None:
        """A fork that made ADOPT_FILES new files (100 a directory), adopted."""
        n = max(100, int(ADOPT_FILES * self.args.scale))
        root = ws.call("fork", name="adopt")["path"]
        for i in range(n):
            d = os.path.join(root, "adopted", f"a{i // 100:04d}")
            if i % 100 == 0:
                os.makedirs(d)
            with open(os.path.join(d, f"f{i}"), "wb") as fh:
                fh.write(b"z" * 256)
        balloon()
        t0 = perf()
        ws.adopt("adopt")
        took = _ms(t0)
        got = sum(len(files) for _, _, files in os.walk(os.path.join(t.dir, "adopted")))
        if got != n:
            raise BenchError(f"adopt made {got} files of {n}")
        f["adopt"] = {"files": n, "ms": took}

    def forks_report(self) -> list[str]:
        f = getattr(self, "forks", None)
        if not f or not f["make"]:
            return []
        med = _median
        out = ["", "Forks (cowfs-kernel; ms; API = the daemon's operation and its answer)"]
        out.append(
            f"  {'files':>9}  {'1st fork':>9}  {'fork (med)':>10}  {'drop (med)':>10}"
            f"  {'cowfs fork':>10}  {'cowfs drop':>10}"
        )
        for n in sorted(f["make"]):
            made, dropped = f["make"][n], f["drop"][n]
            out.append(
                f"  {n:>9,}  {made[0]:>9.0f}  {med(made[1:] or made):>10.0f}"
                f"  {med(dropped):>10.0f}  {f['cli']['fork'][n]:>10.0f}"
                f"  {f['cli']['drop'][n]:>10.0f}"
            )
        sizes = sorted(f["make"])
        for a, b in zip(sizes, sizes[1:], strict=False):
            grow = med(f["make"][b][1:]) / med(f["make"][a][1:])
            out.append(f"  fork growth {a:,} -> {b:,} files: {grow:.2f}x")
        if f["disk"]:
            d = f["disk"]
            out.append(
                f"  disk: {d['forks']} forks of {d['files']:,} files, each changing "
                f"{d['changes']} files: +{d['bytes'] / 2**20:.1f} MiB"
            )
        for placement, sides in f["io"].items():
            ws, fk = sides.get("workspace", {}), sides.get("fork", {})
            parts = [
                f"{what} {fk[what]:.0f}/{ws[what]:.0f} ms = {fk[what] / ws[what]:.2f}x"
                for what in ws
                if what in fk and ws[what]
            ]
            out.append(
                f"  in a fork vs its workspace, {placement}, {f['io_files']:,} files: "
                + "; ".join(parts)
            )
        if f["adopt"]:
            a = f["adopt"]
            out.append(
                f"  adopt of {a['files']:,} new files: {a['ms'] / 1000:.2f} s "
                f"({a['files'] / (a['ms'] / 1000):,.0f} paths/s)"
            )
        return out


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2
