"""``cowfs doctor``: the machine's FUSE setup and a workspace's mount, daemon
and store, reported as a table or JSON; exit 0 only when all is well."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from cowfs.interface import doctor
from cowfs.interface.doctor import Check, report, run_checks

MACHINE = ["/dev/fuse", "fusermount3", "kernel FUSE", "privileges", "pyfuse3/libfuse", "engine"]
PROVIDERS = ["provider docker", "provider libvirt"]


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_healthy_mounted_workspace(mounted, capsys):
    ws = mounted
    ws.checkpoint("one")
    (ws / "a.txt").write_text("changed\n")

    assert report(str(ws / "dir"), as_json=False) == 0  # any path inside works
    table = capsys.readouterr().out
    for name in MACHINE + ["mount", "daemon", "engine", "store", "free space"] + PROVIDERS:
        assert name in table
    assert "all checks passed" in table
    assert "FAIL" not in table

    assert report(str(ws.path), as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data, list)
    for entry in data:
        assert set(entry) == {"name", "ok", "detail", "hint", "info"}
        assert isinstance(entry["ok"], bool) and isinstance(entry["info"], bool)
        assert isinstance(entry["detail"], str) and isinstance(entry["hint"], str)
    names = [e["name"] for e in data]
    assert names == MACHINE + ["mount", "daemon", "engine", "store", "free space"] + PROVIDERS
    checks = {e["name"]: e for e in data}
    assert all(e["ok"] for e in data)
    assert str(ws.path) in checks["mount"]["detail"]
    assert f"pid {ws.daemon_pid()}" in checks["daemon"]["detail"]
    assert "2 layers (top 2)" in checks["store"]["detail"]
    for name in PROVIDERS:  # informational: present whatever the machine has
        assert checks[name]["info"] and checks[name]["ok"]


def test_dead_daemon_fails_and_is_named(mounted, capsys):
    ws = mounted
    pid = ws.daemon_pid()
    ws.kill()

    assert report(str(ws.path), as_json=False) == 1
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("FAIL"))
    assert "daemon" in line and f"pid {pid}" in line and "dead" in line
    assert f"cowfs mount {ws.path}" in out  # the way out
    assert "failed: daemon" in out

    daemon = by_name(run_checks(str(ws.path)))["daemon"]
    assert not daemon.ok and not daemon.info


def test_unmounted_workspace_checks_its_store(mounted):
    ws = mounted
    ws.checkpoint("one")
    (ws / "new.txt").write_text("x")
    ws.unmount()

    checks = by_name(run_checks(str(ws.path)))
    assert checks["mount"].info and "not mounted" in checks["mount"].detail
    assert checks["store"].ok and not checks["store"].info
    assert "2 layers" in checks["store"].detail and "consistent" in checks["store"].detail
    assert checks["free space"].ok
    assert "daemon" not in checks
    # Doctor's look at the store released its lock: mounting works again.
    ws.mount()
    assert [layer["id"] for layer in ws.log()] == [1, 2]


def test_unmounted_store_problems_fail(mounted):
    ws = mounted
    ws.checkpoint("one")
    os.unlink(ws / "a.txt")  # the whole file moves into the store's grave
    ws.unmount()
    grave = ws / ".cowfs" / "grave"
    entries = os.listdir(grave)
    assert entries
    for name in entries:
        p = grave / name
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()

    store = by_name(run_checks(str(ws.path)))["store"]
    assert not store.ok and "missing" in store.detail
    assert report(str(ws.path), as_json=False) == 1


def test_never_mounted_directory_is_fine(tmp_path):
    checks = by_name(run_checks(str(tmp_path)))
    assert checks["store"].ok and "no store" in checks["store"].detail
    assert not (tmp_path / ".cowfs").exists()


def test_low_free_space_fails(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        check = doctor._space(str(small), "store")
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
    assert not check.ok and "low" in check.detail and "ENOSPC" in check.hint


def test_missing_dev_fuse_fails(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    code = "from cowfs.interface.doctor import report; raise SystemExit(report(None, False))"
    # A private mount namespace with an empty /dev: the host's /dev is untouched.
    script = 'mount -t tmpfs none /dev && exec "$0" -c "$1"'
    r = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, sys.executable, code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert r.returncode == 1, r.stdout + r.stderr
    fail = [line for line in r.stdout.splitlines() if line.startswith("FAIL")]
    assert fail and "/dev/fuse" in fail[0] and "does not exist" in fail[0], r.stdout
    assert "modprobe fuse" in r.stdout
    assert os.path.exists("/dev/fuse")  # the test's own namespace still has it


def test_workspace_mounted_elsewhere_is_found(workspace, tmp_path):
    from cowfs.system.mounts import is_cowfs_mount

    from .helpers import run

    (workspace / "f").write_text("x")
    mp = tmp_path / "mp"
    mp.mkdir()
    run("mount", workspace.path, mp)
    try:
        checks = by_name(run_checks(str(workspace.path)))  # the workspace, not the mount
        assert checks["mount"].ok and str(mp) in checks["mount"].detail
        assert checks["daemon"].ok and checks["store"].ok and checks["free space"].ok
    finally:
        if run("unmount", mp, check=False).returncode != 0 or is_cowfs_mount(str(mp)):
            subprocess.run(["umount", "-l", str(mp)], capture_output=True)


def test_providers_are_informational():
    """Neither provider is configured yet: whatever their state on this
    machine (SDK missing, engine down or up), doctor reports, never fails."""
    for c in (doctor.check_docker(), doctor.check_libvirt()):
        assert c.ok and c.info and c.detail
