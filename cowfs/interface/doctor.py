"""``cowfs doctor [PATH]``: check that this machine can run cowfs and, given a
workspace, that its mount, daemon and store are healthy.

Every check yields a ``Check``; ``report`` prints them (a table, or a JSON
list) and returns 0 only when every check is ok.  Informational lines (the
escalation providers, which nothing configures yet) never fail.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from .. import errors

if TYPE_CHECKING:
    from ..system.mounts import Location, MountRecord

MIN_KERNEL = (4, 18)
MIN_PYFUSE3 = (3, 4)
LOW_SPACE_BYTES = 1 << 30
LOW_SPACE_FRACTION = 0.05
PING_TIMEOUT = 10.0
LOG_TIMEOUT = 60.0


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    hint: str = ""
    info: bool = False  # informational: shown, never a failure


def _version_tuple(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


# -- the machine -------------------------------------------------------------------------


def check_dev_fuse() -> Check:
    name = "/dev/fuse"
    try:
        st = os.stat("/dev/fuse")
    except FileNotFoundError:
        return Check(
            name,
            False,
            "/dev/fuse does not exist",
            "load the fuse module (modprobe fuse); in a container, pass the "
            "device in (docker run --device /dev/fuse --cap-add SYS_ADMIN)",
        )
    except OSError as e:
        return Check(name, False, f"cannot stat /dev/fuse: {e.strerror}", "")
    if not stat.S_ISCHR(st.st_mode):
        return Check(
            name,
            False,
            "/dev/fuse is not a character device",
            "remove it and load the fuse module (modprobe fuse), or let udev "
            "recreate it (major 10, minor 229)",
        )
    try:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return Check(
            name,
            False,
            f"cannot open /dev/fuse: {e.strerror}",
            "it should be mode 0666 (crw-rw-rw-), or run as root; in a container, "
            "allow the device (--device /dev/fuse)",
        )
    os.close(fd)
    return Check(
        name,
        True,
        f"character device {os.major(st.st_rdev)},{os.minor(st.st_rdev)}, opens read-write",
    )


def check_fusermount() -> Check:
    path = shutil.which("fusermount3")
    if path is None:
        if os.geteuid() == 0:
            return Check(
                "fusermount3",
                True,
                "not on PATH (root mounts and unmounts without it)",
                "install the fuse3 package for unprivileged users",
                info=True,
            )
        return Check(
            "fusermount3",
            False,
            "not on PATH: unprivileged mounts need it",
            "install the fuse3 package (apt-get install fuse3)",
        )
    try:
        r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        version = (r.stdout + r.stderr).strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        version = "version unknown"
    return Check("fusermount3", True, f"{path} ({version})")


def check_kernel() -> Check:
    release = os.uname().release
    kernel = _version_tuple(release)
    loaded = os.path.isdir("/sys/fs/fuse/connections") or os.path.isdir("/sys/module/fuse")
    proxy = (
        "the FUSE protocol version is only visible in a mount's INIT reply, so "
        f"kernel >= {'.'.join(map(str, MIN_KERNEL))} stands in for it"
    )
    if not loaded:
        return Check(
            "kernel FUSE",
            False,
            f"kernel {release}: the fuse module is not loaded "
            "(no /sys/fs/fuse/connections or /sys/module/fuse)",
            "modprobe fuse",
        )
    if kernel < MIN_KERNEL:
        return Check(
            "kernel FUSE",
            False,
            f"kernel {release} is older than {'.'.join(map(str, MIN_KERNEL))}; {proxy}",
            "upgrade the kernel",
        )
    return Check("kernel FUSE", True, f"fuse loaded, kernel {release} ({proxy})")


def check_privileges() -> Check:
    if os.geteuid() == 0:
        return Check(
            "privileges",
            True,
            "root: mounts use allow_other, so every user reaches the workspace "
            "(with normal permission checks)",
        )
    allow = False
    try:
        with open("/etc/fuse.conf") as f:
            allow = any(line.split("#", 1)[0].strip() == "user_allow_other" for line in f)
    except OSError:
        pass
    return Check(
        "privileges",
        True,
        f"not root (uid {os.geteuid()}): mounts are reachable by this user only"
        + ("; /etc/fuse.conf has user_allow_other" if allow else ""),
        "mount as root for other users to reach the workspace (allow_other "
        "needs root, or user_allow_other in /etc/fuse.conf)",
        info=True,
    )


def _libfuse_version() -> str | None:
    try:
        lib = ctypes.CDLL("libfuse3.so.3")
    except OSError:
        return None
    try:
        lib.fuse_pkgversion.restype = ctypes.c_char_p
        return lib.fuse_pkgversion().decode()
    except AttributeError:
        v = lib.fuse_version()
        return f"{v // 100}.{v % 100}"


def check_engine() -> Check:
    """Which engine a mount would use here, and why."""
    from ..fuse.kernel_engine import available, can_pass_through

    why_not = available()
    if why_not is None:
        features = (
            "passthrough, " if can_pass_through() else ""
        ) + "HANDLE_KILLPRIV_V2, negative entries"
        return Check(
            "engine",
            True,
            f"kernel (the FUSE protocol on /dev/fuse: {features}) is the default here",
            info=True,
        )
    return Check(
        "engine", True, f"pyfuse3: the kernel engine cannot run here ({why_not})", info=True
    )


def check_pyfuse3() -> Check:
    try:
        import pyfuse3
    except ImportError as e:
        return Check(
            "pyfuse3/libfuse",
            False,
            f"pyfuse3 cannot be imported: {e}",
            "install libfuse3 (apt-get install fuse3) and reinstall cowfs "
            "into its venv (pip install -e .)",
        )
    version = getattr(pyfuse3, "__version__", "unknown")
    libfuse = _libfuse_version()
    detail = f"pyfuse3 {version}, libfuse {libfuse or 'unknown'}"
    if version != "unknown" and _version_tuple(version) < MIN_PYFUSE3:
        return Check(
            "pyfuse3/libfuse",
            False,
            detail + f" (cowfs needs pyfuse3 >= {'.'.join(map(str, MIN_PYFUSE3))})",
            "pip install -U 'pyfuse3>=3.4,<4'",
        )
    return Check("pyfuse3/libfuse", True, detail)


# -- providers (informational) -------------------------------------------------------------


def check_docker() -> Check:
    try:
        import docker  # type: ignore[import-not-found]
    except ImportError:
        return Check(
            "provider docker",
            True,
            "not installed (the docker Python SDK)",
            "pip install docker, to escalate checkpoints to container snapshots",
            info=True,
        )
    try:
        client = docker.from_env(timeout=5)
        try:
            client.ping()
            version = client.version().get("Version", "?")
        finally:
            client.close()
    except Exception as e:
        return Check(
            "provider docker",
            True,
            f"SDK {docker.__version__}, daemon not "
            f"reachable: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
            "start dockerd, or set DOCKER_HOST",
            info=True,
        )
    return Check(
        "provider docker", True, f"SDK {docker.__version__}, daemon {version} answers", info=True
    )


def check_libvirt() -> Check:
    try:
        import libvirt  # type: ignore[import-not-found]
    except ImportError:
        return Check(
            "provider libvirt",
            True,
            "not installed (libvirt-python)",
            "pip install libvirt-python, to escalate checkpoints to VM snapshots",
            info=True,
        )
    libvirt.registerErrorHandler(lambda *_: None, None)  # no stray stderr lines
    try:
        conn = libvirt.open("qemu:///system")
    except Exception as e:
        return Check(
            "provider libvirt",
            True,
            f"qemu:///system not reachable: {str(e).splitlines()[0] if str(e) else e}",
            "start libvirtd (or virtqemud)",
            info=True,
        )
    try:
        v = conn.getLibVersion()
        detail = f"qemu:///system answers (libvirt {v // 1000000}.{v // 1000 % 1000}.{v % 1000})"
    except Exception:
        detail = "qemu:///system answers"
    finally:
        try:
            conn.close()
        except Exception:
            pass
    return Check("provider libvirt", True, detail, info=True)


# -- a workspace ------------------------------------------------------------------------------


def _locate(path: str, store: str | None) -> Location:
    """Where the workspace of *path* is (mounts.locate); also a workspace
    mounted at another mount point.  Given the *store* of an unmounted
    workspace, *path* itself is that workspace."""
    from ..system.mounts import UNMOUNTED, Location, locate, mounted_elsewhere

    where = locate(path)
    if where.state != UNMOUNTED:
        return where
    workspace = os.path.realpath(path) if store else where.root
    return mounted_elsewhere(workspace) or Location(UNMOUNTED, workspace, None, None)


def _space(path: str, label: str, disk: dict | None = None) -> Check:
    """Free space on the filesystem of *path* (or as *disk* gives it:
    {"free", "size"} in bytes)."""
    if disk is not None:
        free, total = disk["free"], disk["size"]
    else:
        try:
            sv = os.statvfs(path)
        except OSError as e:
            return Check(
                "free space", False, f"cannot stat the filesystem of {label}: {e.strerror}", ""
            )
        free = sv.f_bavail * sv.f_frsize
        total = sv.f_blocks * sv.f_frsize
    frac = free / total if total else 0.0
    detail = f"{_gib(free)} free of {_gib(total)} ({frac:.0%}) on the {label}'s filesystem"
    if free < LOW_SPACE_BYTES or frac < LOW_SPACE_FRACTION:
        return Check(
            "free space",
            False,
            detail + " (low: below 1 GiB or 5%)",
            "free space there: when the store cannot take a pre-image, changes "
            "fail with ENOSPC; committing the base layer frees its data",
        )
    return Check("free space", True, detail)


def _summary(layers: list[dict]) -> str:
    records = sum(layer.get("records", 0) for layer in layers)
    size = sum(layer.get("bytes", 0) for layer in layers)
    top = layers[-1]["id"] if layers else None
    return (
        f"{len(layers)} layer{'s' if len(layers) != 1 else ''} (top {top}), "
        f"{records} records, {size / (1 << 20):.1f} MiB"
    )


def check_live(rec: MountRecord) -> list[Check]:
    from .client import Client

    ws = Client(rec)
    out = [
        Check("mount", True, f"{rec.mountpoint} is mounted by cowfs (workspace {rec.workspace})")
    ]
    t0 = time.perf_counter()
    try:
        pong = ws.call("ping", timeout=PING_TIMEOUT)
    except Exception as e:
        out.append(
            Check(
                "daemon",
                False,
                f"the daemon (pid {rec.pid}) does not answer: {e}",
                f"see {os.path.join(rec.store, 'daemon.log')}; if it hangs, "
                f"kill {rec.pid} and run 'cowfs mount {rec.workspace}' to recover",
            )
        )
        return out
    out.append(
        Check(
            "daemon",
            True,
            f"pid {pong.get('pid', rec.pid)} answers "
            f"({(time.perf_counter() - t0) * 1000:.1f} ms round trip)",
        )
    )
    engine = pong.get("engine")
    if engine:
        extra = (
            f", FUSE {engine['protocol']}: {', '.join(engine['features'])}"
            if engine.get("protocol")
            else ""
        )
        out.append(Check("engine", True, f"{engine['name']} ({engine['why']}){extra}", info=True))
    try:
        layers = ws.call("log", timeout=LOG_TIMEOUT)["layers"]
        problems = ws.call("check", timeout=LOG_TIMEOUT)["problems"]
        if problems:
            out.append(
                Check(
                    "store",
                    False,
                    f"{rec.store}: {'; '.join(problems[:5])}",
                    "unmount, then run 'cowfs doctor' on the workspace again",
                )
            )
        else:
            out.append(
                Check(
                    "store", True, f"{rec.store}: {_summary(layers)}, consistent (via the daemon)"
                )
            )
    except Exception as e:
        out.append(
            Check(
                "store",
                False,
                f"the daemon cannot list the layers: {e}",
                f"see {os.path.join(rec.store, 'daemon.log')}; 'cowfs unmount' "
                f"then 'cowfs mount {rec.workspace}' checks the store",
            )
        )
    # The store is hidden inside the mount, whose statfs leaves out what
    # --max-store does not allow: the daemon says what the disk has.
    visible = os.path.isdir(rec.store)
    out.append(
        _space(
            rec.store if visible else rec.mountpoint, "store", None if visible else pong.get("disk")
        )
    )
    return out


def check_dead(mountpoint: str, rec: MountRecord | None) -> list[Check]:
    ws = rec.workspace if rec else mountpoint
    who = f"(pid {rec.pid}) " if rec else ""
    return [
        Check("mount", True, f"{mountpoint} is a cowfs mount", ""),
        Check(
            "daemon",
            False,
            f"the cowfs daemon {who}of {mountpoint} is dead: the mount is left behind "
            "and every access there fails (ENOTCONN)",
            f"run 'cowfs mount {ws}' to recover it: that clears the dead mount, checks "
            "the stack and finishes any interrupted rollback; every layer is kept",
        ),
        Check(
            "store",
            True,
            "not checked: the dead mount covers it (recovering the mount checks it)",
            "",
            info=True,
        ),
    ]


def check_unmounted(workspace: str, store_dir: str | None) -> list[Check]:
    from ..errors import AlreadyMounted, CowfsError
    from ..layers.stackview import StackView
    from ..storage.store import Store
    from ..system import backing

    out = [Check("mount", True, f"{workspace} is not mounted", "", info=True)]
    if not os.path.isdir(workspace):
        out.append(
            Check("workspace", False, f"{workspace} does not exist or is not a directory", "")
        )
        return out
    from ..system.mounts import default_store

    store_dir = os.path.abspath(store_dir or default_store(workspace))
    if not os.path.isdir(store_dir):
        out.append(
            Check(
                "store",
                True,
                f"no store at {store_dir} yet: the first mount creates it",
                "pass --store DIR if it lives elsewhere",
                info=True,
            )
        )
        out.append(_space(workspace, "workspace"))
        return out
    try:
        store = Store.open(store_dir, workspace, create=False)
    except AlreadyMounted as e:
        out.append(
            Check(
                "store",
                False,
                str(e),
                "another cowfs process (a mount elsewhere, or 'cowfs run "
                "--workspace') holds it; check 'cowfs doctor' on its mount",
            )
        )
        return out
    except (CowfsError, OSError) as e:
        out.append(
            Check(
                "store", False, f"cannot open {store_dir}: {getattr(e, 'strerror', None) or e}", ""
            )
        )
        return out
    try:
        rootfd = os.open(workspace, backing.DIR_FLAGS)
        try:
            view = StackView(store, backing.Resolver(rootfd, store.grave_fd))
            problems = view.check()
            summary = _summary(view.log())
            pending = store.pending()
        finally:
            os.close(rootfd)
    except Exception as e:
        problems, summary, pending = [f"{type(e).__name__}: {e}"], "", None
    finally:
        store.close()
    if problems:
        shown = "; ".join(problems[:5]) + (
            f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        )
        out.append(
            Check(
                "store",
                False,
                f"{store_dir}: {shown}",
                "mount it ('cowfs mount') to finish interrupted work; layers "
                "with missing pre-images cannot be rolled back exactly",
            )
        )
    else:
        note = (
            f"; an interrupted {pending.op or 'operation'} is pending (the next mount finishes it)"
            if pending
            else ""
        )
        out.append(Check("store", True, f"{store_dir}: {summary}, consistent{note}"))
    out.append(_space(store_dir, "store"))
    return out


# -- running ----------------------------------------------------------------------------------


def run_checks(path: str | None, store: str | None = None) -> list[Check]:
    """Every check, in order: the machine, then (given *path*) the workspace
    that contains it, then the providers.  *store*: the store directory of an
    unmounted workspace mounted with --store."""
    checks = [
        check_dev_fuse(),
        check_fusermount(),
        check_kernel(),
        check_privileges(),
        check_pyfuse3(),
        check_engine(),
    ]
    if path is not None:
        from ..system.mounts import DEAD, LIVE

        try:
            where = _locate(path, store)
        except Exception as e:
            where = None
            checks.append(Check("mount", False, f"cannot inspect {path}: {e}", ""))
        if where is not None and where.state == LIVE:
            assert where.record is not None  # (a live mount has its daemon's record)
            checks += check_live(where.record)
        elif where is not None and where.state == DEAD:
            checks += check_dead(where.root, where.record)
        elif where is not None:
            checks += check_unmounted(where.root, store)
    checks += [check_docker(), check_libvirt()]
    return checks


def _status(c: Check) -> str:
    return "info" if c.info else ("ok" if c.ok else "FAIL")


def report(path: str | None, as_json: bool, store: str | None = None) -> int:
    """Print every check (a table, or with *as_json* a JSON list of
    {name, ok, detail, hint, info}); 0 when all are ok, else 1."""
    checks = run_checks(path, store)
    failed = [c for c in checks if not c.ok and not c.info]
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=None))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{_status(c):<4}  {c.name:<{width}}  {c.detail}")
            if c.hint and (not c.ok or c.info):
                print(f"{'':<4}  {'':<{width}}  -> {c.hint}")
        print()
        print(
            "all checks passed"
            if not failed
            else f"{len(failed)} check{'s' if len(failed) > 1 else ''} failed: "
            + ", ".join(c.name for c in failed)
        )
    sys.stdout.flush()
    return errors.OK if not failed else 1


if __name__ == "__main__":
    _args = [a for a in sys.argv[1:] if a != "--json"]
    sys.exit(report(_args[0] if _args else None, "--json" in sys.argv[1:]))
