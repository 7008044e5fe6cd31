"""What a workload runs on: the native directory, a cowfs mount (one per
engine) and fuse-overlayfs; each sets up in a fresh directory and tears down
whatever it mounted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from typing import TYPE_CHECKING

import lmdb  # (a cowfs dependency)

from cowfs.system.mounts import MountRecord, pid_alive

from .helpers import COWFS, BenchError, mounted, perf, run, summarize, try_run, wait_gone

if TYPE_CHECKING:
    from .bench import Bench


class Target:
    name = ""
    label = ""

    def __init__(self, bench: Bench):
        self.b = bench
        self.base: str | None = None
        self.dir: str | None = None

    def pids(self) -> list[int]:
        return []

    def check_alive(self) -> None:
        pass

    def setup(self, base: str, prepare=None) -> str:
        raise NotImplementedError

    def teardown(self) -> None:
        if self.base:
            shutil.rmtree(self.base, ignore_errors=True)
        self.base = self.dir = None


class Native(Target):
    name = "native"
    label = "native"

    def setup(self, base: str, prepare=None) -> str:
        self.base = base
        self.dir = os.path.join(base, "dir")
        os.makedirs(self.dir)
        if prepare:
            prepare(self.dir)
        return self.dir


class Cowfs(Target):
    def __init__(self, bench, engine: str):
        super().__init__(bench)
        self.engine = engine  # cowfs mount --engine
        self.name = f"cowfs-{engine}"
        self.label = f"cowfs ({engine} engine)"
        self.pid: int | None = None
        self.mount_wall = 0.0
        self.store: str | None = None

    def pids(self):
        return [self.pid] if self.pid else []

    def setup(self, base: str, prepare=None, name: str = "ws", store: bool = False) -> str:
        """*store*: the store beside the workspace (BASE/store), where the
        bench can read it while mounted, instead of hidden inside it."""
        self.base = base
        ws = self.dir = os.path.join(base, name)
        self.store = os.path.join(base, "store") if store else None
        os.makedirs(ws)
        if prepare:
            prepare(ws)
        self.b.register(ws, lambda: self._force_unmount(ws))
        t0 = perf()
        r = run(
            [
                COWFS,
                "--json",
                "mount",
                "--engine",
                self.engine,
                *(["--store", self.store] if store else []),
                ws,
            ],
            timeout=300,
            check=False,
        )
        self.mount_wall = perf() - t0
        if r.returncode != 0:
            raise BenchError(
                f"cowfs mount {ws} exited {r.returncode}: "
                f"{summarize(r.stdout)} {summarize(r.stderr)}"
            )
        for line in r.stderr.decode().splitlines():
            self.b.warnings.add(line.strip())
        self.find_daemon()
        return ws

    def find_daemon(self) -> None:
        """The daemon of the mount just made, given the placement's CPUs."""
        rec = MountRecord.load(self.dir)
        if rec is None or mounted(self.dir) != "fuse.cowfs":
            raise BenchError(f"cowfs mount {self.dir} returned 0 but no mount/record is there")
        self.pid = rec.pid
        self.b.place_daemon(self.pid)

    def remount(self) -> None:
        r = run([COWFS, "mount", "--engine", self.engine, self.dir], timeout=600, check=False)
        if r.returncode:
            raise BenchError(f"mount: {summarize(r.stderr)}")
        self.find_daemon()

    def check_alive(self) -> None:
        if self.pid and not pid_alive(self.pid):
            raise BenchError(f"the cowfs daemon (pid {self.pid}) died")
        if self.dir and mounted(self.dir) != "fuse.cowfs":
            raise BenchError(f"{self.dir} is no longer a cowfs mount")

    def cli(self, *args: str) -> tuple[dict, float]:
        """Run a control command; return its JSON reply and the wall-clock ms."""
        t0 = perf()
        r = run([COWFS, "-C", self.dir, "--json", *args], timeout=600, check=False)
        wall = (perf() - t0) * 1000
        if r.returncode != 0:
            raise BenchError(
                f"cowfs -C {self.dir} --json {' '.join(args)} exited "
                f"{r.returncode}: {summarize(r.stdout)} {summarize(r.stderr)}"
            )
        return json.loads(r.stdout), wall

    def grave_backlog(self) -> int | None:
        """Removed files the daemon has not hashed yet, read from its store
        beside it (LMDB readers do not disturb the writer); None for a
        cowfs without hashes."""
        from cowfs.storage import schema as S

        env = lmdb.open(os.path.join(self.store, "db"), readonly=True, max_dbs=32)
        try:
            with env.begin() as txn:
                try:
                    db = env.open_db(b"gravesums", txn=txn, create=False)
                except lmdb.NotFoundError:
                    return None
                return sum(1 for _, v in txn.cursor(db=db) if v[:1] == S.SUM_PENDING)
        finally:
            env.close()

    def _force_unmount(self, ws: str) -> None:
        pid = self.pid
        if pid is None:
            rec = MountRecord.load(ws)
            pid = rec.pid if rec else None
        errs = []
        if mounted(ws):
            if pid and pid_alive(pid):
                err = try_run([COWFS, "unmount", ws], timeout=120)
                if err:
                    errs.append(err)
                    self.b.note(f"{err} (falling back to fusermount3 -u)")
            if mounted(ws):
                err = try_run(["fusermount3", "-u", ws], timeout=60)
                if err:
                    errs.append(err)
            if mounted(ws):
                err = try_run(["umount", "-l", ws], timeout=60)
                if err:
                    errs.append(err)
        if pid and not wait_gone(pid, 30):
            self.b.note(f"cowfs daemon {pid} still alive after unmount; killing it")
            os.kill(pid, signal.SIGKILL)
            wait_gone(pid, 10)
        if mounted(ws):
            raise BenchError(f"could not unmount {ws}: {'; '.join(errs)}")
        rec = MountRecord.load(ws)
        if rec is not None and not pid_alive(rec.pid):
            rec.remove()  # a daemon that was killed leaves its record behind
        if errs:
            raise BenchError(f"unmounting {ws} needed a fallback: {'; '.join(errs)}")

    def teardown(self) -> None:
        if self.dir:
            try:
                self._force_unmount(self.dir)
            finally:
                if not mounted(self.dir):  # else the final clean-up tries again
                    self.b.unregister(self.dir)
        self.pid = None
        super().teardown()


class Overlay(Target):
    name = "fuse-overlayfs"
    label = "fuse-overlayfs"

    def __init__(self, bench):
        super().__init__(bench)
        self.proc: subprocess.Popen | None = None

    def pids(self):
        return [self.proc.pid] if self.proc else []

    def setup(self, base: str, prepare=None) -> str:
        self.base = base
        lower, upper, work, mnt = (os.path.join(base, d) for d in ("lower", "upper", "work", "mnt"))
        for d in (lower, upper, work, mnt):
            os.makedirs(d)
        if prepare:
            prepare(upper)
        self.dir = mnt
        self.b.register(mnt, lambda: self._force_unmount(mnt))
        log = open(os.path.join(self.b.scratch, "fuse-overlayfs.log"), "ab")
        self.proc = subprocess.Popen(
            [
                "fuse-overlayfs",
                "-f",
                "-o",
                f"lowerdir={lower},upperdir={upper},workdir={work}",
                mnt,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 30
        while not (mounted(mnt) or "").startswith("fuse"):
            if self.proc.poll() is not None:
                raise BenchError(f"fuse-overlayfs exited {self.proc.returncode} without mounting")
            if time.monotonic() > deadline:
                raise BenchError("fuse-overlayfs did not mount within 30 s")
            time.sleep(0.01)
        self.b.place_daemon(self.proc.pid)
        return mnt

    def check_alive(self) -> None:
        if self.proc and self.proc.poll() is not None:
            raise BenchError(f"fuse-overlayfs exited {self.proc.returncode}")

    def _force_unmount(self, mnt: str) -> None:
        if mounted(mnt):
            try_run(["fusermount3", "-u", mnt], timeout=120)
        if mounted(mnt):
            try_run(["fusermount3", "-uz", mnt], timeout=60)
        if self.proc:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if mounted(mnt):
            try_run(["umount", "-l", mnt], timeout=60)
        if mounted(mnt):
            raise BenchError(f"could not unmount {mnt}")

    def teardown(self) -> None:
        if self.dir:
            try:
                self._force_unmount(self.dir)
            finally:
                if not mounted(self.dir):
                    self.b.unregister(self.dir)
        self.proc = None
        super().teardown()
