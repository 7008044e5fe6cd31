"""The workloads run on every target, each a function of a Ctx (the timing
context of one repetition of one workload on one target)."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import threading
import time
from typing import TYPE_CHECKING

from .helpers import (
    BenchError,
    GiB,
    MiB,
    balloon,
    drop_caches,
    files_digest,
    git_env,
    perf,
    proc_threads,
    run,
)
from .targets import Cowfs, Target

if TYPE_CHECKING:
    from .bench import Bench


class Ctx:
    """Timing context for one (repetition, workload, target) run."""

    def __init__(self, bench: Bench, target: Target, workload: str, rep: int):
        self.b, self.t, self.workload, self.rep = bench, target, workload, rep
        self.dir = target.dir
        self.placement = bench.placement
        self.key = f"{target.name} {self.placement}"  # names the run's results

    @contextlib.contextmanager
    def step(self, label: str, cold: bool = False):
        """Prepare (sync, drop caches if *cold*, touch memory) then run the body
        under a watchdog that kills the target's daemon if it hangs."""
        fired = []

        def fire():
            for pid in self.t.pids():
                fired.append(f"pid {pid} threads: {proc_threads(pid)}")
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        timer = threading.Timer(self.b.args.step_timeout, fire)
        timer.daemon = True
        timer.start()
        try:
            try:
                if cold:
                    drop_caches()
                else:
                    os.sync()
                balloon()
                yield
            except Exception as e:
                if fired:
                    raise BenchError(
                        f"step '{label}' took over {self.b.args.step_timeout} s "
                        f"(hang?); killed the {self.t.label} daemon "
                        f"[{'; '.join(fired)}]: {e}"
                    ) from e
                raise
            if fired:
                raise BenchError(
                    f"step '{label}' took over {self.b.args.step_timeout} s; "
                    f"killed the {self.t.label} daemon [{'; '.join(fired)}]"
                )
        finally:
            timer.cancel()
        self.t.check_alive()

    def record(
        self,
        name: str,
        secs: float,
        ops: int | None = None,
        nbytes: int | None = None,
        per_op: bool = False,
    ) -> None:
        """*per_op*: report the time per operation, not a rate."""
        self.b.add_sample(
            self.workload,
            name,
            self.placement,
            self.t.name,
            secs,
            {"ops": ops, "bytes": nbytes, "per_op": per_op},
        )

    def timed(self, name: str, fn, *, ops=None, nbytes=None, per_op=False, cold=False):
        with self.step(name, cold=cold):
            t0 = perf()
            res = fn()
            self.record(name, perf() - t0, ops, nbytes, per_op)
        return res


# -- workloads (each takes a Ctx whose .dir is the target directory) ---------------


def wl_tree(c: Ctx) -> None:
    """tar -x of a real source tree, cold read of it, rm -rf."""
    b = c.b
    tree = os.path.join(c.dir, "tree")
    os.mkdir(tree)
    c.timed(
        f"tar -x tree ({b.tree_info['files']:,} files)",
        lambda: run(["tar", "-xf", b.tarball, "-C", tree]),
    )
    b.check_tree(tree)

    def read_all():
        n = 0
        for root, _dirs, files in os.walk(tree):
            for name in files:
                p = os.path.join(root, name)
                if os.path.islink(p):
                    continue
                fd = os.open(p, os.O_RDONLY)
                try:
                    while chunk := os.read(fd, MiB):
                        n += len(chunk)
                finally:
                    os.close(fd)
        if n != b.tree_info["bytes"]:
            raise BenchError(f"read {n} bytes of the tree, expected {b.tree_info['bytes']}")

    c.timed("read tree (cold cache)", read_all, nbytes=b.tree_info["bytes"], cold=True)
    c.timed("rm -rf tree", lambda: run(["rm", "-rf", tree]))
    if os.path.exists(tree):
        raise BenchError("rm -rf left the tree behind")


def wl_git(c: Ctx) -> None:
    """git init + add -A + commit of the extracted tree."""
    b = c.b
    tree = os.path.join(c.dir, "tree")
    os.mkdir(tree)
    run(["tar", "-xf", b.tarball, "-C", tree])
    env = git_env(b.scratch)
    total = 0.0
    for name, cmd in (
        ("git init", ["git", "init", "-q"]),
        ("git add -A", ["git", "add", "-A"]),
        ("git commit", ["git", "commit", "-q", "-m", "bench"]),
    ):
        with c.step(name):
            t0 = perf()
            run(cmd, cwd=tree, env=env)
            dt = perf() - t0
        c.record(name, dt)
        total += dt
    c.record("git init+add+commit", total)
    r = run(["git", "ls-files"], cwd=tree, env=env)
    n = len(r.stdout.splitlines())
    if n != b.tree_info["files"] + b.tree_info["symlinks"]:
        raise BenchError(
            f"git ls-files lists {n} paths, expected "
            f"{b.tree_info['files'] + b.tree_info['symlinks']}"
        )
    c.b.digests.setdefault(("git", c.rep), {})[c.key] = (
        run(["git", "rev-parse", "HEAD^{tree}"], cwd=tree, env=env).stdout.decode().strip()
    )


def wl_small(c: Ctx) -> None:
    """N x 1 KiB files: create, stat (warm), read (cat), delete."""
    n = c.b.n_small
    d = os.path.join(c.dir, "small")
    os.mkdir(d)
    paths = [os.path.join(d, f"f{i:06d}") for i in range(n)]
    data = bytes(random.Random(1).randbytes(1024))

    def create():
        for p in paths:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, data)
            os.close(fd)

    def stat_all():
        for p in paths:
            if os.stat(p).st_size != 1024:
                raise BenchError(f"{p}: wrong size")

    def read_all():
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            got = os.read(fd, 65536)
            rest = os.read(fd, 65536)  # cat reads until EOF
            os.close(fd)
            if got != data or rest:
                raise BenchError(f"{p}: read back wrong data ({len(got)}+{len(rest)} bytes)")

    def delete():
        for p in paths:
            os.unlink(p)

    k = f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else f"{n:,}"
    c.timed(f"create {k} x 1 KiB", create, ops=n)
    c.timed(f"stat {k} (warm)", stat_all, ops=n)
    c.timed(f"read {k} (cat, warm)", read_all, ops=n)
    c.timed(f"delete {k}", delete, ops=n)
    if os.listdir(d):
        raise BenchError("files left after deleting all")


def wl_seq(c: Ctx) -> None:
    """Sequential write (1 MiB writes + fsync) and cold sequential read."""
    size = c.b.seq_size
    p = os.path.join(c.dir, "seq.bin")
    buf = bytearray(random.Random(2).randbytes(MiB))
    blocks = size // MiB

    def write():
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for i in range(blocks):
                buf[:8] = i.to_bytes(8, "little")
                if os.write(fd, buf) != MiB:
                    raise BenchError("short write")
            os.fsync(fd)
        finally:
            os.close(fd)

    def read():
        rbuf = bytearray(MiB)
        fd = os.open(p, os.O_RDONLY)
        try:
            for i in range(blocks):
                n = os.readv(fd, [rbuf])
                if n != MiB or int.from_bytes(rbuf[:8], "little") != i:
                    raise BenchError(
                        f"block {i}: read {n} bytes, header {int.from_bytes(rbuf[:8], 'little')}"
                    )
            if os.read(fd, 1):
                raise BenchError("file longer than written")
        finally:
            os.close(fd)

    label = f"{size // GiB} GiB" if size % GiB == 0 else f"{size // MiB} MiB"
    c.timed(f"seq write {label} + fsync", write, nbytes=size)
    c.timed(f"seq read {label} (cold cache)", read, nbytes=size, cold=True)
    os.unlink(p)


def wl_rand(c: Ctx) -> None:
    """Random aligned 4 KiB pwrites into an existing file; cowfs after a checkpoint."""
    b = c.b
    size, count = b.rand_size, b.rand_count
    p = os.path.join(c.dir, "rand.bin")
    block = random.Random(3).randbytes(MiB)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for _ in range(size // MiB):
        os.write(fd, block)
    os.fsync(fd)
    os.close(fd)
    if isinstance(c.t, Cowfs):
        c.t.cli("checkpoint", "-m", "bench rand")
    rng = random.Random(4)
    offsets = [rng.randrange(size // 4096) * 4096 for _ in range(count)]
    mib = f"{size // MiB} MiB"
    for npass, fill in ((1, b"\x11"), (2, b"\x22")):
        data = fill * 4096
        what = "first write of each chunk" if npass == 1 else "same offsets again"
        with c.step(f"rand pass {npass}"):
            fd = os.open(p, os.O_WRONLY)
            try:
                t0 = perf()
                for off in offsets:
                    os.pwrite(fd, data, off)
                t1 = perf()
                os.fsync(fd)
                t2 = perf()
            finally:
                os.close(fd)
        c.record(f"rand 4K write in {mib}, pass {npass} ({what})", t1 - t0, ops=count)
        c.record(f"  pass {npass}, including the final fsync", t2 - t0, ops=count)
    b.digests.setdefault(("rand", c.rep), {})[c.key] = files_digest([p])
    os.unlink(p)


def wl_grave(c: Ctx) -> None:
    """rm -rf of a tree of files that existed before the layer (the tarball
    tree plus some 64 MiB files): cowfs moves each into the grave and hashes
    it in the background.  On cowfs also the time until that pass has caught
    up (from the start of the rm), and the rollback, which verifies every
    hash before it puts a file back; both from a cold cache."""
    b = c.b
    tree = os.path.join(c.dir, "tree")
    os.mkdir(tree)
    run(["tar", "-xf", b.tarball, "-C", tree])
    rng = random.Random(7)
    for i in range(b.grave_big):
        with open(os.path.join(tree, f"big{i}.bin"), "wb") as f:
            for _ in range(64):
                f.write(rng.randbytes(MiB))
    files = b.tree_info["files"] + b.grave_big
    nbytes = b.tree_info["bytes"] + b.grave_big * 64 * MiB
    before = files_digest(
        sorted(
            os.path.join(r, n)
            for r, _, ns in os.walk(tree)
            for n in ns
            if not os.path.islink(os.path.join(r, n))
        )
    )
    cow = isinstance(c.t, Cowfs)
    if cow:
        c.t.cli("checkpoint", "-m", "before rm -rf")
    name = f"rm -rf tree kept whole ({files:,} files, {nbytes // MiB} MiB)"
    with c.step(name, cold=True):
        t0 = perf()
        run(["rm", "-rf", tree])
        c.record(name, perf() - t0)
        if cow:
            backlog = c.t.grave_backlog()
            while backlog:
                time.sleep(0.01)
                backlog = c.t.grave_backlog()
            if backlog is not None:
                c.record("  ... until all are hashed (background)", perf() - t0)
    if os.path.exists(tree):
        raise BenchError("rm -rf left the tree behind")
    if not cow:
        return
    with c.step("rollback of the rm -rf", cold=True):
        res, _ = c.t.cli("rollback")
    c.record("  rollback of it (verifies every hash)", res["daemon_ms"] / 1000)
    b.check_tree(tree, extra=b.grave_big)
    after = files_digest(
        sorted(
            os.path.join(r, n)
            for r, _, ns in os.walk(tree)
            for n in ns
            if not os.path.islink(os.path.join(r, n))
        )
    )
    if after != before:
        raise BenchError("the rollback of the rm -rf did not restore the tree's bytes")


def extract_tree(b: Bench, d: str) -> None:
    """The tree, extracted natively before the mount (cp, cat): files no
    layer made, as in a checkout one then works in."""
    tree = os.path.join(d, "tree")
    os.mkdir(tree)
    run(["tar", "-xf", b.tarball, "-C", tree])


def wl_cp(c: Ctx) -> None:
    """cp -a of the tree into a fresh directory on the same target."""
    b = c.b
    tree, copy = os.path.join(c.dir, "tree"), os.path.join(c.dir, "copy")
    c.timed(f"cp -a tree ({b.tree_info['files']:,} files)", lambda: run(["cp", "-a", tree, copy]))
    b.check_tree(copy)


def wl_cat(c: Ctx) -> None:
    """cat of every file of the tree (find -exec cat {} +, counted by wc -c),
    from a cold cache, then again warm."""
    want = c.b.tree_info["bytes"]

    def cat():
        r = run(["sh", "-c", "find tree -type f -exec cat {} + | wc -c"], cwd=c.dir)
        if int(r.stdout) != want:
            raise BenchError(f"cat of the tree gave {int(r.stdout)} bytes, expected {want}")

    c.timed(f"cat every file ({c.b.tree_info['files']:,}), cold cache", cat, cold=True)
    c.timed("  the same again, warm", cat)


NULL_XATTR = "user.cowfs-bench-missing"


def wl_null(c: Ctx) -> None:
    """The null request: fgetxattr of an attribute the file does not have,
    in a tight loop (on FUSE one GETXATTR round trip each, nothing cached)."""
    n = c.b.null_count
    p = os.path.join(c.dir, "null")
    with open(p, "wb") as f:
        f.write(b"x")
    fd = os.open(p, os.O_RDONLY)

    def loop(count):
        for _ in range(count):
            try:
                os.getxattr(fd, NULL_XATTR)
            except OSError as e:
                if e.errno != errno.ENODATA:
                    raise BenchError(f"getxattr {NULL_XATTR}: {e}") from e
            else:
                raise BenchError(f"{p} has {NULL_XATTR}")

    try:
        loop(100)  # warm-up
        c.timed(
            "null request (fgetxattr of a missing user.*), per request",
            lambda: loop(n),
            ops=n,
            per_op=True,
        )
    finally:
        os.close(fd)


def npm_layout(packages: int) -> list[tuple[str, int]]:
    """What an npm install writes, in order: per package (every 8th under a
    @scope directory) three nested directories and 30 files of 0.5-8 KiB;
    (path, -1) is a directory, (path, size) a file."""
    rng = random.Random(8)
    out: list[tuple[str, int]] = []
    for i in range(packages):
        pkg = f"pkg{i:03d}"
        if i % 8 == 0:
            scope = f"@scope{i % 5}"
            if (scope, -1) not in out:
                out.append((scope, -1))
            pkg = os.path.join(scope, pkg)
        lib = os.path.join(pkg, "lib")
        internal = os.path.join(lib, "internal")
        out += [(pkg, -1), (lib, -1), (internal, -1)]
        names = (
            [
                os.path.join(pkg, n)
                for n in ("package.json", "index.js", "README.md", "LICENSE", "CHANGELOG.md")
            ]
            + [os.path.join(lib, f"m{j:02d}.js") for j in range(15)]
            + [os.path.join(internal, f"i{j:02d}.js") for j in range(10)]
        )
        out += [(name, rng.randint(512, 8192)) for name in names]
    return out


def wl_npm(c: Ctx) -> None:
    """An npm-like install: many small files in nested directories, made by
    one process (mkdir; open, write, close)."""
    layout = npm_layout(c.b.npm_packages)
    blob = random.Random(9).randbytes(8192)
    root = os.path.join(c.dir, "node_modules")
    files = [size for _, size in layout if size >= 0]

    def create():
        os.mkdir(root)
        for rel, size in layout:
            p = os.path.join(root, rel)
            if size < 0:
                os.mkdir(p)
                continue
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, blob[:size])
            os.close(fd)

    c.timed(
        f"npm-like create: {c.b.npm_packages} packages x 30 files "
        f"({len(files):,}, {sum(files) / MiB:.0f} MiB)",
        create,
    )
    found = sum(len(names) for _, _, names in os.walk(root))
    if found != len(files):
        raise BenchError(f"node_modules holds {found} files, expected {len(files)}")


WORKLOADS = {
    "tree": wl_tree,
    "cp": wl_cp,
    "cat": wl_cat,
    "npm": wl_npm,
    "null": wl_null,
    "git": wl_git,
    "small": wl_small,
    "seq": wl_seq,
    "rand": wl_rand,
    "grave": wl_grave,
}
PREPARE = {"cp": extract_tree, "cat": extract_tree}  # before the mount
