"""The daemon's memory follows what it must hold, not the size of a layer:
a layer of tens of thousands of new files is listed (`status --json`,
`log`, `rollback --dry-run`) and diffed (`diff --stat`) with the daemon's
peak resident memory (VmHWM, from /proc) growing by a bounded amount per
file.

Measured on the way (200,000 new files in 200 directories, one layer): the
daemon held 216 MiB after making them and peaked at 512 MiB through
`status --json` and 801 MiB through `diff --stat` (then 151, 214 and 288;
now see README.md); what is left per file is mostly the inode table, which
follows the kernel's own cache of the files' entries."""

from __future__ import annotations

import os
import random
import tracemalloc

from cowfs.layers.listing import Changes
from cowfs.storage import schema as S
from cowfs.storage.journal import Reading
from cowfs.storage.store import Store

from .helpers import managed_workspace

FILES = 20_000  # in directories of 1,000 (about ten seconds through the mount)
# The peak's growth per file made, through the listings and through a diff
# (measured: 2,500 and 4,000 bytes before the journal reading, the capture
# state and the answers were made compact; 1,160 and 1,640 after; 930 and
# 1,350 with one inode mapping, smaller nodes, new files held as names in a
# reading, changes in columns and the journal read a batch at a time).
PER_FILE = 1080
PER_FILE_DIFF = 1520


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of process *pid*, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def test_listing_a_layer_of_many_new_files_costs_bounded_memory_per_file(tmp_path, fuse):
    with managed_workspace(tmp_path / "ws") as ws:
        ws.mount()
        pid = ws.daemon_pid()
        assert pid is not None
        ws.status()  # (what the first request loads is not the layer's)
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # (the peak starts again from now)
        before = memory(pid)["VmRSS"]
        for d in range(FILES // 1000):
            os.mkdir(ws / f"d{d:03d}")
            for i in range(1000):
                os.close(os.open(ws / f"d{d:03d}" / f"f{i:04d}", os.O_CREAT | os.O_WRONLY, 0o644))
        changes = ws.status()
        assert len(changes) == FILES + FILES // 1000
        assert {c["kind"] for c in changes} == {"A"}
        assert ws.json("log")[-1]["changes"] == len(changes)
        assert len(ws.json("rollback", "--dry-run")["changes"]) == len(changes)
        listed = memory(pid)["VmHWM"]
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        assert len(ws.cowfs("diff", "--stat").stdout.splitlines()) == len(changes)
        diffed = memory(pid)["VmHWM"]
        n = FILES + FILES // 1000
        said = (
            f"the daemon's peak grew by {(listed - before) / n:,.0f} bytes a file listing them, "
            f"{(diffed - before) / n:,.0f} diffing them ({before >> 20} MiB before, "
            f"{listed >> 20} and {diffed >> 20} MiB at the peaks)"
        )
        assert listed - before <= PER_FILE * n, said
        assert diffed - before <= PER_FILE_DIFF * n, said


def test_capture_state_forgotten_is_read_back_and_nothing_is_captured_twice(workspace, monkeypatch):
    """With the capture state of at most 8 objects in memory (it keeps that
    of 32,768), changing 60 objects again after it forgot them records
    nothing more, a new chunk of each is still captured, and the rollback
    gives every byte and mode back."""
    monkeypatch.setenv("COWFS_CAPTURE_KEEP", "8")  # (the daemon inherits it)
    files = 30
    size = 3 * (64 << 10) + 100
    for i in range(files):
        (workspace / f"f{i:02d}").write_bytes(bytes([i]) * size)
    workspace.mount()
    before = workspace.snapshot()
    layer = workspace.checkpoint("many")

    def records() -> int:
        return next(x for x in workspace.json("log") if x["id"] == layer)["records"]

    def change(data: bytes, at: int) -> None:
        for i in range(files):
            with open(workspace / f"f{i:02d}", "r+b") as f:
                f.seek(at)
                f.write(data)
            os.chmod(workspace / f"f{i:02d}", 0o600 if data == b"a" else 0o640)
            with open(workspace / f"n{i:02d}", "ab") as f:
                f.write(data)

    change(b"a", 0)
    first = records()
    change(b"b", 10)  # (the same chunk, mode and new files: all captured already)
    assert records() == first
    change(b"c", size - 1)  # (another chunk of each: captured)
    assert records() == first + files
    workspace.rollback()
    assert workspace.snapshot() == before


# -- the daemon's pieces, measured in-process (tracemalloc: the bytes Python
# allocated, the same on every run) -----------------------------------------------

DIRS, PER_DIR = 20, 1000


def new_files() -> list[tuple[int, S.Record]]:
    """The records of DIRS directories of PER_DIR new files each, in order."""
    records: list[S.Record] = []
    for d in range(DIRS):
        records.append(S.Create(b"d%03d" % d))
        records += [S.Create(b"d%03d/f%04d" % (d, i)) for i in range(PER_DIR)]
    return list(enumerate(records))


def traced(make):
    """What *make*() returns, the bytes it holds and the peak on the way."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = make()
        now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, now - before, peak - before


def test_a_reading_of_a_layer_of_new_files_holds_little_per_file():
    """A new file is a name in its directory's table of the reading (not an
    object of its own: 170 bytes a file before, some 75 now)."""
    records = new_files()
    j, held, _ = traced(lambda: Reading(records, 1 << 16))
    n = len(records)
    assert held <= 110 * n, f"the reading holds {held / n:,.0f} bytes a new file"
    assert sorted(j.created()) == sorted(rec.path for _, rec in records)
    j.names.move(b"d001", b"e")  # (a directory of them moved: followed)
    j.names.remove(b"d002/f0007")
    assert b"e/f0003" in set(j.created()) and b"d002/f0007" not in set(j.created())
    assert len(list(j.created())) == n - 1


def test_changes_are_held_in_columns():
    """A listed new file is some 30 bytes and its name, held once by the
    reading and the listing (a tuple of 170 bytes and its path before)."""
    n = DIRS * PER_DIR
    who = {"pid": 1, "uid": 0, "cmd": "touch"}
    names = [b"f%04d" % i for i in range(PER_DIR)]  # (a reading's)

    def make() -> Changes:
        c = Changes()
        for d in range(DIRS):
            head = c.parent(b"d%03d" % d)
            for i, name in enumerate(names):
                c.append_in(head, name, "A", None, False, 10_000 + d * PER_DIR + i, who)
        return c

    changes, held, _ = traced(make)
    assert held <= 45 * n, f"the changes hold {held / n:,.0f} bytes a change"
    assert changes[5] == {"path": "d000/f0005", "kind": "A", "who": who}
    assert changes.row(5) == (b"d000/f0005", "A", None, False, 10_005, who)


def test_changes_are_sorted_by_path_as_one_list_of_paths_would_be():
    """Sorted a directory's run at a time, then merged: the order of the
    whole paths ('a-c/d' before 'a/b'; the root as '.'), stable."""
    rnd = random.Random(0)
    paths = [b"", b"a", b"a-c", b"a.b", b"a/b", b"a/b/c", b"a-c/d", b"a/z", b"b", b"z"]
    for _ in range(500):
        c, want = Changes(), []
        for _ in range(rnd.randint(0, 5)):
            if rnd.random() < 0.4:  # (whole paths: deletions, renames, ...)
                for _ in range(rnd.randint(1, 4)):
                    p, kind = rnd.choice(paths), rnd.choice("ADMR")
                    was = b"old/" + p if kind == "R" else None
                    c.append(p, kind, was, False, rnd.randint(1, 9))
                    want.append((p, kind, was))
            else:  # (new files in a directory)
                d = rnd.choice([b"", b"a", b"a-c", b"a/b", b"b"])
                head = c.parent(d)
                for _ in range(rnd.randint(1, 4)):
                    name = rnd.choice([b"a", b"b", b"c", b"z", b"a-c"])
                    c.append_in(head, name, "A", None, False, 5)
                    want.append((d + b"/" + name if d else name, "A", None))
        want.sort(key=lambda r: r[0] or b".")
        c.sort()
        assert [c.row(i)[:3] for i in range(len(c))] == want


def test_the_journal_is_read_a_batch_at_a_time(tmp_path):
    """Reading a layer's records never holds them all decoded at once (it
    held some 190 bytes a record)."""
    ws = tmp_path / "ws"
    ws.mkdir()
    store = Store.open(str(tmp_path / "store"), str(ws))
    try:
        start = store.next_seq
        with store.write() as w:
            for _, rec in new_files():
                w.record(rec)
        end = store.next_seq

        def read() -> int:
            return sum(1 for _ in store.records(start, end))

        count, _, peak = traced(read)
        assert count == end - start
        assert peak <= 80 * count, (
            f"reading the journal peaked at {peak / count:,.0f} bytes a record"
        )
        back = [seq for seq, _ in store.records(start, end, reverse=True)]
        assert back == list(range(end - 1, start - 1, -1))
    finally:
        store.close()
