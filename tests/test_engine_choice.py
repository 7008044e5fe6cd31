"""Which FUSE engine serves a mount, and what the kernel engine's
negotiation saves: requests the kernel no longer sends (a GETXATTR before
every write, READ/WRITE of files served by passthrough, repeated lookups of
missing names), counted by the engine itself -- while the results stay those
of the pyfuse3 engine."""

from __future__ import annotations

import json
import os
import subprocess

from cowfs.layers import treesnap

from .helpers import COWFS


def engine(ws) -> dict:
    return ws.json("status")["engine"]


def requests(ws) -> dict[str, int]:
    return engine(ws)["requests"]


def test_the_kernel_engine_is_the_default_for_root_and_says_why(workspace):
    workspace.mount()
    info = engine(workspace)
    assert info["name"] == "kernel" and info["why"]
    assert {"killpriv_v2", "passthrough", "readdirplus"} <= set(info["features"])
    assert info["spin_us"] == 50  # (the default)
    doctor = json.loads(workspace.cowfs("--json", "doctor", workspace.path, check=False).stdout)
    detail = {c["name"]: c["detail"] for c in doctor}
    assert detail["engine"].startswith("kernel")


def test_pyfuse3_on_request_by_option_or_environment(workspace):
    workspace.mount("--engine", "pyfuse3")
    assert engine(workspace)["name"] == "pyfuse3"
    assert "chosen" in engine(workspace)["why"]
    workspace.unmount()
    env = dict(os.environ, COWFS_ENGINE="pyfuse3")
    subprocess.run([*COWFS, "mount", str(workspace.path)], env=env, check=True, capture_output=True)
    workspace.mounted = True
    assert engine(workspace)["name"] == "pyfuse3"
    workspace.unmount()
    env["COWFS_ENGINE"] = "turbo"
    r = subprocess.run(
        [*COWFS, "mount", str(workspace.path)], env=env, capture_output=True, text=True
    )
    assert r.returncode == 2 and "COWFS_ENGINE is 'turbo'" in r.stderr


def test_requests_the_kernel_engine_saves_and_the_same_results(workspace):
    (workspace / "existing").write_bytes(b"x" * 100_000)
    workspace.mount("--engine", "kernel")
    before = workspace.snapshot()
    layer = workspace.checkpoint()
    base = requests(workspace)

    fd = os.open(workspace / "existing", os.O_RDWR)  # captured by the daemon
    for i in range(200):
        os.pwrite(fd, b"y" * 512, i * 512)
    os.close(fd)
    with open(workspace / "made", "wb") as f:  # made in the layer: passthrough
        for _ in range(100):
            f.write(b"z" * 4096)
            f.flush()
    for _ in range(50):  # a missing name, looked up again
        assert not os.path.exists(workspace / "missing")
    assert (workspace / "made").read_bytes() == b"z" * 409_600  # passthrough read

    got = requests(workspace)
    grown = {k: got.get(k, 0) - base.get(k, 0) for k in got}
    assert grown.get("getxattr", 0) <= 2, grown  # (not one per write)
    assert grown.get("write", 0) == 200, grown  # only the captured file's
    assert grown.get("read", 0) == 0, grown
    assert grown.get("lookup", 0) <= 5, grown  # (the missing name: once)
    workspace.rollback(to=layer)
    treesnap.assert_same(before, workspace.snapshot())


def test_small_files_are_read_through_the_page_cache_large_ones_by_passthrough(workspace):
    """A small file opened for reading is served through the page cache kept
    between opens (no READ once cached, and no GETATTR at each stat, which
    the kernel sends after every passthrough read); a large one by
    passthrough (no READ at all).  Both read back right after a rollback."""
    small, large = b"s" * 4096, bytes(range(256)) * 4096  # 4 KiB, 1 MiB
    (workspace / "small").write_bytes(small)
    (workspace / "large").write_bytes(large)
    workspace.mount("--engine", "kernel")
    assert (workspace / "small").read_bytes() == small  # (now cached)
    os.stat(workspace / "small")
    base = requests(workspace)
    for _ in range(20):
        assert (workspace / "small").read_bytes() == small
        os.stat(workspace / "small")
    got = requests(workspace)
    grown = {k: got.get(k, 0) - base.get(k, 0) for k in got}
    assert grown.get("read", 0) == 0 and grown.get("getattr", 0) <= 1, grown
    for _ in range(5):
        assert (workspace / "large").read_bytes() == large
    assert requests(workspace).get("read", 0) == got.get("read", 0)  # passthrough
    layer = workspace.checkpoint()
    (workspace / "small").write_bytes(b"changed")
    (workspace / "large").write_bytes(b"changed")
    workspace.rollback(to=layer)
    assert (workspace / "small").read_bytes() == small  # not the cached pages
    assert (workspace / "large").read_bytes() == large


def test_setuid_is_cleared_by_the_daemon_as_ext4_clears_it(workspace, tmp_path):
    """With HANDLE_KILLPRIV_V2 the kernel leaves clearing setuid/setgid on a
    write by an unprivileged user to the daemon; a rollback puts them back."""
    native = tmp_path / "native"
    native.mkdir()
    for d in (native, workspace.path):
        for name, mode in (("suid", 0o4777), ("sgid-x", 0o2777), ("sgid-nox", 0o2766)):
            p = d / name
            p.write_bytes(b"0123")
            os.chown(p, 1234, 1234)
            os.chmod(p, mode)
    workspace.mount("--engine", "kernel")
    before = workspace.snapshot()
    layer = workspace.checkpoint()
    modes = {}
    for d in (native, workspace.path):
        subprocess.run(
            [
                "setpriv",
                "--reuid=4321",
                "--regid=4321",
                "--clear-groups",
                "sh",
                "-c",
                "for n in suid sgid-x sgid-nox; do "
                "printf x | dd of=$n conv=notrunc status=none; done",
            ],
            cwd=d,
            check=True,
        )
        modes[d] = {n: oct(os.stat(d / n).st_mode) for n in ("suid", "sgid-x", "sgid-nox")}
    assert modes[workspace.path] == modes[native]
    assert modes[native]["suid"] == oct(0o100777)  # (the kernel's rule, natively)
    workspace.rollback(to=layer)
    treesnap.assert_same(before, workspace.snapshot())


def test_a_passthrough_writer_across_checkpoints_is_undone_exactly(workspace):
    """A file made in the open layer and written through passthrough (its
    writes never reach the daemon) stays open across checkpoints: each
    checkpoint captures it whole, so every layer still rolls back to its
    start exactly -- and a reader opening it meanwhile does not break it."""
    workspace.mount("--engine", "kernel")
    first = workspace.checkpoint("made")
    fd = os.open(workspace / "log", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"A" * 70_000)
        at_second = workspace.snapshot()
        second = workspace.checkpoint("more")
        os.pwrite(fd, b"B" * 1000, 65_000)  # across a chunk boundary
        os.write(fd, b"C" * 5000)  # and past the old end
        assert (workspace / "log").read_bytes()[65_000:66_000] == b"B" * 1000
        at_third = workspace.snapshot()
        workspace.checkpoint("yet more")
        os.ftruncate(fd, 10)
        grown = requests(workspace)
        assert grown.get("write", 0) == 0, grown  # (all through passthrough)
        workspace.rollback()
        treesnap.assert_same(at_third, workspace.snapshot())
        workspace.rollback(to=second)
        treesnap.assert_same(at_second, workspace.snapshot())
        os.write(fd, b"D")  # the fd still works
    finally:
        os.close(fd)
    workspace.rollback(to=first)
    assert not (workspace / "log").exists()


def test_copy_file_range_is_answered_in_64_bits_and_captured(workspace):
    """Linux 6.18 sends COPY_FILE_RANGE_64 first (and falls back to the
    32-bit COPY_FILE_RANGE for good if it is refused): the engine serves
    it, counted by kind, and captures what the copy overwrites before it
    does -- across chunks, past the old end, within one file -- so a
    rollback restores the destination exactly."""
    src, old = os.urandom(300_000), os.urandom(200_000)
    (workspace / "src").write_bytes(src)
    (workspace / "dst").write_bytes(old)
    workspace.mount("--engine", "kernel")
    before = workspace.snapshot()
    layer = workspace.checkpoint()
    base = requests(workspace)
    fd_in = os.open(workspace / "src", os.O_RDONLY)
    fd_out = os.open(workspace / "dst", os.O_RDWR)
    try:
        assert os.copy_file_range(fd_in, fd_out, 250_000, 10_000, 100_000) == 250_000
        assert os.copy_file_range(fd_out, fd_out, 50_000, 0, 400_000) == 50_000
        assert os.copy_file_range(fd_in, fd_out, 10, 300_000, 0) == 0  # (past the end)
    finally:
        os.close(fd_in)
        os.close(fd_out)
    copied = old[:100_000] + src[10_000:260_000]
    want = copied + bytes(50_000) + copied[:50_000]
    assert (workspace / "dst").read_bytes() == want
    assert os.stat(workspace / "dst").st_size == 450_000
    got = requests(workspace)
    grown = {k: got.get(k, 0) - base.get(k, 0) for k in got}
    assert grown.get("copy_file_range_64") == 2, grown  # (the VFS answers the third)
    assert "copy_file_range" not in grown and "53" not in grown, grown
    workspace.rollback(to=layer)
    treesnap.assert_same(before, workspace.snapshot())
    assert (workspace / "dst").read_bytes() == old
