"""The daemon's memory follows what it must hold, not the size of a layer:
a layer of tens of thousands of new files is listed (`status --json`,
`log`, `rollback --dry-run`) and diffed (`diff --stat`) with the daemon's
peak resident memory (VmHWM, from /proc) growing by a bounded amount per
file.

Measured on the way (200,000 new files in 200 directories, one layer): the
daemon held 216 MiB after making them and peaked at 512 MiB through
`status --json` and 801 MiB through `diff --stat` (now 144, 217 and 310);
what is left per file is mostly the inode table, which follows the
kernel's own cache of the files' entries."""

from __future__ import annotations

import os

from .helpers import managed_workspace

FILES = 20_000  # in directories of 1,000 (about ten seconds through the mount)
# The peak's growth per file made, through the listings and through a diff
# (measured: 2,500 and 4,000 bytes before the journal reading, the capture
# state and the answers were made compact; 1,160 and 1,610 after).
PER_FILE = 1600
PER_FILE_DIFF = 2200


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of process *pid*, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def test_listing_a_layer_of_many_new_files_costs_bounded_memory_per_file(tmp_path):
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
