"""The systemd template unit systemd/cowfs@.service: it verifies, and its
ExecStart behaves as Type=notify promises (READY=1 only once the mount is
live; SIGTERM unmounts cleanly and exits 0)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from .helpers import plain

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "cowfs@.service"
INSTALLED_COWFS = "/usr/local/bin/cowfs"
VENV_COWFS = Path(sys.executable).parent / "cowfs"


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (in order), with continuation lines joined."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip() if pending else raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path}: malformed line {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def exec_start(workspace: Path) -> list[str]:
    """The unit's ExecStart as argv: %f is the workspace, and the installed
    /usr/local/bin/cowfs is this venv's cowfs."""
    (value,) = parse_unit(UNIT)["Service"]["ExecStart"]
    argv = shlex.split(value.lstrip("-@:+!"))
    assert argv[0] == INSTALLED_COWFS
    argv[0] = str(VENV_COWFS)
    out = []
    for arg in argv:
        arg = arg.replace("%f", str(workspace))
        assert "%" not in arg, f"unexpected specifier in ExecStart: {arg!r}"
        out.append(arg)
    return out


def mount_fstype(path: Path) -> str | None:
    """The fstype of the topmost mount at *path*, from /proc/self/mountinfo."""
    fstype = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            mp = (
                left.split(" ")[4]
                .replace("\\040", " ")
                .replace("\\011", "\t")
                .replace("\\012", "\n")
                .replace("\\134", "\\")
            )
            if mp == str(path):
                fstype = right.split(" ")[0]
    return fstype


# -- the unit file ------------------------------------------------------------------


def test_unit_declares_notify_and_clean_stop():
    unit = parse_unit(UNIT)
    svc = unit["Service"]
    assert svc["Type"] == ["notify"]
    assert svc["Restart"] == ["on-failure"]
    assert svc["ExecStart"][0].split()[:3] == [INSTALLED_COWFS, "mount", "--foreground"]
    assert svc["ExecStart"][0].split()[-1] == "%f"
    assert svc.get("KillSignal", ["SIGTERM"]) == ["SIGTERM"]
    assert "TimeoutStopSec" in svc
    # Options that give the service its own mount namespace would hide the
    # FUSE mount from everybody else.
    for key in (
        "PrivateTmp",
        "ProtectSystem",
        "ProtectHome",
        "PrivateDevices",
        "ReadOnlyPaths",
        "ReadWritePaths",
        "InaccessiblePaths",
        "TemporaryFileSystem",
        "BindPaths",
        "BindReadOnlyPaths",
        "RootDirectory",
        "MountFlags",
        "PrivateMounts",
    ):
        assert key not in svc, f"{key}= would put the mount in a private namespace"
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    assert "tools/install (as root)" in UNIT.read_text()
    assert "ln -s /path/to/repo/.venv/bin/cowfs /usr/local/bin/cowfs" in UNIT.read_text()


def test_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package 'systemd')")
    assert VENV_COWFS.exists()
    # A temporary copy whose ExecStart names the venv's cowfs, since
    # /usr/local/bin/cowfs need not exist here.  Verify the template through
    # an instance, as systemd would load it.
    text = UNIT.read_text().replace(INSTALLED_COWFS, str(VENV_COWFS))
    (tmp_path / "cowfs@.service").write_text(text)
    os.symlink("cowfs@.service", tmp_path / "cowfs@srv-project.service")
    for name in ("cowfs@.service", "cowfs@srv-project.service"):
        r = subprocess.run(
            [analyze, "verify", "--man=no", str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        if r.returncode != 0 and "Failed to " in r.stderr and "cowfs" not in r.stderr:
            pytest.skip(f"systemd-analyze cannot run here: {r.stderr.strip()}")
        complaints = [line for line in (r.stdout + r.stderr).splitlines() if "cowfs" in line]
        assert r.returncode == 0 and not complaints, (
            f"systemd-analyze verify {name} (exit {r.returncode}):\n{r.stdout}{r.stderr}"
        )


def test_systemd_escape_names_the_workspace():
    escape = shutil.which("systemd-escape")
    if escape is None:
        pytest.skip("systemd-escape is not installed (Debian package 'systemd')")
    name = subprocess.run(
        [escape, "--path", "--template=cowfs@.service", "/srv/my project"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert name == r"cowfs@srv-my\x20project.service"
    back = subprocess.run(
        [escape, "--unescape", "--path", name[len("cowfs@") : -len(".service")]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert back == "/srv/my project"


# -- ExecStart under a notify socket -------------------------------------------------------


@pytest.fixture
def notify_socket():
    """An AF_UNIX datagram socket standing in for systemd's NOTIFY_SOCKET
    (in a short /tmp directory: socket paths are limited to 108 bytes)."""
    d = tempfile.mkdtemp(prefix="cowfs-notify-")
    path = os.path.join(d, "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    try:
        yield s, path
    finally:
        s.close()
        shutil.rmtree(d, ignore_errors=True)


def receive(sock: socket.socket, proc: subprocess.Popen, timeout: float, logs: Path) -> dict:
    """The next notification, parsed into a dict; fails if the process exits
    first or nothing arrives in time."""
    deadline = time.monotonic() + timeout
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            if proc.poll() is not None:
                pytest.fail(
                    f"daemon exited {proc.returncode} before notifying:\n"
                    f"{logs.read_text(errors='replace')}"
                )
            continue
        return dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
    pytest.fail(f"no notification within {timeout}s:\n{logs.read_text(errors='replace')}")


def test_exec_start_notifies_ready_when_mounted_and_unmounts_on_sigterm(
    workspace, notify_socket, tmp_path
):
    sock, sock_path = notify_socket
    (workspace / "before.txt").write_text("here before the mount\n")
    argv = exec_start(workspace.path)
    logs = tmp_path / "daemon.out"
    env = {**os.environ, "NOTIFY_SOCKET": sock_path}
    with open(logs, "wb") as out:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        msg = receive(sock, proc, 120, logs)
        # Checked at once: READY=1 must not arrive before the mount is live.
        fstype = mount_fstype(workspace.path)
        assert msg.get("READY") == "1", msg
        assert fstype == "fuse.cowfs", f"READY=1 arrived but {workspace.path} is {fstype}"
        assert msg.get("MAINPID") == str(proc.pid)
        assert str(workspace.path) in msg.get("STATUS", "")
        workspace.mounted = True

        ls = subprocess.run(
            ["ls", "-A", str(workspace.path)], capture_output=True, text=True, timeout=30
        )
        assert ls.returncode == 0, ls.stderr
        assert ls.stdout.split() == ["before.txt"]  # the store stays hidden
        (workspace / "during.txt").write_text("written through the mount\n")
        assert plain(workspace.status()) == [{"path": "during.txt", "kind": "A"}]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, logs.read_text(errors="replace")
        assert mount_fstype(workspace.path) != "fuse.cowfs"
        workspace.mounted = False
        sock.settimeout(5)
        assert b"STOPPING=1" in sock.recv(65536)
        # The backing directory kept the change; the store survived for the
        # next mount.
        assert (workspace / "during.txt").read_text() == "written through the mount\n"
        assert (workspace / ".cowfs" / "db").is_dir()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
