"""The workloads that run on cowfs alone (the first engine of --engines,
unpinned): control latency and start-up, stack operations by layer size
(scaling), and the daemon's memory after walking a big tree."""

from __future__ import annotations

import os
import random

from .helpers import (
    COWFS,
    VENV_PY,
    BenchError,
    balloon,
    drop_caches,
    files_digest,
    perf,
    run,
    summarize,
    vm_status,
)
from .targets import Cowfs
from .workloads import Ctx

SCALING_KINDS = ("creates", "writes", "renames", "unlinks", "attrs")
SCALING_SIZES = (1_000, 10_000, 100_000)
SCALING_OPS = (
    "status",
    "diff --stat",
    "unmount",
    "mount",
    "rollback",
    "redo",
    "commit",
    "checkpoint",
)


def scaling_path(d: str, i: int) -> str:
    """The i-th file of the scaling workload (100 per subdirectory)."""
    return os.path.join(d, f"s{i // 100:04d}", f"f{i:06d}")


def scaling_build(d: str, kind: str, n: int) -> None:
    """N changes of one kind under *d* (through the mount): creates; writes
    into existing files; renames (write a temporary name, rename it into
    place: what sed -i, pip and editors do); unlinks; chmods."""
    for i in range(n):
        p = scaling_path(d, i)
        if kind == "creates":
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, b"new")
            os.close(fd)
        elif kind == "writes":
            fd = os.open(p, os.O_WRONLY)
            os.pwrite(fd, b"y", 0)
            os.close(fd)
        elif kind == "renames":
            fd = os.open(p + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, b"renamed")
            os.close(fd)
            os.rename(p + ".tmp", p)
        elif kind == "unlinks":
            os.unlink(p)
        elif kind == "attrs":
            os.chmod(p, 0o600)


class CowfsRuns:
    """The cowfs-only runs of a Bench (a part of it: Bench derives from this)."""

    def run_latency(self, rep: int) -> None:
        for n in (5, self.lat_files):
            self.latency_of(n, rep)

    def latency_of(self, n: int, rep: int) -> None:
        """The control latencies on a workspace of *n* files of 4 KiB."""
        t = self.cowfs()
        base = self.fresh_dir(f"latency{n}-cowfs")

        def prepare(ws):
            d = os.path.join(ws, "files")
            os.mkdir(d)
            rng = random.Random(5)
            for i in range(n):
                with open(os.path.join(d, f"f{i:05d}"), "wb") as f:
                    f.write(rng.randbytes(4096))

        try:
            t.setup(base, prepare)
            c = Ctx(self, t, "latency", rep)
            files = [os.path.join(t.dir, "files", f"f{i:05d}") for i in range(n)]

            def modify(tag: bytes):
                for p in files:
                    fd = os.open(p, os.O_WRONLY)
                    os.pwrite(fd, tag * 100, 0)
                    os.close(fd)

            def timed_cli(name, *args):
                with c.step(name):
                    res, wall = t.cli(*args)
                d = self.latency.setdefault(name, {}).setdefault(
                    n, {"daemon_ms": [], "wall_ms": []}
                )
                d["daemon_ms"].append(res["daemon_ms"])
                d["wall_ms"].append(wall)
                return res

            modify(b"A")  # changes in the base layer
            timed_cli("checkpoint", "checkpoint", "-m", "bench")
            if n == 5:
                self.measure_startup(t)
            modify(b"B")
            timed_cli("commit (merge into the layer below)", "commit")
            t.cli("checkpoint", "-m", "bench 2")
            before = files_digest(files)
            modify(b"C")
            if files_digest(files) == before:
                raise BenchError("modifying the files did not change them")
            changed = files_digest(files)

            def check_rolled_back():
                if files_digest(files) != before:
                    bad = []
                    for p in files:
                        with open(p, "rb") as f:
                            if f.read(100) == b"C" * 100:
                                bad.append(os.path.basename(p))
                    raise BenchError(
                        f"rollback of a layer with {n} modified files did "
                        f"not restore them ({len(bad)} still show the "
                        f"rolled-back write, e.g. {bad[:3]})"
                    )

            timed_cli("rollback", "rollback")
            check_rolled_back()
            timed_cli("redo (undo the rollback)", "redo")
            if files_digest(files) != changed:
                raise BenchError(
                    f"redo of a rollback of {n} modified files did not bring their changes back"
                )
            timed_cli("rollback --no-redo", "rollback", "--no-redo")
            check_rolled_back()
            timed_cli("commit (base layer: make permanent)", "commit")
        except KeyboardInterrupt:
            raise
        except Exception as e:
            self.fail(f"latency ({n} files)", t.name, rep, e)
        finally:
            try:
                t.teardown()
            except Exception as e:
                self.fail(f"latency ({n} files)", t.name, rep, e)

    def measure_startup(self, t) -> None:
        """Start-up of a control command: the interpreter alone, `cowfs
        --version` (the command line, no daemon) and `cowfs checkpoint`
        (what an agent's hook runs each turn), wall clock, five of each after
        one not counted.  Bytecode is written and used, as for an installed
        package (PYTHONDONTWRITEBYTECODE would make every start compile)."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        for i in range(6):
            for what, argv in (
                ("python -c pass", [VENV_PY, "-c", "pass"]),
                ("cowfs --version", [COWFS, "--version"]),
                ("cowfs checkpoint", [COWFS, "-C", t.dir, "checkpoint"]),
            ):
                t0 = perf()
                run(argv, timeout=60, env=env)
                if i:
                    self.startup.setdefault(what, []).append((perf() - t0) * 1000)
            t.cli("commit")  # (the layer the checkpoint opened)

    def run_scaling(self) -> None:
        """For layers of N records of one kind, what each stack operation
        costs (the command's wall clock): so that growth faster than the
        work shows at a glance.  One workspace per kind and size; the layer
        is built through the mount, then: status, diff --stat, unmount,
        mount, rollback, redo (the layer back), commit (merged into the
        base), checkpoint.  --quick: the two smaller sizes."""
        for kind in self.args.scaling_kinds:
            for size in SCALING_SIZES[:2] if self.args.quick else SCALING_SIZES:
                n = max(10, int(size * self.args.scale))
                t = self.cowfs()
                base = self.fresh_dir(f"scaling-{kind}-{n}")

                def prepare(ws, n=n, kind=kind):
                    d = os.path.join(ws, "d")
                    os.mkdir(d)
                    for i in range(n // 100 + 1):
                        os.mkdir(os.path.join(d, f"s{i:04d}"))
                    if kind in ("writes", "unlinks", "attrs"):
                        for i in range(n):
                            with open(scaling_path(d, i), "wb") as f:
                                f.write(b"x" * 100)

                try:
                    t.setup(base, prepare)
                    t.cli("checkpoint", "-m", f"{n} {kind}")
                    t0 = perf()
                    scaling_build(os.path.join(t.dir, "d"), kind, n)
                    row = self.scaling.setdefault(kind, {})
                    row.setdefault("build (through the mount)", {})[n] = perf() - t0
                    records = t.cli("log")[0][-1]["records"]
                    row.setdefault("records", {})[n] = records
                    for op in SCALING_OPS:
                        balloon()
                        t0 = perf()
                        if op == "unmount":
                            r = run([COWFS, "unmount", t.dir], timeout=600, check=False)
                            if r.returncode:
                                raise BenchError(f"unmount: {summarize(r.stderr)}")
                            took = perf() - t0
                        elif op == "mount":
                            t.remount()
                            took = perf() - t0
                        else:  # (the command's wall clock, not the bench reading its answer)
                            took = t.cli(*op.split())[1] / 1000
                        row.setdefault(op, {})[n] = took
                except KeyboardInterrupt:
                    raise
                except Exception as e:
                    self.fail(f"scaling ({kind}, {n})", t.name, 0, e)
                finally:
                    try:
                        t.teardown()
                    except Exception as e:
                        self.fail(f"scaling ({kind}, {n})", t.name, 0, e)

    def run_memory(self, engine: str) -> None:
        n = self.mem_files
        per_dir = 1000
        t = Cowfs(self, engine)
        base = self.fresh_dir(f"memory-{t.name}")
        mem = self.memory[engine] = {}
        walk = ["find", ".", "-type", "f", "-exec", "stat", "--format=%s", "{}", "+"]

        def prepare(ws):
            data = b"x" * 256
            for i in range(n):
                d = os.path.join(ws, f"d{i // per_dir:04d}")
                if i % per_dir == 0:
                    os.mkdir(d)
                fd = os.open(os.path.join(d, f"f{i:06d}"), os.O_WRONLY | os.O_CREAT, 0o644)
                os.write(fd, data)
                os.close(fd)
            drop_caches()
            balloon()
            t0 = perf()
            r = run(walk, cwd=ws)
            mem["native_walk_s"] = perf() - t0
            if len(r.stdout.splitlines()) != n:
                raise BenchError("native walk saw the wrong number of files")

        try:
            t.setup(base, prepare)
            mem["files"] = n
            mem["mount_wall_s"] = t.mount_wall
            mem["after_mount"] = vm_status(t.pid)
            c = Ctx(self, t, "memory", 0)
            with c.step("find + stat", cold=True):
                t0 = perf()
                r = run(walk, cwd=t.dir, check=False)
                mem["cowfs_walk_s"] = perf() - t0
            mem["after_walk"] = vm_status(t.pid)
            seen = len(r.stdout.splitlines())
            mem["walk_saw"] = seen
            if r.returncode != 0 or seen != n:
                mem["walk_error"] = summarize(r.stderr, 2)
                raise BenchError(
                    f"`{' '.join(walk)}` through cowfs exited {r.returncode} "
                    f"having listed {seen:,} of {n:,} files: "
                    f"{summarize(r.stderr, 2)}; daemon then had "
                    f"{mem['after_walk']['fds']:,} open fds "
                    f"(limit {mem['after_walk'].get('fd_limit')})"
                )
        except KeyboardInterrupt:
            raise
        except Exception as e:
            self.fail("memory", t.name, 0, e)
        finally:
            try:
                t.teardown()
            except Exception as e:
                self.fail("memory", t.name, 0, e)
