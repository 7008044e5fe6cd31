"""The provider-daemon test helpers work: a local busybox image in a real dockerd,
``docker commit`` and recreating a container from the committed image, and
libvirt internal snapshots of a tiny qemu domain, shut off and running, proven
by a marker on its disk that a revert takes away."""

from __future__ import annotations

import subprocess
import time

import pytest

from tools import provider_daemons as daemons

# ------------------------------------------------------------------ docker


def test_busybox_image_runs_with_the_cli_and_the_sdk(docker_client, busybox):
    assert daemons.busybox_image(docker_client) == busybox  # reused, not rebuilt
    img = docker_client.images.get(busybox)
    assert img.labels.get(daemons.LABEL) == "1"
    try:
        cli = daemons.docker_cli()
    except daemons.DaemonUnavailable as e:
        pytest.skip(str(e))
    r = subprocess.run(
        [cli, "run", "--rm", busybox, "sh", "-c", "echo ok"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stdout) == (0, "ok\n"), r.stderr
    out = docker_client.containers.run(
        busybox, ["sh", "-c", "id -un; ls -d /usr/local/bin /tmp"], remove=True, network_mode="none"
    )
    assert sorted(out.decode().split()) == ["/tmp", "/usr/local/bin", "root"]


def _recreate(client, container, image: str):
    """Stop and remove ``container`` and create it anew from ``image`` with
    the same name, command, env, working dir, labels, mounts and network --
    what the docker provider's rollback does."""
    a = container.attrs
    cfg, host = a["Config"], a["HostConfig"]
    name = a["Name"].lstrip("/")
    container.remove(force=True)
    new = client.api.create_container(
        image,
        name=name,
        command=cfg["Cmd"],
        entrypoint=cfg["Entrypoint"],
        environment=cfg["Env"],
        working_dir=cfg["WorkingDir"],
        labels=cfg["Labels"],
        host_config=client.api.create_host_config(
            binds=host["Binds"], network_mode=host["NetworkMode"]
        ),
    )
    client.api.start(new["Id"])
    return client.containers.get(new["Id"])


def test_commit_then_recreate_from_the_image_undoes_a_change(docker_client, busybox, tmp_path):
    ws = tmp_path / "workspace"
    ws.mkdir()
    (ws / "README").write_text("workspace\n")
    name = daemons.unique_name("ctr")
    c = docker_client.containers.run(
        busybox,
        ["sleep", "3600"],
        name=name,
        detach=True,
        environment={"STAGE": "build"},
        working_dir="/work",
        labels={daemons.LABEL: "1", "role": "agent"},
        volumes={str(ws): {"bind": "/work", "mode": "rw"}},
    )
    assert c.exec_run(["cat", "README"]).output == b"workspace\n"

    t0 = time.monotonic()
    ckpt = f"{daemons.IMAGE_REPO_PREFIX}ckpt:{name}-1"
    c.commit(repository=ckpt.rsplit(":", 1)[0], tag=ckpt.rsplit(":", 1)[1])
    capture_s = time.monotonic() - t0

    r = c.exec_run(
        [
            "sh",
            "-c",
            "printf '#!/bin/sh\\necho tool\\n' > /usr/local/bin/tool && "
            "chmod +x /usr/local/bin/tool && tool && exit 3",
        ]
    )
    assert (r.exit_code, r.output) == (3, b"tool\n")
    changed = {d["Path"] for d in c.diff()}
    assert "/usr/local/bin/tool" in changed  # docker diff sees the change outside /work

    t0 = time.monotonic()
    c2 = _recreate(docker_client, c, ckpt)
    restore_s = time.monotonic() - t0
    print(f"docker commit {capture_s:.2f}s, recreate {restore_s:.2f}s")

    assert c2.name == name and c2.status in ("running", "created")
    assert c2.exec_run(["ls", "/usr/local/bin/tool"]).exit_code != 0
    assert (
        c2.exec_run(["sh", "-c", "echo $STAGE; pwd; cat README"]).output
        == b"build\n/work\nworkspace\n"
    )
    assert c2.labels["role"] == "agent"
    assert not [d for d in (c2.diff() or []) if d["Path"].startswith("/usr/local")]


def test_cleanup_docker_removes_what_tests_made(docker_client, busybox):
    name = daemons.unique_name("gone")
    c = docker_client.containers.create(busybox, ["true"], name=name)
    c.commit(repository=f"{daemons.IMAGE_REPO_PREFIX}gone", tag=name)
    removed = daemons.cleanup_docker(docker_client, keep_base=True)
    assert f"container {name}" in removed
    assert not [
        c for c in docker_client.containers.list(all=True) if c.name.startswith(daemons.PREFIX)
    ]
    left = [
        t
        for i in docker_client.images.list()
        for t in i.tags
        if t.startswith(daemons.IMAGE_REPO_PREFIX)
    ]
    assert left == [daemons.BUSYBOX_TAG]


# ------------------------------------------------------------------ libvirt


def test_shut_off_domain_disk_snapshot_revert_removes_the_marker(libvirt_conn, tiny_vm):
    dom = tiny_vm
    disk = daemons.domain_disk(dom)
    assert not dom.isActive() and not daemons.has_marker(dom)

    snap = daemons.snapshot(dom, "base")
    assert "<state>shutoff</state>" in snap.getXMLDesc(0)
    assert daemons.qcow2_snapshots(disk) == ["base"]

    daemons.write_marker(dom)
    assert daemons.has_marker(dom)
    dom.revertToSnapshot(snap, 0)
    assert not daemons.has_marker(dom)

    snap.delete(0)
    assert daemons.qcow2_snapshots(disk) == [] and dom.listAllSnapshots(0) == []


def test_running_domain_memory_snapshot_revert(libvirt_conn, tiny_vm):
    import libvirt

    dom = tiny_vm
    dom.create()
    assert dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING

    t0 = time.monotonic()
    snap = daemons.snapshot(dom, "live")
    capture_s = time.monotonic() - t0
    desc = snap.getXMLDesc(0)
    assert "<state>running</state>" in desc and "<memory snapshot='internal'/>" in desc

    daemons.write_marker(dom)  # through the monitor: the domain runs
    assert daemons.has_marker(dom)
    extra = daemons.snapshot(dom, "extra")  # taken and dropped while running
    extra.delete(0)
    assert daemons.qcow2_snapshots(daemons.domain_disk(dom)) == ["live"]
    t0 = time.monotonic()
    dom.revertToSnapshot(snap, 0)
    restore_s = time.monotonic() - t0
    print(
        f"libvirt ({daemons.virt_type(libvirt_conn)}) running snapshot {capture_s:.2f}s, "
        f"revert {restore_s:.2f}s"
    )
    assert dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING
    assert not daemons.has_marker(dom)

    dom.destroy()
    snap.delete(0)
    assert daemons.qcow2_snapshots(daemons.domain_disk(dom)) == []


def test_cleanup_libvirt_removes_domains_snapshots_and_disks(libvirt_conn, tmp_path):
    name = daemons.unique_name("gone")
    dom = daemons.tiny_domain(libvirt_conn, name, tmp_path, start=True)
    daemons.snapshot(dom, "one")
    disk = daemons.domain_disk(dom)
    assert f"domain {name}" in daemons.cleanup_libvirt(libvirt_conn)
    assert name not in [d.name() for d in libvirt_conn.listAllDomains(0)]
    assert not disk.exists()
