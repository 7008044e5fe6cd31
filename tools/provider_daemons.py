"""Real container and VM daemons for tests and benchmarks: dockerd and libvirtd.

Shared by the test suite (its fixtures, in ``tests/provider_daemons.py``) and
``tools/bench`` (the provider benchmarks), which does not import the tests.

Nothing here installs anything: the Debian and pip packages come from
``tools/bootstrap``. What this module does at run time is start the daemons
when they are not running (idempotently, in the background, detached from the
test process so that later runs reuse them), build a tiny local image and a
tiny VM, and clean up what it made.

Everything it creates is named with ``PREFIX`` ("cowfs-test-"; images live
under the repository ``cowfs-test/``) and labelled ``LABEL``, and the cleanup
helpers remove exactly that. ``tools/bench`` makes its image and domains under
names and a label of its own (the ``label`` and ``prefix`` arguments), so a
test session's cleanup leaves a benchmark running alongside alone.

``DaemonUnavailable`` says a provider's daemon cannot run on this machine, with the
reason (the test fixtures turn it into a skip, or a failure when the provider
is required).

Logs of daemons started here go to ``LOG_DIR`` (``/tmp/cowfs-daemons`` unless
``COWFS_DAEMONS_DIR`` says otherwise).
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import io
import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

PREFIX = "cowfs-test-"
IMAGE_REPO_PREFIX = "cowfs-test/"
LABEL = "org.cowfs.test"
BUSYBOX_TAG = "cowfs-test/busybox:1"
LOG_DIR = Path(os.environ.get("COWFS_DAEMONS_DIR", "/tmp/cowfs-daemons"))
DAEMON_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class DaemonUnavailable(RuntimeError):
    """The daemon cannot run on this machine; ``str()`` is the reason."""


def unique_name(what: str = "") -> str:
    """A fresh name with the cleanup prefix, e.g. ``cowfs-test-vm-1a2b3c4d``."""
    return f"{PREFIX}{what + '-' if what else ''}{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------
# shared plumbing
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _lock(name: str) -> Iterator[None]:
    """Serialise daemon start-up between concurrent test processes."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOG_DIR / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _socket_accepts(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _find(binary: str) -> str | None:
    return shutil.which(binary) or shutil.which(binary, path=DAEMON_PATH)


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    """Start a daemon in its own session, detached from the test process, so
    it outlives this run (later runs reuse it) and no test's signal reaches it."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PATH"] = env.get("PATH", "") + ":" + DAEMON_PATH
    with open(log, "ab") as out:
        out.write(f"\n==== {time.strftime('%F %T')} {' '.join(argv)}\n".encode())
        out.flush()
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            close_fds=True,
            start_new_session=True,
        )


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def _pidfile_alive(path: str) -> bool:
    try:
        pid = int(Path(path).read_text().strip())
        os.kill(pid, 0)
        return True
    except (OSError, ValueError):
        return False


def _need_root(name: str) -> None:
    if os.geteuid() != 0:
        raise DaemonUnavailable(
            f"{name}: starting the daemon needs root (running as uid {os.geteuid()})"
        )


# --------------------------------------------------------------------------
# docker
# --------------------------------------------------------------------------

DOCKER_SOCK = "/var/run/docker.sock"
# Tried in order when dockerd is not running. The first is Debian's default
# (overlay2, docker0 bridge, iptables rules) and works on this project's
# machines; the second is for hosts without iptables/bridge/overlay support
# (containers there only get network_mode "none"/"host"). COWFS_DOCKERD_FLAGS
# replaces both with one explicit set.
DOCKERD_FLAG_SETS: list[list[str]] = [
    [],
    ["--iptables=false", "--ip6tables=false", "--bridge=none", "--storage-driver=vfs"],
]


def _docker_client(base_url: str | None = None):
    import docker

    if base_url:
        return docker.DockerClient(base_url=base_url, version="auto", timeout=120)
    return docker.from_env(version="auto", timeout=120)


def _docker_ping(base_url: str | None = None):
    try:
        c = _docker_client(base_url)
        c.ping()
        return c
    except Exception:  # noqa: BLE001 - any failure means "not up yet"
        return None


def ensure_docker(timeout: float = 60.0):
    """A ``docker.DockerClient`` connected to a running dockerd, starting one
    in the background if none is running. Idempotent.

    With ``DOCKER_HOST`` set, that daemon is used as it is (never started).
    Raises ``DaemonUnavailable`` when docker cannot run here.
    """
    try:
        import docker  # noqa: F401
    except ImportError:
        raise DaemonUnavailable(
            "docker: the Python package 'docker' is not installed (pip install docker)"
        ) from None
    if os.environ.get("DOCKER_HOST"):
        c = _docker_ping()
        if c is None:
            raise DaemonUnavailable(
                f"docker: DOCKER_HOST={os.environ['DOCKER_HOST']} does not answer"
            )
        return c
    if _socket_accepts(DOCKER_SOCK) and (c := _docker_ping(f"unix://{DOCKER_SOCK}")):
        return c
    dockerd = _find("dockerd")
    if dockerd is None:
        raise DaemonUnavailable("docker: dockerd is not installed (Debian package docker.io)")
    for helper in ("containerd", "runc"):
        if _find(helper) is None:
            raise DaemonUnavailable(
                f"docker: {helper} is not installed (Debian package "
                f"{helper}, a dependency of docker.io)"
            )
    _need_root("docker")
    log = LOG_DIR / "dockerd.log"
    with _lock("docker"):
        if _socket_accepts(DOCKER_SOCK) and (c := _docker_ping(f"unix://{DOCKER_SOCK}")):
            return c
        if _pidfile_alive("/var/run/docker.pid"):  # started elsewhere, still coming up
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and _pidfile_alive("/var/run/docker.pid"):
                if c := _docker_ping(f"unix://{DOCKER_SOCK}"):
                    return c
                time.sleep(0.25)
            if _pidfile_alive("/var/run/docker.pid"):
                raise DaemonUnavailable(
                    f"docker: a dockerd is running but does not answer on "
                    f"{DOCKER_SOCK} within {timeout:.0f}s"
                )
        env_flags = os.environ.get("COWFS_DOCKERD_FLAGS")
        flag_sets = [env_flags.split()] if env_flags is not None else DOCKERD_FLAG_SETS
        failures = []
        for flags in flag_sets:
            proc = _spawn([dockerd, *flags], log)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                if _socket_accepts(DOCKER_SOCK) and (c := _docker_ping(f"unix://{DOCKER_SOCK}")):
                    return c
                time.sleep(0.25)
            if proc.poll() is None:  # hung: stop the one we started, by its pid
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                failures.append(
                    f"dockerd {' '.join(flags) or '(defaults)'}: no answer on "
                    f"{DOCKER_SOCK} within {timeout:.0f}s"
                )
            else:
                failures.append(
                    f"dockerd {' '.join(flags) or '(defaults)'}: exited {proc.returncode}"
                )
        raise DaemonUnavailable(
            "docker: dockerd could not be started: "
            + "; ".join(failures)
            + f"\nlast lines of {log}:\n{_tail(log)}"
        )


def docker_cli() -> str:
    """Path of the ``docker`` command-line client, or ``DaemonUnavailable``."""
    path = _find("docker")
    if path is None:
        raise DaemonUnavailable(
            "docker: the docker CLI is not installed (Debian package docker.io)"
        )
    return path


def _is_static_elf(path: str) -> bool:
    """True for an ELF executable without a program interpreter (PT_INTERP)."""
    import struct

    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:  # ELF, 64-bit
            return False
        end = "<" if head[5] == 1 else ">"
        (phoff,) = struct.unpack_from(end + "Q", head, 0x20)
        phentsize, phnum = struct.unpack_from(end + "HH", head, 0x36)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            (p_type,) = struct.unpack(end + "I", f.read(4))
            if p_type == 3:  # PT_INTERP
                return False
    return True


def find_static_busybox() -> str:
    for cand in (os.environ.get("COWFS_BUSYBOX"), "/bin/busybox", "/usr/bin/busybox"):
        if cand and os.path.exists(cand) and _is_static_elf(cand):
            return cand
    raise DaemonUnavailable(
        "docker: no statically linked busybox for the test image "
        "(Debian package busybox-static provides /bin/busybox)"
    )


def busybox_rootfs_tar(busybox: str | None = None) -> bytes:
    """A tar of a minimal root file system: /bin/busybox with a symlink per
    applet (/bin/sh among them), /usr/local/bin, /tmp, /root, a minimal
    /etc/passwd and /etc/group. All entries owned by root."""
    busybox = busybox or find_static_busybox()
    applets = subprocess.run(
        [busybox, "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    buf = io.BytesIO()
    now = int(time.time())

    def add(name, kind=tarfile.DIRTYPE, mode=0o755, data=b"", link=""):
        ti = tarfile.TarInfo(name)
        ti.type, ti.mode, ti.mtime, ti.uid, ti.gid = kind, mode, now, 0, 0
        ti.uname = ti.gname = "root"
        if kind == tarfile.SYMTYPE:
            ti.linkname = link
        ti.size = len(data) if kind == tarfile.REGTYPE else 0
        tar.addfile(ti, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in (
            "bin",
            "dev",
            "etc",
            "proc",
            "sys",
            "root",
            "usr",
            "usr/bin",
            "usr/local",
            "usr/local/bin",
            "var",
            "work",
        ):
            add(d, mode=0o700 if d == "root" else 0o755)
        add("tmp", mode=0o1777)
        add("bin/busybox", tarfile.REGTYPE, 0o755, Path(busybox).read_bytes())
        for a in sorted(set(applets) - {"busybox"}):
            add(f"bin/{a}", tarfile.SYMTYPE, 0o777, link="busybox")
        add(
            "etc/passwd",
            tarfile.REGTYPE,
            0o644,
            b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        )
        add("etc/group", tarfile.REGTYPE, 0o644, b"root:x:0:\nnogroup:x:65534:\n")
    return buf.getvalue()


def busybox_image(client, tag: str = BUSYBOX_TAG, label: str = LABEL) -> str:
    """Tag of a local busybox image labelled ``label``, built once by
    importing ``busybox_rootfs_tar()`` (the equivalent of ``docker import``);
    reused when present. Nothing is pulled."""
    import docker

    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    repo, _, version = tag.rpartition(":")
    if not repo or "/" in version:
        repo, version = tag, "latest"
    with _lock("busybox-image"):
        try:
            client.images.get(tag)
            return tag
        except docker.errors.ImageNotFound:
            pass
        client.api.import_image_from_data(
            busybox_rootfs_tar(),
            repository=repo,
            tag=version,
            changes=[
                f"LABEL {label}=1",
                "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                'CMD ["/bin/sh"]',
            ],
        )
        client.images.get(tag)  # raises if the import did not produce it
    return tag


def cleanup_docker(client, prefix: str = PREFIX, keep_base: bool = False) -> list[str]:
    """Remove the containers named ``prefix*`` or labelled ``LABEL``, then the
    images tagged ``cowfs-test/...``/``prefix...`` or labelled ``LABEL``
    (``keep_base`` keeps ``BUSYBOX_TAG``). Returns what it removed."""
    import docker

    removed = []
    for c in client.containers.list(all=True):
        if c.name.startswith(prefix) or LABEL in (c.labels or {}):
            with contextlib.suppress(docker.errors.NotFound):
                c.remove(force=True, v=True)
                removed.append(f"container {c.name}")

    def ours(img) -> bool:
        return LABEL in (img.labels or {}) or any(
            t.startswith((IMAGE_REPO_PREFIX, prefix)) for t in img.tags
        )

    # Children before parents (a commit's parent is the image it came from):
    # retry until a pass removes nothing.
    for _ in range(10):
        progress = False
        imgs = [i for i in client.images.list(all=True) if ours(i)]
        imgs.sort(key=lambda i: i.attrs.get("Created", ""), reverse=True)
        for img in imgs:
            if keep_base and BUSYBOX_TAG in img.tags:
                continue
            try:
                for t in img.tags:
                    client.images.remove(t, noprune=False)
                if not img.tags:
                    client.images.remove(img.id, noprune=False)
                removed.append(f"image {img.tags or img.short_id}")
                progress = True
            except docker.errors.NotFound:
                progress = True
            except docker.errors.APIError:
                continue  # still has children; next pass
        if not progress:
            break
    return removed


# --------------------------------------------------------------------------
# libvirt
# --------------------------------------------------------------------------

LIBVIRT_URI = "qemu:///system"
LIBVIRT_SOCK = "/run/libvirt/libvirt-sock"
VIRTLOGD_SOCK = "/run/libvirt/virtlogd-sock"
QEMU_USER = QEMU_GROUP = "libvirt-qemu"  # Debian's build-time default in qemu.conf


def _quiet_libvirt():
    import libvirt

    # libvirt prints every error to stderr by default; exceptions carry them.
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    return libvirt


def _libvirt_open(uri: str):
    libvirt = _quiet_libvirt()
    try:
        return libvirt.open(uri)
    except libvirt.libvirtError:
        return None


def _ensure_qemu_account() -> None:
    """The qemu driver refuses to load unless its user and group exist
    (libvirt-daemon-system's postinst makes them; plain libvirt-daemon does
    not). Also give the kvm group read/write on /dev/kvm, as Debian's udev
    rule does, so domains of type kvm work when qemu runs as libvirt-qemu."""

    def has_group(g):
        try:
            grp.getgrnam(g)
            return True
        except KeyError:
            return False

    for g in ("kvm", QEMU_GROUP):
        if not has_group(g):
            subprocess.run(["groupadd", "--system", g], check=True, capture_output=True)
    try:
        pwd.getpwnam(QEMU_USER)
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--system",
                "--gid",
                QEMU_GROUP,
                "--groups",
                "kvm",
                "--home-dir",
                "/var/lib/libvirt",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                "--comment",
                "Libvirt Qemu",
                QEMU_USER,
            ],
            check=True,
            capture_output=True,
        )
    if os.path.exists("/dev/kvm"):
        st = os.stat("/dev/kvm")
        kvm_gid = grp.getgrnam("kvm").gr_gid
        if st.st_gid != kvm_gid or (st.st_mode & 0o060) != 0o060:
            os.chown("/dev/kvm", -1, kvm_gid)
            os.chmod("/dev/kvm", stat.S_IMODE(st.st_mode) | 0o660)


def ensure_libvirt(uri: str = LIBVIRT_URI, timeout: float = 60.0):
    """A ``libvirt.virConnect`` to ``qemu:///system``, starting virtlogd and
    libvirtd in the background when they are not running. Idempotent.
    Raises ``DaemonUnavailable`` when libvirt/qemu cannot run here."""
    try:
        _quiet_libvirt()
    except ImportError:
        raise DaemonUnavailable(
            "libvirt: the Python package 'libvirt-python' is not "
            "installed (pip install libvirt-python; it builds "
            "against Debian's libvirt-dev)"
        ) from None
    if os.geteuid() == 0:
        # Also when libvirtd already runs: with /dev/kvm out of libvirt-qemu's
        # reach, libvirt re-probes qemu's capabilities (~4 s) on every define
        # and start, and kvm domains fail to start unless qemu runs as root.
        try:
            _ensure_qemu_account()
        except (subprocess.CalledProcessError, OSError) as e:
            raise DaemonUnavailable(
                f"libvirt: cannot create the {QEMU_USER} account or fix /dev/kvm: {e}"
            ) from None
    if _socket_accepts(LIBVIRT_SOCK) and (conn := _libvirt_open(uri)):
        return conn
    missing = [
        b
        for b in ("libvirtd", "virtlogd", "qemu-system-x86_64", "qemu-img", "qemu-io")
        if _find(b) is None
    ]
    if missing:
        raise DaemonUnavailable(
            f"libvirt: not installed: {', '.join(missing)} (Debian packages "
            "libvirt-daemon libvirt-daemon-driver-qemu qemu-system-x86 "
            "qemu-utils)"
        )
    _need_root("libvirt")
    with _lock("libvirt"):
        if _socket_accepts(LIBVIRT_SOCK) and (conn := _libvirt_open(uri)):
            return conn
        deadline = time.monotonic() + timeout
        if not _socket_accepts(VIRTLOGD_SOCK):
            log = LOG_DIR / "virtlogd.log"
            proc = _spawn([_find("virtlogd")], log)
            while not _socket_accepts(VIRTLOGD_SOCK):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise DaemonUnavailable(f"libvirt: virtlogd did not start\n{_tail(log)}")
                time.sleep(0.1)
        log = LOG_DIR / "libvirtd.log"
        proc = _spawn([_find("libvirtd")], log)
        while True:
            if _socket_accepts(LIBVIRT_SOCK) and (conn := _libvirt_open(uri)):
                return conn
            if proc.poll() is not None:
                # Lost a race with a libvirtd started elsewhere? Then it answers.
                if conn := _libvirt_open(uri):
                    return conn
                raise DaemonUnavailable(f"libvirt: libvirtd exited {proc.returncode}\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise DaemonUnavailable(
                    f"libvirt: libvirtd gave no connection within {timeout:.0f}s\n{_tail(log)}"
                )
            time.sleep(0.2)


def virt_type(conn) -> str:
    """ "kvm" when /dev/kvm exists and libvirt offers kvm for x86_64, else
    "qemu" (TCG). ``COWFS_TEST_VIRT_TYPE`` forces one."""
    forced = os.environ.get("COWFS_TEST_VIRT_TYPE")
    if forced:
        return forced
    if os.path.exists("/dev/kvm"):
        libvirt = _quiet_libvirt()
        try:
            conn.getDomainCapabilities(None, "x86_64", None, "kvm", 0)
            return "kvm"
        except libvirt.libvirtError:
            pass
    return "qemu"


def tiny_domain_xml(name: str, disk: Path, vtype: str, memory_mib: int = 64) -> str:
    # The static DAC label runs this domain's qemu as root without relabelling:
    # its disk can then live anywhere (pytest's tmp_path is under a 0700
    # directory that libvirt-qemu cannot enter) and is never chowned. A
    # domain of type kvm still needs libvirt-qemu to reach /dev/kvm, as
    # libvirt probes kvm as that user (ensure_libvirt sees to it).
    return f"""<domain type='{vtype}'>
  <name>{name}</name>
  <metadata><cowfs:test xmlns:cowfs='https://cowfs.invalid/test'/></metadata>
  <memory unit='MiB'>{memory_mib}</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='pc'>hvm</type><boot dev='hd'/></os>
  <on_poweroff>destroy</on_poweroff><on_reboot>restart</on_reboot><on_crash>destroy</on_crash>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='{disk}'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <memballoon model='none'/>
  </devices>
  <seclabel type='static' model='dac' relabel='no'><label>+0:+0</label></seclabel>
</domain>"""


def tiny_domain(
    conn,
    name: str,
    workdir,
    *,
    start: bool = False,
    memory_mib: int = 64,
    disk_mib: int = 64,
    vtype: str | None = None,
    prefix: str = PREFIX,
):
    """Define (and with ``start=True`` start) a minimal x86_64 domain on a new
    ``disk_mib`` qcow2 disk ``workdir/NAME.qcow2``. It boots nothing (SeaBIOS
    finds no bootable disk and idles), which is all internal snapshots need:
    ``snapshotCreateXML`` of the running domain takes memory + disk, of the
    shut-off one the disk. A stale domain of the same name is removed first.
    ``name`` starts with ``prefix``, so that ``cleanup_libvirt(conn, prefix)``
    finds it."""
    if not name.startswith(prefix):
        raise ValueError(f"these domains are named {prefix}... so cleanup finds them: {name!r}")
    remove_domain(conn, name)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    disk = workdir / f"{name}.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", str(disk), f"{disk_mib}M"],
        check=True,
        capture_output=True,
        text=True,
    )
    dom = conn.defineXML(
        tiny_domain_xml(name, disk.resolve(), vtype or virt_type(conn), memory_mib)
    )
    if start:
        dom.create()
    return dom


def domain_disk(dom) -> Path:
    """The qcow2 file behind the domain's first disk."""
    m = re.search(r"<disk [^>]*device='disk'.*?<source file='([^']+)'", dom.XMLDesc(0), re.S)
    if not m:
        raise ValueError(f"domain {dom.name()} has no file disk")
    return Path(m.group(1))


def snapshot(dom, name: str, description: str = ""):
    """An internal snapshot: memory + disk of a running domain, the disk of a
    shut-off one (libvirt's default for qcow2 disks)."""
    xml = f"<domainsnapshot><name>{name}</name>"
    if description:
        xml += f"<description>{description}</description>"
    return dom.snapshotCreateXML(xml + "</domainsnapshot>", 0)


MARKER_OFFSET = 1 << 20  # 1 MiB into the disk: clear of any boot sector
MARKER_LEN = 4096
MARKER_PATTERN = 0x5A


def _qemu_io(disk: Path, command: str, *, readonly: bool, share: bool = False):
    argv = ["qemu-io", "-f", "qcow2"]
    if readonly:
        argv.append("-r")
    if share:
        argv.append("-U")  # force-share: read while a running qemu holds the image
    return subprocess.run(
        [*argv, "-c", command, str(disk)], capture_output=True, text=True, timeout=60
    )


def write_marker_file(
    disk, pattern: int = MARKER_PATTERN, offset: int = MARKER_OFFSET, length: int = MARKER_LEN
) -> None:
    """Fill ``length`` bytes at ``offset`` of an offline qcow2 disk with ``pattern``."""
    r = _qemu_io(Path(disk), f"write -P {pattern:#x} {offset} {length}", readonly=False)
    if r.returncode != 0 or "wrote" not in r.stdout:
        raise RuntimeError(
            f"qemu-io write to {disk} failed ({r.returncode}): {(r.stdout + r.stderr).strip()}"
        )


def has_marker_file(
    disk, pattern: int = MARKER_PATTERN, offset: int = MARKER_OFFSET, length: int = MARKER_LEN
) -> bool:
    """Whether the marker is on the disk's current state (readable while a
    domain runs on it, after ``write_marker`` flushed)."""
    r = _qemu_io(Path(disk), f"read -P {pattern:#x} {offset} {length}", readonly=True, share=True)
    out = r.stdout + r.stderr
    if r.returncode == 0 and f"read {length}/{length} bytes" in out:
        return True
    if "Pattern verification failed" in out:
        return False
    raise RuntimeError(f"qemu-io read of {disk} failed ({r.returncode}): {out.strip()}")


def _hmp(dom, command: str) -> str:
    import libvirt_qemu

    return libvirt_qemu.qemuMonitorCommand(
        dom, command, libvirt_qemu.VIR_DOMAIN_QEMU_MONITOR_COMMAND_HMP
    )


def write_marker(
    dom, pattern: int = MARKER_PATTERN, offset: int = MARKER_OFFSET, length: int = MARKER_LEN
) -> None:
    """Write the marker into the domain's disk: with qemu-io on the file when
    the domain is shut off; through the monitor's ``qemu-io`` command (then a
    flush) when it runs, since the guest boots no OS to write it. The monitor
    route marks the domain "tainted: custom-monitor" in its log, harmlessly."""
    if not dom.isActive():
        write_marker_file(domain_disk(dom), pattern, offset, length)
        return
    m = re.search(r"<disk [^>]*device='disk'.*?<alias name='([^']+)'", dom.XMLDesc(0), re.S)
    if not m:
        raise RuntimeError(f"domain {dom.name()}: no disk alias in the live XML")
    dev = f"/machine/peripheral/{m.group(1)}/virtio-backend"
    for cmd in (f"write -P {pattern:#x} {offset} {length}", "flush"):
        # qemu-io's own output goes to the domain log; the monitor answers
        # only errors.
        out = _hmp(dom, f'qemu-io -d {dev} "{cmd}"').strip()
        if out:
            raise RuntimeError(f"domain {dom.name()}: monitor qemu-io {cmd!r}: {out}")


def has_marker(
    dom, pattern: int = MARKER_PATTERN, offset: int = MARKER_OFFSET, length: int = MARKER_LEN
) -> bool:
    return has_marker_file(domain_disk(dom), pattern, offset, length)


def qcow2_snapshots(disk) -> list[str]:
    """Names of the internal snapshots stored in a qcow2 file."""
    r = subprocess.run(
        ["qemu-img", "snapshot", "-U", "-l", str(disk)], capture_output=True, text=True, check=True
    )
    names = []
    for line in r.stdout.splitlines()[2:]:
        parts = line.split()
        if len(parts) >= 2:
            names.append(parts[1])
    return names


def remove_domain(conn, name: str, delete_disk: bool = False) -> bool:
    """Destroy, drop every snapshot of, and undefine domain ``name`` if it
    exists; with ``delete_disk``, delete its disk file too."""
    libvirt = _quiet_libvirt()
    try:
        dom = conn.lookupByName(name)
    except libvirt.libvirtError:
        return False
    try:
        disk = domain_disk(dom)
    except ValueError:
        disk = None
    if dom.isActive():
        with contextlib.suppress(libvirt.libvirtError):
            dom.destroy()
    # Leaves first, so no delete has to re-parent children.
    while snaps := dom.listAllSnapshots(0):
        leaves = [s for s in snaps if s.numChildren(0) == 0] or snaps
        for s in leaves:
            try:
                s.delete(0)
            except libvirt.libvirtError:
                s.delete(libvirt.VIR_DOMAIN_SNAPSHOT_DELETE_METADATA_ONLY)
    flags = (
        libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
        | libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
        | libvirt.VIR_DOMAIN_UNDEFINE_NVRAM
    )
    with contextlib.suppress(libvirt.libvirtError):
        dom.undefineFlags(flags)
    if delete_disk and disk is not None:
        with contextlib.suppress(FileNotFoundError):
            disk.unlink()
    for log in Path("/var/log/libvirt/qemu").glob(f"{name}.log*"):  # virtlogd's per-domain log
        with contextlib.suppress(OSError):
            log.unlink()
    return True


def cleanup_libvirt(conn, prefix: str = PREFIX) -> list[str]:
    """Remove every domain named ``prefix*`` with its snapshots, and its disk
    when the disk file is named ``prefix*`` too (as ``tiny_domain`` makes)."""
    removed = []
    for dom in conn.listAllDomains(0):
        name = dom.name()
        if not name.startswith(prefix):
            continue
        try:
            delete_disk = domain_disk(dom).name.startswith(prefix)
        except ValueError:
            delete_disk = False
        if remove_domain(conn, name, delete_disk=delete_disk):
            removed.append(f"domain {name}")
    return removed
