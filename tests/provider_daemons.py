"""pytest fixtures over the real container and VM daemons
(``tools/provider_daemons.py``, which ``tools/bench`` shares): tests/conftest.py
loads this module as a plugin (pytest_plugins), so every test module can use
them.

``DaemonUnavailable`` becomes ``pytest.skip`` -- or a failure when
``COWFS_REQUIRE_PROVIDERS`` names the provider ("docker", "libvirt", a
comma-separated list, or "1"/"all"), so a CI that must exercise the daemons
cannot pass by skipping them.
"""

from __future__ import annotations

import os

import pytest

from tools.provider_daemons import (
    DaemonUnavailable,
    busybox_image,
    cleanup_docker,
    cleanup_libvirt,
    ensure_docker,
    ensure_libvirt,
    remove_domain,
    tiny_domain,
    unique_name,
)


def _required(provider: str) -> bool:
    req = {w.strip().lower() for w in os.environ.get("COWFS_REQUIRE_PROVIDERS", "").split(",")}
    return bool(req & {provider, "1", "all", "yes", "true"})


def skip_unless_available(provider: str, e: DaemonUnavailable):
    """``pytest.skip`` with the reason, or fail when the provider is required."""
    if _required(provider):
        pytest.fail(f"{e} (COWFS_REQUIRE_PROVIDERS requires {provider})", pytrace=False)
    pytest.skip(str(e))


@pytest.fixture(scope="session")
def docker_client():
    """A DockerClient on a running dockerd; the session's cowfs-test
    containers and images are removed at the end."""
    try:
        client = ensure_docker()
    except DaemonUnavailable as e:
        skip_unless_available("docker", e)
    cleanup_docker(client, keep_base=True)  # leftovers of a killed run
    yield client
    cleanup_docker(client)
    client.close()


@pytest.fixture(scope="session")
def busybox(docker_client) -> str:
    """Tag of the local busybox image."""
    try:
        return busybox_image(docker_client)
    except DaemonUnavailable as e:
        skip_unless_available("docker", e)


@pytest.fixture(scope="session")
def libvirt_conn():
    """A connection to qemu:///system; the session's cowfs-test domains are
    removed at the end."""
    try:
        conn = ensure_libvirt()
    except DaemonUnavailable as e:
        skip_unless_available("libvirt", e)
    cleanup_libvirt(conn)
    yield conn
    cleanup_libvirt(conn)
    conn.close()


@pytest.fixture
def tiny_vm(libvirt_conn, tmp_path):
    """A defined, shut-off tiny domain (``dom.create()`` starts it); removed
    with its snapshots and disk afterwards."""
    name = unique_name("vm")
    dom = tiny_domain(libvirt_conn, name, tmp_path)
    yield dom
    remove_domain(libvirt_conn, name, delete_disk=True)
