"""Layer switches under concurrent writers (DESIGN invariant 4).

Eight writer processes keep rewriting their own files while the test
checkpoints, commits and rolls back; a ``make -j8`` builds a small C project
while checkpoints and commits come and go.  Nothing here passes or fails by
timing: the checks follow from what the writers publish in shared memory.

Each writer ``i`` works in generations: before it starts changing anything
for generation ``g`` it publishes ``started[i] = g``, after the change has
completed ``done[i] = g``.  Its file always holds one whole record, which
names the writer and generation and is otherwise fixed by them, so a torn
file (parts of two generations, or a record cut short) is recognised.

* In-place writers rewrite a record that straddles a chunk boundary in the
  middle of a larger file with one pwrite() and read it back.
* Replacing writers write a new file in three writes under a name of its
  own and rename it over theirs.

A checkpoint's instant lies between the moment the command is sent and the
moment it returns, so the state it opens a layer on has, for every writer, a
generation between ``done`` before the command and ``started`` after it.
After a rollback to that layer (made while the writers run) the writers are
stopped (SIGSTOP, waited for); then each file must hold a whole record
either of a generation in that range -- the restored one -- or of one that
started after the rollback command was sent.  Where the checkpoint was taken
with the writers stopped, the restored file must equal the snapshot taken
then exactly (bytes, size, mode, mtime).  The writers check what they read
too: never a torn record, and after a rollback the generation restored.
Some rollbacks are made with the writers stopped half-way through a
generation; then the whole tree must equal the snapshot exactly.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cowfs.layers import treesnap
from cowfs.service import control
from cowfs.system.mounts import MountRecord

from .test_posix import in_child

WRITERS = 8
IN_PLACE = range(0, 4)
REPLACING = range(4, 8)
FILE_SIZE = 128 << 10
REC_AT = 60 << 10  # an in-place record spans the 64 KiB chunk boundary
REC_SIZE = 8 << 10
PART = 40 << 10  # a replacing writer writes its record in three parts
WAIT = 120.0  # generous bound for writers to make progress (liveness only)
PAUSE = 0.004  # between a writer's generations: room for the CPUs, and files
# that no writer touched between a rollback and the SIGSTOP


def record(i: int, g: int, size: int) -> bytes:
    head = b"W%d G%08d|" % (i, g)
    body = bytes([(i * 31 + g) % 251 + 1]) * (size - len(head) - 1)
    return head + body + b"\n"


def generation(i: int, data: bytes, size: int) -> int | None:
    """The generation of a whole record of writer *i*, or None."""
    try:
        g = int(data[data.index(b"G") + 1 : data.index(b"|")])
    except ValueError:
        return None
    return g if data == record(i, g, size) else None


def file_generation(i: int, data: bytes) -> int | None:
    """The generation of writer *i*'s whole file *data*, or None if torn."""
    if i in IN_PLACE:
        outside = data[:REC_AT] + data[REC_AT + REC_SIZE :]
        if len(data) != FILE_SIZE or outside != b"." * (FILE_SIZE - REC_SIZE):
            return None
        return generation(i, data[REC_AT : REC_AT + REC_SIZE], REC_SIZE)
    return generation(i, data, 3 * PART)


def make_writer_files(root: Path) -> None:
    root.mkdir()
    for i in IN_PLACE:
        data = bytearray(b"." * FILE_SIZE)
        data[REC_AT : REC_AT + REC_SIZE] = record(i, 0, REC_SIZE)
        (root / f"w{i}").write_bytes(data)
    for i in REPLACING:
        (root / f"w{i}").write_bytes(record(i, 0, 3 * PART))


class Writers:
    """The writer processes and what they publish: the generations they
    started and completed, and what they saw of rollbacks.

    A writer reads its file before and after each change.  It is the only
    one that writes it, so a read that does not give the generation it wrote
    last shows a rollback's work: the restored generation.  It is noted as
    an observation, with the number of that rollback.

    The test announces each rollback before sending it (``epoch``) and says
    when it has returned (``settled``).  A read that overlaps a rollback is
    read again: a file opened before a rollback may be an object the
    rollback gave back its old bytes under another name (a half-written new
    file, say), and cached pages are dropped only after the tree is back.
    """

    # The shared array: started, done and observation counts of each writer;
    # stop, epoch, settled; then OBS (epoch, generation) pairs per writer.
    STARTED, DONE, NOBS = 0, WRITERS, 2 * WRITERS
    STOP, EPOCH, SETTLED = 3 * WRITERS, 3 * WRITERS + 1, 3 * WRITERS + 2
    OBS_AT, OBS = 3 * WRITERS + 3, 64

    def __init__(self, root: Path):
        self.root = root
        n = self.OBS_AT + 2 * WRITERS * self.OBS
        self.mem = mmap.mmap(-1, 8 * n)  # anonymous and shared: the children see it
        self.arr = (ctypes.c_int64 * n).from_buffer(self.mem)
        self.pids: list[int] = []

    @property
    def started(self) -> list[int]:
        return self.arr[self.STARTED : self.STARTED + WRITERS]

    @property
    def done(self) -> list[int]:
        return self.arr[self.DONE : self.DONE + WRITERS]

    def announce(self) -> int:
        """A rollback is about to be sent; its number."""
        self.arr[self.EPOCH] += 1
        return self.arr[self.EPOCH]

    def settle(self) -> None:
        """The rollback announced last has returned."""
        self.arr[self.SETTLED] = self.arr[self.EPOCH]

    def observations(self, i: int) -> list[tuple[int, int]]:
        """(epoch, generation seen) of writer *i*."""
        base = self.OBS_AT + 2 * self.OBS * i
        return [
            (self.arr[base + 2 * k], self.arr[base + 2 * k + 1])
            for k in range(self.arr[self.NOBS + i])
        ]

    def start(self) -> None:
        self.pids = [
            in_child(functools.partial(self._work, i), f"writer {i}") for i in range(WRITERS)
        ]

    # -- in the writer processes --------------------------------------------------------

    def _work(self, i: int) -> None:
        fd = os.open(self.root / f"w{i}", os.O_RDWR) if i in IN_PLACE else -1
        last = g = 0
        while not self.arr[self.STOP]:
            g += 1
            self.arr[self.STARTED + i] = g
            self._observe(i, self._read(i, fd), last)
            if i in IN_PLACE:
                os.pwrite(fd, record(i, g, REC_SIZE), REC_AT)
            else:
                self._replace(i, g)
            last = self._read(i, fd)
            self._observe(i, last, g)
            self.arr[self.DONE + i] = g
            time.sleep(PAUSE)

    def _read(self, i: int, fd: int) -> int:
        while True:
            epoch, settled = self.arr[self.EPOCH], self.arr[self.SETTLED]
            if i in IN_PLACE:
                data = os.pread(fd, FILE_SIZE + 1, 0)
            else:
                data = (self.root / f"w{i}").read_bytes()
            if epoch == settled == self.arr[self.EPOCH]:
                break
            time.sleep(PAUSE)  # a rollback overlapped the read: read again
        g = file_generation(i, data)
        if g is None:
            raise AssertionError(f"read a torn file: {data[:20]!r}... ({len(data)} bytes)")
        return g

    def _observe(self, i: int, seen: int, expected: int) -> None:
        if seen == expected:
            return
        k = self.arr[self.NOBS + i]
        if k == self.OBS:
            raise AssertionError("too many observations")
        base = self.OBS_AT + 2 * self.OBS * i + 2 * k
        self.arr[base], self.arr[base + 1] = self.arr[self.SETTLED], seen
        self.arr[self.NOBS + i] = k + 1

    def _replace(self, i: int, g: int) -> None:
        rec = record(i, g, 3 * PART)
        tmp = self.root / f"w{i}.tmp.{g}"
        while True:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for k in range(3):
                    os.write(fd, rec[k * PART : (k + 1) * PART])
            finally:
                os.close(fd)
            try:
                os.rename(tmp, self.root / f"w{i}")
                return
            except FileNotFoundError:
                continue  # a rollback removed the new file: write it again

    # -- in the test ----------------------------------------------------------------------

    def pause(self) -> None:
        """Stop every writer and wait until it is stopped (so each of its
        system calls has returned)."""
        for pid in self.pids:
            os.kill(pid, signal.SIGSTOP)
        for pid in self.pids:
            _, status = os.waitpid(pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status), f"writer {pid} ended: {status:#x}"

    def resume(self) -> None:
        for pid in self.pids:
            os.kill(pid, signal.SIGCONT)

    def wait_beyond(self, gens: list[int]) -> None:
        """Wait until every writer has completed a generation past *gens*
        (if they run)."""
        deadline = time.monotonic() + WAIT
        while self.pids and not all(d > g for d, g in zip(self.done, gens, strict=False)):
            for pid in self.pids:
                done, status = os.waitpid(pid, os.WNOHANG)
                assert not done, f"writer {pid} ended: {status:#x}"
            assert time.monotonic() < deadline, "the writers made no progress"
            time.sleep(0.005)

    def finish(self) -> None:
        self.arr[self.STOP] = 1
        self.resume()
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in self.pids]
        self.pids = []
        assert codes == [0] * WRITERS, f"writers failed: {codes}"

    def kill(self) -> None:
        for pid in self.pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        self.pids = []


# -- the workspace's other part: changed by the test itself -----------------------------------


def change_static(root: Path, k: int) -> None:
    """A few changes of every kind in a subtree only the test touches, made
    from whatever state it is in (*k*: a number not used before)."""

    def numbered(prefix: str) -> list[Path]:
        return sorted(
            (p for p in root.iterdir() if p.name.startswith(prefix)),
            key=lambda p: int(p.name[len(prefix) :]),
        )

    olds, dirs = numbered("new"), numbered("d")
    (root / f"new{k}").write_text(f"made in step {k}\n")
    with open(root / "log", "a") as f:
        f.write(f"step {k}\n")
    (root / f"d{k}").mkdir()
    (root / f"d{k}" / "inner").write_bytes(os.urandom(70_000))
    for p in olds:
        os.unlink(p)
    if dirs:
        os.rename(dirs[-1], root / f"d{k}" / "moved")
    os.chmod(root / "log", 0o600 + k % 2 * 0o40)
    os.utime(root / f"new{k}", ns=(k * 10**9, k * 10**9))


class Layer:
    """What the test knows of the state a layer was opened on."""

    def __init__(
        self,
        lid: int,
        lo: list[int],
        hi: list[int],
        static: treesnap.Snapshot,
        files: treesnap.Snapshot | None,
    ):
        self.id = lid
        self.lo, self.hi = lo, hi  # each writer's generation lies in lo..hi
        self.static = static
        self.files = files  # the writers' files, exactly (taken with them stopped)


@pytest.fixture
def busy(workspace):
    """A mounted workspace with writer files and a static part; the writers
    (started by the test) are always killed afterwards."""
    make_writer_files(workspace / "writers")
    (workspace / "static").mkdir()
    change_static(workspace / "static", 0)
    workspace.mount()
    writers = Writers(workspace / "writers")
    try:
        yield workspace, writers
    finally:
        writers.kill()


def test_layer_switches_are_atomic_for_concurrent_writers(busy):
    ws, writers = busy
    static = ws / "static"
    rec = MountRecord.load(str(ws.path))
    steps = iter(range(1, 1000))
    targets: dict[int, Layer] = {}  # epoch -> the layer that rollback went back to

    def checkpoint(stopped: bool) -> Layer:
        """A checkpoint while the writers run, or *stopped* (then the state
        it opens the layer on is known exactly)."""
        files = None
        if stopped:
            writers.pause()
            files = treesnap.snapshot(writers.root)
        lo = writers.done
        lid = ws.checkpoint("step")
        hi = writers.started
        layer = Layer(lid, lo, hi, treesnap.snapshot(static), files)
        if stopped:
            writers.resume()
        change_static(static, next(steps))
        writers.wait_beyond(hi)  # every file changes after the checkpoint
        return layer

    def rollback(layer: Layer, stack: list[Layer], stopped: bool = False) -> None:
        """Roll back to *layer* while the writers run (or with them *stopped*
        at whatever point they were); stop them right after it returns and
        check the tree."""
        targets[writers.announce()] = layer
        pre = writers.done
        if stopped:
            writers.pause()
        control.call(rec, "rollback", to=layer.id)
        writers.settle()
        if not stopped:
            writers.pause()
        now = writers.started
        treesnap.assert_same(layer.static, treesnap.snapshot(static))
        if stopped:
            treesnap.assert_same(layer.files, treesnap.snapshot(writers.root))
        else:
            check_writer_files(layer, pre, now)
        del stack[stack.index(layer) :]
        writers.resume()
        change_static(static, next(steps))  # on from the restored state
        writers.wait_beyond(now)

    def check_writer_files(layer: Layer, pre: list[int], now: list[int]) -> None:
        """Each file holds a whole record: the one restored (a generation the
        layer was opened on) unless the writer rewrote it after the rollback
        (a generation begun after the command was sent)."""
        snap = treesnap.snapshot(writers.root)
        for i in range(WRITERS):
            g = file_generation(i, (writers.root / f"w{i}").read_bytes())
            where = f"w{i} after the rollback to layer {layer.id}"
            assert g is not None, f"{where} is torn"
            if g <= pre[i]:  # not written since the rollback: restored
                assert layer.lo[i] <= g <= layer.hi[i], (
                    f"{where} holds generation {g}, not one of {layer.lo[i]}..{layer.hi[i]}"
                )
                if layer.files is not None:
                    name = f"w{i}".encode()
                    assert snap[name] == layer.files[name], f"{where} is not exactly restored"
            else:
                assert g <= now[i], f"{where} holds generation {g}, never started"
        strays = [
            n
            for n in os.listdir(writers.root)
            if not (n.startswith("w") and (n[1:].isdigit() or ".tmp." in n))
        ]
        assert not strays, f"unexpected names: {strays}"

    first = checkpoint(stopped=True)  # before the writers start
    writers.start()
    stack = [first]
    for rnd in range(3):
        a = checkpoint(stopped=True)
        b = checkpoint(stopped=False)
        stack += [a, b]
        ws.commit()  # b merges into a: rolling back to a still works
        stack.remove(b)
        c = checkpoint(stopped=rnd == 1)
        stack.append(c)
        rollback(c, stack)  # the top layer, writers running
        ws.checkpoint("dropped")  # ... and one a rollback --to drops on its way
        rollback(a, stack, stopped=rnd == 2)
    assert stack == [first]
    writers.finish()
    # What the writers saw of each rollback: the generation restored.
    for i in range(WRITERS):
        for epoch, g in writers.observations(i):
            layer = targets.get(epoch)
            assert layer is not None, f"writer {i} saw generation {g} before any rollback"
            assert layer.lo[i] <= g <= layer.hi[i], (
                f"writer {i} saw generation {g} after the rollback to layer {layer.id}, "
                f"not one of {layer.lo[i]}..{layer.hi[i]}"
            )
    ws.rollback(to=first.id)
    treesnap.assert_same(first.files, treesnap.snapshot(writers.root))
    treesnap.assert_same(first.static, treesnap.snapshot(static))


# -- make -j8 ------------------------------------------------------------------------------------


def make_project(root: Path, units: int = 40) -> None:
    """A small C program: a generated header, one unit per function, a main
    that sums them."""
    root.mkdir()
    (root / "gen.sh").write_text(
        '#!/bin/sh\nset -e\nfor i in $(seq 0 $(($1 - 1))); do echo "int f$i(void);"; done\n'
    )
    os.chmod(root / "gen.sh", 0o755)
    for i in range(units):
        (root / f"u{i}.c").write_text(
            '#include "funcs.h"\n'
            f"static int table[] = {{{', '.join(str(i * k) for k in range(50))}}};\n"
            f"int f{i}(void) {{ int s = 0; for (int k = 0; k < 50; k++) s += table[k]; "
            "return s; }\n"
        )
    (root / "main.c").write_text(
        '#include <stdio.h>\n#include "funcs.h"\n'
        "int main(void) { long s = 0;\n"
        + "".join(f"  s += f{i}();\n" for i in range(units))
        + '  printf("%ld\\n", s); return 0; }\n'
    )
    objs = " ".join(f"u{i}.o" for i in range(units))
    (root / "Makefile").write_text(
        f"OBJS = main.o {objs}\n"
        "GO ?= /dev/null\n"
        "prog: $(OBJS) | barrier\n\tcc -o $@ $(OBJS)\n"
        "%.o: %.c funcs.h\n\tcc -O1 -c -o $@ $<\n"
        f"funcs.h: gen.sh\n\t./gen.sh {units} > $@.tmp && mv $@.tmp $@\n"
        "barrier:\n\t@while [ ! -e '$(GO)' ]; do sleep 0.01; done\n"
        "clean:\n\trm -f prog *.o funcs.h\n"
        ".PHONY: barrier clean\n"
    )


def expected_sum(units: int = 40) -> int:
    return sum(i * k for i in range(units) for k in range(50))


def build_while_switching(ws, project: Path, go: Path) -> None:
    """make -j8 while checkpoints and commits come and go.  The link step
    waits for *go*, made after the first switch: at least one falls inside
    the build, whatever the timing."""
    make = subprocess.Popen(
        ["make", "-j8", "-s", f"GO={go}"],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        while make.poll() is None:
            ws.checkpoint("during make")
            ws.commit()
            go.touch()
    finally:
        out, _ = make.communicate(timeout=300)
        go.unlink(missing_ok=True)
    assert make.returncode == 0, out
    run = subprocess.run(["./prog"], cwd=project, capture_output=True, text=True, check=True)
    assert int(run.stdout) == expected_sum()


def test_make_j8_while_checkpointing_and_committing(workspace, tmp_path):
    ws = workspace
    go = tmp_path / "go"
    make_project(ws / "proj")
    ws.mount()
    before = ws.snapshot()
    first = ws.checkpoint("before the build")
    build_while_switching(ws, ws / "proj", go)
    built = ws.snapshot()
    second = ws.checkpoint("built")
    subprocess.run(["make", "-s", "clean"], cwd=ws / "proj", check=True)
    build_while_switching(ws, ws / "proj", go)
    ws.rollback(to=second)
    treesnap.assert_same(built, ws.snapshot())
    ws.rollback(to=first)
    treesnap.assert_same(before, ws.snapshot())
