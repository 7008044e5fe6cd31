"""Fixtures: real FUSE mounts driven through the real ``cowfs`` command
(the helpers they use are in tests/helpers.py; the docker and libvirt
fixtures in tests/provider_daemons.py, loaded as a plugin), and the test tiers.

Every mount made through ``Workspace`` is unmounted and its daemon killed at
teardown, whether the test passed or not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import pytest
from hypothesis import HealthCheck, settings

from cowfs.system.mounts import mount_table

from .helpers import managed_workspace, view_processes

pytest_plugins = ["tests.provider_daemons"]  # docker_client, busybox, libvirt_conn, tiny_vm

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    stateful_step_count=30,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=15,
    deadline=None,
    stateful_step_count=25,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "soak",
    max_examples=400,
    deadline=None,
    stateful_step_count=60,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(
    os.environ.get("COWFS_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
)


ENGINES = ("kernel", "pyfuse3")


def pytest_generate_tests(metafunc):
    """The FUSE engine a test's mounts use: each of them, for a test that
    uses ``each_engine`` (itself, through a fixture, or as its module's
    ``usefixtures``); else the default."""
    if "engine" in metafunc.fixturenames:
        both = "each_engine" in metafunc.fixturenames
        metafunc.parametrize("engine", ENGINES if both else ["auto"], indirect=True, scope="module")


@pytest.fixture(scope="module", autouse=True)
def engine(request):
    """The FUSE engine mounts use ($COWFS_ENGINE, which `cowfs mount` takes
    as its default --engine).  Modules run on the default engine run on the
    one $COWFS_ENGINE names, if set (`COWFS_ENGINE=pyfuse3 tools/soak`)."""
    old = os.environ.get("COWFS_ENGINE")
    choice = getattr(request, "param", "auto")
    if choice == "auto" and old:
        choice = old
    os.environ["COWFS_ENGINE"] = choice
    try:
        yield choice
    finally:
        if old is None:
            os.environ.pop("COWFS_ENGINE", None)
        else:
            os.environ["COWFS_ENGINE"] = old


@pytest.fixture(scope="session")
def each_engine():
    """The test runs once on each FUSE engine (see ``engine``)."""


@pytest.fixture(scope="session")
def fuse():
    """The test mounts a FUSE filesystem (a workspace or a view, through
    the `cowfs` command): every fixture that mounts asks for this one, and
    every test that mounts without such a fixture.  It sets nothing up:
    asking for it puts the test in the `fuse` tier."""


# The tiers (markers registered in pyproject.toml; README, "Development"),
# chosen by the fixtures a test uses: `fuse` for those that use ``fuse``
# (tests that mount), `engines` for those run on each FUSE engine
# (``each_engine``), `slow` for those that need dockerd or libvirtd (these
# fixtures) and the modules marked so (crash, scale, model and install tests).
CONTAINER_FIXTURES = {"docker_client", "busybox", "libvirt_conn", "tiny_vm"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if "fuse" in fixtures:
            item.add_marker(pytest.mark.fuse)
        if CONTAINER_FIXTURES & fixtures:
            item.add_marker(pytest.mark.slow)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("engine") in ENGINES:
            item.add_marker(pytest.mark.engines)


def pytest_configure(config):
    if os.geteuid() != 0:
        pytest.exit(
            "the cowfs test suite mounts FUSE filesystems as root; run it as root", returncode=2
        )


@pytest.fixture
def workspace(tmp_path, fuse):
    """An empty, unmounted workspace; populate it, then call .mount()."""
    with managed_workspace(tmp_path / "ws") as ws:
        yield ws


@pytest.fixture
def mounted(workspace):
    """A mounted workspace with a little content in its base state."""
    (workspace / "a.txt").write_text("alpha\n")
    (workspace / "dir").mkdir()
    (workspace / "dir" / "b.txt").write_text("beta\n")
    workspace.mount()
    return workspace


@pytest.fixture
def view_dir(tmp_path, fuse):
    """An empty directory for `cowfs view`; afterwards no view process
    started for it is left (killed) and nothing is mounted there."""
    where = tmp_path / "view"
    where.mkdir()
    try:
        yield where
    finally:
        for pid in view_processes(where):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for _ in range(8):  # a mount stacked on another comes off first
            if str(where) not in mount_table():
                break
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def pytest_sessionfinish(session, exitstatus):
    """A last guard: no cowfs mount made by this session may outlive it."""
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None:
        return
    base = str(factory.getbasetemp())
    for line in open("/proc/self/mountinfo"):
        left, _, right = line.partition(" - ")
        mp = left.split(" ")[4]
        if right.startswith(("fuse.cowfs ", "fuse.cowfs-view ")) and mp.startswith(base + "/"):
            subprocess.run(["umount", "-l", mp], capture_output=True)
