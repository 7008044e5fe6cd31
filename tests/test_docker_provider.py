"""The docker provider against a real dockerd: the container is rolled
back together with the workspace bind-mounted into it."""

from __future__ import annotations

import subprocess

from cowfs.layers import treesnap
from tools import provider_daemons as daemons


def test_a_failed_install_is_rolled_back_in_the_container_and_the_workspace(
    mounted, docker_client, busybox
):
    ws = mounted
    name = daemons.unique_name("agent")
    # Created after the mount: its bind mount must see the cowfs view.
    c = docker_client.containers.run(
        busybox,
        ["sleep", "3600"],
        name=name,
        detach=True,
        working_dir="/work",
        environment={"STAGE": "build"},
        labels={daemons.LABEL: "1", "role": "agent"},
        volumes={str(ws.path): {"bind": "/work", "mode": "rw"}},
        network_mode="none",
    )
    try:
        ws.cowfs("provider", "add", "box", "--type", "docker", "--container", name)
        before = ws.snapshot()
        r = ws.cowfs(
            "run",
            "--provider",
            "box",
            "--",
            "docker",
            "exec",
            name,
            "sh",
            "-c",
            "printf '#!/bin/sh\\necho tool\\n' > /usr/local/bin/tool && "
            "chmod +x /usr/local/bin/tool && echo built > /work/out && exit 3",
            check=False,
        )
        assert r.returncode == 3, r.stderr
        assert "rolled back" in r.stderr
        treesnap.assert_same(before, ws.snapshot())
        c2 = docker_client.containers.get(name)
        assert c2.id != c.id and c2.status == "running"
        assert c2.exec_run(["ls", "/usr/local/bin/tool"]).exit_code != 0
        attrs = c2.attrs
        assert "STAGE=build" in attrs["Config"]["Env"]
        assert attrs["Config"]["WorkingDir"] == "/work"
        assert attrs["Config"]["Labels"]["role"] == "agent"
        assert attrs["HostConfig"]["NetworkMode"] == "none"
        assert c2.exec_run(["cat", "/work/a.txt"]).output == b"alpha\n"  # same bind mount
        # the snapshot image was discarded with the layer
        assert not [i for i in docker_client.images.list("cowfs/ws")]

        # a successful step is kept as its own layer, with its snapshot (an
        # undo point for the container too); the image is discarded on commit
        ws.cowfs(
            "run",
            "--provider",
            "box",
            "--",
            "docker",
            "exec",
            name,
            "sh",
            "-c",
            "touch /usr/local/bin/kept && echo ok > /work/ok",
        )
        assert (
            docker_client.containers.get(name).exec_run(["ls", "/usr/local/bin/kept"]).exit_code
            == 0
        )
        assert (ws / "ok").read_text() == "ok\n"
        assert len(docker_client.images.list("cowfs/ws")) == 1
        ws.commit()
        assert not [i for i in docker_client.images.list("cowfs/ws")]
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def test_run_container_shorthand(mounted, docker_client, busybox):
    ws = mounted
    name = daemons.unique_name("short")
    docker_client.containers.run(
        busybox,
        ["sleep", "3600"],
        name=name,
        detach=True,
        labels={daemons.LABEL: "1"},
        network_mode="none",
    )
    try:
        r = ws.cowfs(
            "run",
            "--container",
            name,
            "--",
            "docker",
            "exec",
            name,
            "sh",
            "-c",
            "touch /usr/local/bin/junk && exit 1",
            check=False,
        )
        assert r.returncode == 1
        assert (
            docker_client.containers.get(name).exec_run(["ls", "/usr/local/bin/junk"]).exit_code
            != 0
        )
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
