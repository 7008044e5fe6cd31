"""Crash trials: concurrent writers, kill -9 of the daemon at a random
moment (while programs write, in the middle of a rollback, of a commit or
of a redo), mount again, roll back to the checkpoint, compare trees.  A
rollback (interrupted or not) must also be redone exactly: the tree as it
was before it, and the checkpoint's layer rolling back exactly again.

    python -m tests.crashsoak --trials 100 [--seed S] [--writers 4] [--keep-failed]
                              [--moments redo,rollback]

prints one line per trial and then ``K/N exact``; the exit status is 0 only
when every trial was exact: the trees as they must be, the hard links of
every tree walk through the mount those of the backing directory underneath
(names grouped by the st_ino the mount showed, as treesnap groups them, and
by real inode), and nothing said by the mount that finished an interrupted
operation but that it did (no step of it failed, the store check of the
dead mount found nothing).
tests/test_crash.py runs a few trials in CI; tools/soak runs many.  Real
mounts, real processes: run as root.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from cowfs.layers import treesnap
from cowfs.system.mounts import STORE_DIR, MountRecord, is_cowfs_mount, pid_alive

from .helpers import backing_dir

COWFS = [sys.executable, "-m", "cowfs"]
MOMENTS = ("writing", "rollback", "commit", "redo")
CHUNK = 64 << 10


def cowfs(*args, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([*COWFS, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(
            f"cowfs {' '.join(map(str, args))} exited {r.returncode}: {r.stderr.strip()}"
        )
    return r


# -- the writers ---------------------------------------------------------------------


def writer(root: str, seed: int, ops: int) -> None:
    """Random file operations under *root*/wN until killed or *ops* done.
    Errors are expected (names race with other writers; the mount dies)."""
    rnd = random.Random(seed)
    me = f"w{seed % 1000}"
    names = [
        f"{d}/{n}" for d in ("", "d1", "d2", f"{me}") for n in ("small", "big", "x", "y", f"{me}-f")
    ]

    def path(name: str) -> str:
        return os.path.join(root, name.lstrip("/"))

    for _ in range(ops):
        name = rnd.choice(names)
        p = path(name)
        op = rnd.randrange(12)
        try:
            if op <= 2:  # write at a random offset, small or across chunks
                size = rnd.choice((1, 100, 4096, CHUNK + 7, 3 * CHUNK))
                fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    os.pwrite(fd, rnd.randbytes(size), rnd.randrange(4 * CHUNK))
                    if rnd.random() < 0.2:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            elif op == 3:
                with open(p, "ab") as f:
                    f.write(rnd.randbytes(rnd.randrange(1, 9000)))
            elif op == 4:
                os.truncate(p, rnd.choice((0, 10, CHUNK - 1, 2 * CHUNK + 5)))
            elif op == 5:
                os.rename(p, path(rnd.choice(names)))
            elif op == 6:
                os.unlink(p)
            elif op == 7:
                os.mkdir(path(rnd.choice(("d1", "d2", me, f"d1/{me}"))))
            elif op == 8:
                os.rmdir(path(rnd.choice(("d1", "d2", me, f"d1/{me}"))))
            elif op == 9:
                os.chmod(p, rnd.choice((0o600, 0o644, 0o755)))
            elif op == 10:
                os.link(p, path(rnd.choice(names)))
            else:
                os.symlink(rnd.choice(("small", "../x", "nowhere")), path(rnd.choice(names)))
        except OSError:
            pass


def bulk(root: str, seed: int, count: int) -> None:
    """Many small changes at once (so that a rollback or commit of them
    takes long enough to be interrupted): files created in a new directory,
    rewritten, and some existing ones appended to."""
    rnd = random.Random(seed)
    top = os.path.join(root, f"bulk{seed % 1000}")
    try:
        os.mkdir(top)
        for i in range(count):
            with open(os.path.join(top, f"f{i}"), "wb") as f:
                f.write(rnd.randbytes(rnd.randrange(1, 200)))
            if i % 7 == 0:
                os.chmod(os.path.join(top, f"f{i}"), 0o600)
    except OSError:
        pass


def populate(root: Path, rnd: random.Random) -> None:
    for d in ("d1", "d2", "keep"):
        (root / d).mkdir()
    for name in ("small", "d1/small", "d2/x", "keep/a"):
        (root / name).write_bytes(rnd.randbytes(rnd.randrange(1, 3000)))
    for name in ("big", "d1/big", "keep/big"):
        (root / name).write_bytes(rnd.randbytes(rnd.randrange(3 * CHUNK, 6 * CHUNK)))
    os.link(root / "keep" / "a", root / "keep" / "a-link")
    os.symlink("keep/a", root / "sym")
    os.chmod(root / "keep" / "big", 0o600)


# -- hard links as the mount shows them and as they are -------------------------------


def _inodes(root: Path) -> dict[bytes, os.stat_result]:
    """Every entry below *root* (the store excepted) and its lstat."""
    found: dict[bytes, os.stat_result] = {}
    top = os.fsencode(root)
    pending = [b""]
    while pending:
        rel = pending.pop()
        for name in os.listdir(os.path.join(top, rel) if rel else top):
            if not rel and name == os.fsencode(STORE_DIR):
                continue
            path = os.path.join(rel, name) if rel else name
            st = os.lstat(os.path.join(top, path))
            found[path] = st
            if stat.S_ISDIR(st.st_mode):
                pending.append(path)
    return found


def _groups(found: dict[bytes, os.stat_result]) -> dict[bytes, frozenset[bytes]]:
    """Each non-directory's names: all paths that share its inode."""
    by_ino: dict[int, set[bytes]] = {}
    for path, st in found.items():
        if not stat.S_ISDIR(st.st_mode):
            by_ino.setdefault(st.st_ino, set()).add(path)
    return {p: frozenset(names) for names in by_ino.values() for p in names}


def _show(path: bytes | None) -> str:
    return "none" if path is None else repr(path.decode(errors="replace"))


def link_problems(ws: Path, snap: treesnap.Snapshot) -> list[str]:
    """Where the hard links of *snap* (a snapshot of *ws* taken through the
    mount just before: names grouped by the st_ino the mount showed while
    the walk went on) or of the mount now (a second walk, stat only)
    disagree with the backing directory's (names sharing a real inode), or
    a link count the mount shows now is not the number of names it shows
    of the object: each disagreement, described.  Only while nothing
    changes the tree."""
    seen, real = _inodes(ws), _inodes(backing_dir(ws))
    problems = [
        f"{'only through the mount' if p in seen else 'only in the backing directory'}: {_show(p)}"
        for p in sorted(seen.keys() ^ real.keys())
    ]
    shown, actual = _groups(seen), _groups(real)

    def names(group: frozenset[bytes]) -> str:
        return "{" + ", ".join(sorted(n.decode(errors="replace") for n in group)) + "}"

    for path, group in sorted(actual.items()):
        # (treesnap links a name to the least name of its group, if it has more)
        want = min(group) if len(group) > 1 else None
        entry = snap.get(path)
        if entry is not None and entry.link != want:
            problems.append(
                f"hard links of {_show(path)}: the tree walk through the mount linked it to "
                f"{_show(entry.link)}, the backing directory has {names(group)}"
            )
    for path in sorted(shown.keys() & actual.keys()):
        if shown[path] != actual[path] and path == min(shown[path] | actual[path]):
            problems.append(
                f"hard links of {_show(path)}: the mount shows {names(shown[path])} "
                f"(st_ino {seen[path].st_ino}), the backing directory has "
                f"{names(actual[path])} (inode {real[path].st_ino})"
            )
    for path, group in sorted(shown.items()):
        st = seen[path]
        if path == min(group) and st.st_nlink != len(group):
            problems.append(
                f"link count of {_show(path)}: the mount shows {st.st_nlink} for "
                f"{names(group)} (st_ino {st.st_ino})"
            )
    return problems


# -- one trial ------------------------------------------------------------------------


@dataclass
class Trial:
    n: int
    moment: str
    exact: bool
    interrupted: str  # what the remount said it finished, if anything
    detail: str = ""


def kill_daemon(mountpoint: Path) -> None:
    rec = MountRecord.load(str(mountpoint))
    if rec is None:
        return
    try:
        os.kill(rec.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while pid_alive(rec.pid) and time.monotonic() < deadline:
        time.sleep(0.005)


def start_writers(
    ws: Path, count: int, seed: int, ops: int, function: str = "writer"
) -> list[subprocess.Popen]:
    """*count* processes running *function*(ws, seed, ops) of this module."""
    code = (
        f"import sys; from tests.crashsoak import {function}; "
        f"{function}(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))"
    )
    repo = Path(__file__).resolve().parent.parent
    return [
        subprocess.Popen(
            [sys.executable, "-c", code, str(ws), str(seed * 100 + i), str(ops)],
            cwd=repo,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(count)
    ]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def run_trial(n: int, base: Path, seed: int, writers: int, moment: str) -> Trial:
    rnd = random.Random(seed)
    ws = base / f"trial-{n}"
    ws.mkdir()
    populate(ws, rnd)
    procs: list[subprocess.Popen] = []
    bg: subprocess.Popen | None = None
    links: list[str] = []  # the mount's hard links against the backing directory's

    def look(when: str) -> treesnap.Snapshot:
        """The tree through the mount, its hard links checked."""
        snap = treesnap.snapshot(ws)
        links.extend(f"{when}: {problem}" for problem in link_problems(ws, snap))
        return snap

    try:
        cowfs("mount", ws)
        start_writers(ws, 1, seed + 7, 40)[0].wait()  # some changes in the base layer
        layer = json.loads(cowfs("--json", "-C", ws, "checkpoint", "-m", "trial").stdout)["id"]
        expected = look("at the checkpoint")
        procs = start_writers(ws, writers, seed, 100_000)
        if moment == "writing":
            time.sleep(rnd.uniform(0.2, 1.0))
            kill_daemon(ws)
        else:
            if moment == "commit":
                time.sleep(rnd.uniform(0.1, 0.5))
                cowfs("-C", ws, "checkpoint", "-m", "upper")
            start_writers(ws, 1, seed, rnd.randrange(500, 3000), "bulk")[0].wait()
            stop(procs)
            before = look(f"before the {moment}")
            op = {
                "rollback": ["rollback", "--to", str(layer)],
                "commit": ["commit"],
                "redo": ["redo"],
            }[moment]
            if moment == "redo":
                cowfs("-C", ws, "rollback", "--to", layer)
            bg = subprocess.Popen(
                [*COWFS, "-C", str(ws), *op], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            # (a redo of what the rollback kept is quicker than the rollback:
            # killed sooner, more trials catch it midway)
            time.sleep(rnd.uniform(0.05, 0.35) if moment == "redo" else rnd.uniform(0.1, 0.5))
            kill_daemon(ws)
        stop(procs)
        if bg is not None:
            bg.wait(timeout=60)
        mounted = json.loads(cowfs("--json", "mount", ws).stdout)
        warnings = mounted.get("warnings", [])
        finished = "; ".join(w for w in warnings if "interrupted" in w)
        # what else the mount said (the steps that failed first, then the store check)
        failures = sorted(
            (w for w in warnings if "interrupted" not in w and "cleared the dead mount" not in w),
            key=lambda w: w.startswith("store check:"),
        )
        layers = [entry["id"] for entry in json.loads(cowfs("--json", "-C", ws, "log").stdout)]
        if moment == "redo" and layer not in layers:
            cowfs("-C", ws, "redo")  # (killed before the redo began)
            layers.append(layer)
        diff = []
        if moment in ("rollback", "redo"):
            if moment == "rollback" and layer not in layers:
                # the rollback (finished by the mount) is redone exactly
                diff = treesnap.compare(expected, look("after the remount"))
                cowfs("-C", ws, "redo")
                layers.append(layer)
            again = "after the redo" if moment == "redo" else "after the rollback and its redo"
            diff += treesnap.compare(before, look(again))
        if layer in layers:
            cowfs("-C", ws, "rollback", "--to", layer)
        else:
            return Trial(n, moment, False, finished, f"layer {layer} vanished: {layers}")
        diff += treesnap.compare(expected, look("after the last rollback"))
        # (a step that failed, or a store check that found something, or a
        # mount whose hard links are not the backing directory's, is a
        # defect even where the tree came out right)
        return Trial(
            n,
            moment,
            not diff and not failures and not links,
            finished,
            "; ".join([*diff[:5], *failures[:5], *links[:5]]),
        )
    finally:
        stop(procs)
        if bg is not None and bg.poll() is None:
            bg.kill()
        if is_cowfs_mount(str(ws)):
            if cowfs("unmount", ws, check=False).returncode != 0:
                kill_daemon(ws)
                subprocess.run(["umount", "-l", str(ws)], capture_output=True)
        kill_daemon(ws)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="crashsoak", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--writers", type=int, default=4)
    p.add_argument(
        "--dir", help="where to make the workspaces (default: a temporary directory on /var/tmp)"
    )
    p.add_argument(
        "--keep-failed",
        action="store_true",
        help="keep the workspaces of trials that were not exact",
    )
    p.add_argument(
        "--moments",
        default=",".join(MOMENTS),
        help=f"the moments to kill at, taken in turn (default: {','.join(MOMENTS)})",
    )
    args = p.parse_args(argv)
    moments = args.moments.split(",")
    if not moments or any(m not in MOMENTS for m in moments):
        p.error(f"--moments: a comma-separated list of {', '.join(MOMENTS)}")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    base = Path(tempfile.mkdtemp(prefix="cowfs-crash-", dir=args.dir or "/var/tmp"))
    print(f"crashsoak: {args.trials} trials, {args.writers} writers, seed {seed}, in {base}")
    results = []
    t0 = time.monotonic()
    try:
        for n in range(args.trials):
            moment = moments[n % len(moments)]
            try:
                t = run_trial(n, base, seed + n, args.writers, moment)
            except Exception as e:  # a trial that could not even finish is not exact
                where = traceback.extract_tb(e.__traceback__)[-1]
                t = Trial(
                    n,
                    moment,
                    False,
                    "",
                    f"{type(e).__name__}: {e} (at {Path(where.filename).name}:{where.lineno})",
                )
            results.append(t)
            print(
                f"trial {n:3} kill while {moment:9} {'exact' if t.exact else 'NOT EXACT'}"
                + (f"  (mount: {t.interrupted})" if t.interrupted else "")
                + (f"  {t.detail}" if t.detail else ""),
                flush=True,
            )
            if t.exact or not args.keep_failed:
                shutil.rmtree(base / f"trial-{n}", ignore_errors=True)
    finally:
        if not any(not t.exact for t in results) or not args.keep_failed:
            shutil.rmtree(base, ignore_errors=True)
    exact = sum(t.exact for t in results)
    resumed = sum(bool(t.interrupted) for t in results)
    print(
        f"crashsoak: {exact}/{len(results)} exact ({resumed} trials resumed an interrupted "
        f"rollback, commit or redo at the next mount), {time.monotonic() - t0:.0f} s, "
        f"seed {seed}"
    )
    return 0 if exact == len(results) == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
