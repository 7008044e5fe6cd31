"""What every part of the bench uses: paths and sizes, running commands,
mounts, caches, a daemon's threads and memory, digests, and LoadWatch (what
else loads the machine during a run)."""

from __future__ import annotations

import os
import statistics
import subprocess
import threading
import time
from typing import TYPE_CHECKING

import xxhash  # (a cowfs dependency)

from cowfs.system.mounts import mount_table, pid_alive

if TYPE_CHECKING:
    from .bench import Bench

# tools/cowfs_bench/helpers.py -> the repository
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
VENV = os.path.join(REPO, ".venv")
VENV_PY = os.path.join(VENV, "bin", "python")
COWFS = os.path.join(VENV, "bin", "cowfs")
MiB = 1 << 20
GiB = 1 << 30


class BenchError(Exception):
    """A failed step: a command's error, a wrong result, a hang, a dead daemon."""


def provider_daemons():
    """tools/provider_daemons.py (starts dockerd/libvirtd, makes images and
    domains): only the providers need it."""
    from tools import provider_daemons

    return provider_daemons


def perf() -> float:
    return time.perf_counter()


def summarize(text, lines: int = 4) -> str:
    """The first lines of a command's output, and how many more there were."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    all_lines = (text or "").strip().splitlines()
    head = " | ".join(line[:300] for line in all_lines[:lines])
    if len(all_lines) > lines:
        head += f" | ... ({len(all_lines) - lines} more lines)"
    return head


def run(cmd, timeout=None, check=True, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    r = subprocess.run(cmd, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise BenchError(
            f"{' '.join(map(str, cmd))} exited {r.returncode}: "
            f"{summarize(r.stderr) or summarize(r.stdout)}"
        )
    return r


def try_run(cmd, timeout) -> str | None:
    """Run a clean-up command; return an error description, or None if it worked."""
    try:
        r = run(cmd, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"{' '.join(cmd)}: no answer within {timeout} s"
    except OSError as e:
        return f"{' '.join(cmd)}: {e}"
    if r.returncode != 0:
        return (
            f"{' '.join(cmd)} exited {r.returncode}: {summarize(r.stderr) or summarize(r.stdout)}"
        )
    return None


# -- machine-level helpers -------------------------------------------------------


def balloon(mib: int = 256) -> None:
    """Touch and free *mib* MiB so the next step does not pay first-touch costs."""
    b = bytearray(mib * MiB)
    b[::4096] = b"\1" * (len(b) // 4096)
    del b


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def mounted(path: str) -> str | None:
    return mount_table().get(path)


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def proc_threads(pid: int) -> str:
    """Thread states of a (hung) daemon, for the failure report."""
    out = []
    try:
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            base = f"/proc/{pid}/task/{tid}"
            try:
                comm = open(f"{base}/comm").read().strip()
                wchan = open(f"{base}/wchan").read().strip()
                state = open(f"{base}/stat").read().rsplit(")", 1)[1].split()[0]
                out.append(f"{tid}:{comm}:{state}:{wchan}")
            except OSError:
                pass
    except OSError:
        pass
    return " ".join(out)


def vm_status(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM in MiB, open fds and the fd limit of *pid*."""
    res: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                res[key] = int(val.split()[0]) / 1024  # kB -> MiB
    res["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                res["fd_limit"] = int(line.split()[3])
    return res


def files_digest(paths) -> str:
    h = xxhash.xxh3_128()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(MiB):
                h.update(chunk)
    return h.hexdigest()


def git_env(home: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HOME=home,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL="/dev/null",
        GIT_AUTHOR_NAME="bench",
        GIT_AUTHOR_EMAIL="bench@localhost",
        GIT_COMMITTER_NAME="bench",
        GIT_COMMITTER_EMAIL="bench@localhost",
        GIT_AUTHOR_DATE="2024-01-01T00:00:00Z",
        GIT_COMMITTER_DATE="2024-01-01T00:00:00Z",
        LC_ALL="C",
    )
    return env


def rotate(items: list, k: int) -> list:
    """*items* starting at the k-th (modulo its length)."""
    k %= len(items)
    return items[k:] + items[:k]


def spread(values: list[float]) -> str:
    """Median [min-max] of times in ms."""

    def ms(v):
        return f"{v:.1f}" if v < 10 else f"{v:.0f}"

    if not values:
        return "-"
    return f"{ms(statistics.median(values))} [{ms(min(values))}-{ms(max(values))}]"


# -- what else loads the machine ---------------------------------------------------


class LoadWatch:
    """Every *period* s, the 1-minute load average and the CPU time that other
    processes took: all but the bench's own (its descendants, and the cowfs
    daemons, which name a path in its scratch directory) and kernel threads.
    (A process that started and ended between two samples is not seen.)"""

    def __init__(self, bench: Bench, period: float = 10.0):
        self.b = bench
        self.period = period
        self.tick = os.sysconf("SC_CLK_TCK")
        self.me = os.getpid()
        self.samples: list[tuple[float, float, float]] = []  # (s since start, load1, CPUs)
        self.others: dict[str, float] = {}  # command -> CPU seconds
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.t0 = perf()
        self.load_at_start = os.getloadavg()
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.load_at_end = os.getloadavg()

    @staticmethod
    def _procs() -> dict[int, tuple[int, str, float]]:
        """pid -> (ppid, command line, CPU ticks) of every process with a
        command line (kernel threads have none)."""
        out = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if cmd:
                out[int(d)] = (int(fields[1]), cmd, int(fields[11]) + int(fields[12]))
        return out

    def _ours(self, pid: int, procs) -> bool:
        for _ in range(64):
            if pid == self.me:
                return True
            if pid not in procs:
                return False
            ppid, cmd, _ = procs[pid]
            if self.b.scratch and self.b.scratch in cmd:
                return True
            pid = ppid
        return False

    def _run(self) -> None:
        last = self._procs()
        while not self.stop.wait(self.period):
            now = self._procs()
            busy = 0.0
            for pid, (_, cmd, ticks) in now.items():
                if self._ours(pid, now):
                    continue
                prev = last.get(pid)
                used = (ticks - (prev[2] if prev and prev[1] == cmd else 0)) / self.tick
                if used > 0:
                    busy += used
                    name = summarize(cmd, 1)[:60]
                    self.others[name] = self.others.get(name, 0.0) + used
            self.samples.append((perf() - self.t0, os.getloadavg()[0], busy / self.period))
            last = now

    def to_json(self) -> dict:
        return {
            "at_start": getattr(self, "load_at_start", None),
            "at_end": getattr(self, "load_at_end", None),
            "period_s": self.period,
            "samples": self.samples,
            "other_cpu_s": self.others,
        }

    def report(self) -> list[str]:
        if not self.samples:
            return []
        loads = [s[1] for s in self.samples]
        busy = [s[2] for s in self.samples]
        top = sorted(((c, t) for c, t in self.others.items() if t >= 1), key=lambda kv: -kv[1])[:4]
        start = ", ".join(f"{x:.2f}" for x in self.load_at_start)
        return [
            f"  load:    at the start {start} (1, 5, 15 min); 1-min load during the run "
            f"{min(loads):.2f}-{max(loads):.2f}, median {statistics.median(loads):.2f} "
            f"(the bench itself keeps about 1 busy)",
            f"  others:  other processes used {statistics.mean(busy):.2f} CPUs on average, "
            f"{max(busy):.2f} at most over {self.period:g} s"
            + (f"; most: {'; '.join(f'{c} ({t:.0f} s)' for c, t in top)}" if top else ""),
        ]
