"""The escalation policy of `cowfs run --scope`: how commands are classified
(the built-in policy file and users' extensions), and what a run then
snapshots, on real mounts (and a real dockerd for containers)."""

from __future__ import annotations

import json
import subprocess

import pytest

from cowfs.errors import USAGE
from cowfs.escalation.policy import Policy, PolicyError, Where
from cowfs.layers import treesnap
from tools import provider_daemons as daemons

from .helpers import COWFS


@pytest.fixture(autouse=True)
def no_user_policy(tmp_path, monkeypatch):
    """Only the built-in policy and the files a test gives."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("COWFS_POLICY", raising=False)


WS = Where("/ws/src", ["/ws"])

CASES = [
    # read-only: no checkpoint
    ("ls -la", "none"),
    (["cat", "/etc/passwd"], "none"),
    ("grep -r TODO . | sort | head -5", "none"),
    ("find . -name '*.py' -newer setup.py", "none"),
    ("git status --short", "none"),
    ("git -C sub log --oneline", "none"),
    ("sed -n 1,5p /etc/hosts", "none"),
    ("echo hello 2>/dev/null", "none"),
    ("systemctl status nginx", "none"),
    ("apt list --installed", "none"),
    ("env LANG=C ls", "none"),
    ("if test -f x; then cat x; fi", "none"),
    # files only
    ("make -j2", "files"),
    ("ls > listing.txt", "files"),
    ("find . -name '*.o' -delete", "files"),
    ("find . -exec rm {} +", "files"),
    ("git commit -am wip", "files"),
    ("sed -i s/a/b/ src.c", "files"),
    ("sort -o sorted.txt data", "files"),
    ("rm -rf ../build", "files"),  # /ws/build: still the workspace
    ("npm install", "files"),
    (".venv/bin/pip install requests", "files"),
    ("pip install --target ./vendor requests", "files"),
    ("cp /etc/hosts ./hosts.copy", "files"),  # reads outside, writes inside
    ("./configure && make", "files"),
    ("sh -c 'echo it", "files"),  # cannot be parsed: the default
    # the system outside the workspace
    ("apt-get install -y curl", "system"),
    ("sudo -u root apt-get install -y curl", "system"),
    ("timeout 60 dnf -y install gcc", "system"),
    ("systemctl restart nginx", "system"),
    ("pip install requests", "system"),
    ("python3 -m pip install requests", "system"),
    ("npm install -g typescript", "system"),
    ("useradd builder", "system"),
    ("cp tool /usr/local/bin/", "system"),
    ("tee -a /etc/hosts", "system"),
    ("echo 127.0.0.1 x >> /etc/hosts", "system"),
    ("sed -i s/a/b/ /etc/ssh/sshd_config", "system"),
    ("rm -rf /var/lib/app", "system"),
    ("dd if=/dev/zero of=/dev/sdb bs=1M", "system"),
    ("make && sudo make install PREFIX=/usr", "files"),  # make's own rules are unknown
    ("bash -c 'make && apt-get install -y libssl-dev'", "system"),
    ("echo $(rm -rf /opt/app)", "system"),
    ("ls `touch /etc/flag`", "system"),
    (["sh", "-c", "service cron reload"], "system"),
]


@pytest.mark.parametrize("cmd,scope", CASES, ids=[str(c) for c, _ in CASES])
def test_builtin_policy_classifies(cmd, scope):
    verdict = Policy.load().classify(cmd, WS)
    assert verdict.scope == scope, verdict.reasons
    assert verdict.reasons  # always says why


def test_docker_exec_is_classified_by_its_command_and_names_the_container():
    policy = Policy.load()
    v = policy.classify("docker exec -w /work -e A=1 builder apt-get install -y gcc", WS)
    assert (v.scope, v.containers) == ("system", ["builder"])
    v = policy.classify(["docker", "exec", "builder", "ls", "/"], WS)
    assert (v.scope, v.containers) == ("none", ["builder"])


def test_user_policy_comes_first_and_extends_settings(tmp_path):
    user = tmp_path / "mine.toml"
    user.write_text("""
[settings]
unescalated = "refuse"

[wrappers]
with-lock = {operands = 1}

[[rule]]
name = "our deploy script changes servers"
scope = "system"
programs = ["deploy.sh"]

[[rule]]
name = "make check is read-only here"
scope = "none"
programs = ["make"]
subcommands = ["check"]
""")
    policy = Policy.load([str(user)])
    assert policy.settings["unescalated"] == "refuse"
    assert policy.settings["default"] == "files"  # the rest from the built-in file
    assert policy.classify("./deploy.sh prod", WS).scope == "system"
    assert policy.classify("with-lock /tmp/l make check", WS).scope == "none"
    assert policy.classify("make all", WS).scope == "files"
    assert "our deploy script" in policy.classify("deploy.sh", WS).reasons[0]
    assert policy.sources == [str(user), "built-in policy"]


def test_xdg_and_environment_policy_files_are_read(tmp_path, monkeypatch):
    config = tmp_path / "config" / "cowfs"
    config.mkdir(parents=True)
    (config / "policy.toml").write_text(
        '[[rule]]\nname = "x"\nscope = "system"\nprograms = ["make"]\n'
    )
    env_file = tmp_path / "env.toml"
    env_file.write_text('[[rule]]\nname = "y"\nscope = "none"\nprograms = ["make"]\n')
    assert Policy.load().classify("make", WS).scope == "system"
    monkeypatch.setenv("COWFS_POLICY", str(env_file))
    assert Policy.load().classify("make", WS).scope == "none"  # the environment's first


@pytest.mark.parametrize(
    "text,message",
    [
        ("[[rule]]\nscope = 'none'\n", "programs is required"),
        ("[[rule]]\nscope = 'maybe'\nprograms = ['x']\n", "scope must be one of"),
        ("[[rule]]\nscope = 'none'\nprograms = 'x'\n", "programs is a list of strings"),
        ("[[rule]]\nscope = 'none'\nprograms = ['x']\nprogram = ['y']\n", "unknown key 'program'"),
        ("[settings]\nrun_scope = 'everything'\n", "run_scope must be one of"),
        ("[rules]\n", "unknown table 'rules'"),
        ("[[rule]\n", "policy file"),
    ],
)
def test_bad_policy_files_are_one_line_errors(tmp_path, text, message):
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(PolicyError, match=message):
        Policy.load([str(bad)])
    r = subprocess.run(
        [*COWFS, "policy", "--policy", str(bad), "--", "ls"], capture_output=True, text=True
    )
    assert r.returncode == USAGE
    assert len(r.stderr.strip().splitlines()) == 1 and message.split()[0] in r.stderr


def test_policy_command_explains(mounted):
    r = mounted.json("policy", "--", "apt-get", "install", "x")
    assert r["scope"] == "system" and "package managers" in r["reasons"][0]
    assert mounted.json("policy", "ls > /etc/motd")["scope"] == "system"
    assert mounted.json("policy")["sources"] == ["built-in policy"]


# -- runs on a real mount ---------------------------------------------------------------


def layer_ids(ws) -> list[int]:
    return [layer["id"] for layer in ws.log()]


def test_auto_takes_no_checkpoint_for_read_only_commands(mounted):
    ws = mounted
    layers = layer_ids(ws)
    r = ws.cowfs("--json", "run", "--scope", "auto", "--", "cat", "a.txt")
    result = json.loads(r.stdout.splitlines()[-1])
    assert result["outcome"] == "no checkpoint" and result["scope"] == "none"
    assert "no checkpoint taken" in r.stderr
    assert layer_ids(ws) == layers
    assert ws.log()[-1]["runs"][-1]["command"] == "cat a.txt"  # still on the record
    # a failing read-only command has nothing to roll back
    r = ws.cowfs("run", "--scope", "auto", "--", "ls", "missing", check=False)
    assert r.returncode == 2 and layer_ids(ws) == layers


def test_auto_files_scope_checkpoints_and_rolls_back(mounted):
    ws = mounted
    before = ws.snapshot()
    r = ws.cowfs("run", "--scope", "auto", "--", "sh", "-c", "echo x > new && exit 4", check=False)
    assert r.returncode == 4 and "rolled back" in r.stderr
    treesnap.assert_same(before, ws.snapshot())


def test_auto_system_command_without_a_container_warns_or_is_refused(mounted, tmp_path):
    ws = mounted
    # A system command that the policy cannot escalate: files only, loudly.
    r = ws.cowfs(
        "run",
        "--scope",
        "auto",
        "--",
        "sh",
        "-c",
        "echo x > made; true > /dev/null; cp made /tmp/cowfs-policy-test-$$ ; "
        "rm -f /tmp/cowfs-policy-test-$$",
    )
    assert "changes the system outside the workspace" in r.stderr
    assert "no container or VM is configured" in r.stderr
    assert (ws / "made").exists()
    strict = tmp_path / "strict.toml"
    strict.write_text('[settings]\nunescalated = "refuse"\n')
    r = ws.cowfs(
        "run",
        "--scope",
        "auto",
        "--policy",
        strict,
        "--",
        "sh",
        "-c",
        "touch ran; apt-get install -y nothing",
        check=False,
    )
    assert r.returncode == USAGE and "refused by the policy" in r.stderr
    assert not (ws / "ran").exists()  # refused before anything ran


def test_container_and_vm_scopes_need_one_configured(mounted):
    for scope, flag in (("container", "--container"), ("vm", "--vm")):
        r = mounted.cowfs("run", "--scope", scope, "--", "true", check=False)
        assert r.returncode == USAGE and flag in r.stderr


def test_policy_run_scope_setting_is_the_default(mounted, tmp_path):
    auto = tmp_path / "auto.toml"
    auto.write_text('[settings]\nrun_scope = "auto"\n')
    layers = layer_ids(mounted)
    r = mounted.cowfs("run", "--policy", auto, "--", "ls")
    assert "no checkpoint taken" in r.stderr and layer_ids(mounted) == layers


# -- containers ---------------------------------------------------------------------------


@pytest.fixture
def box(mounted, docker_client, busybox):
    """A running container with the workspace bind-mounted at /work."""
    name = daemons.unique_name("policy")
    docker_client.containers.run(
        busybox,
        ["sleep", "3600"],
        name=name,
        detach=True,
        working_dir="/work",
        labels={daemons.LABEL: "1"},
        network_mode="none",
        volumes={str(mounted.path): {"bind": "/work", "mode": "rw"}},
    )
    try:
        yield name
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def test_auto_escalates_a_system_command_to_its_container(mounted, box, docker_client):
    ws = mounted
    before = ws.snapshot()
    r = ws.cowfs(
        "--json",
        "run",
        "--scope",
        "auto",
        "--",
        "docker",
        "exec",
        box,
        "sh",
        "-c",
        "cp /bin/busybox /usr/local/bin/tool && echo built > /work/out && exit 3",
        check=False,
    )
    assert r.returncode == 3, r.stderr
    result = json.loads(r.stdout.splitlines()[-1])
    assert result["scope"] == "system" and result["outcome"] == "rolled back"
    assert any(box in s for s in result["snapshots"])
    treesnap.assert_same(before, ws.snapshot())
    assert docker_client.containers.get(box).exec_run(["ls", "/usr/local/bin/tool"]).exit_code != 0
    # a command that stays in the bind-mounted workspace is files-only: no
    # container snapshot, and nothing uncaptured to warn about
    r = ws.cowfs(
        "--json",
        "run",
        "--scope",
        "auto",
        "--",
        "docker",
        "exec",
        box,
        "sh",
        "-c",
        "echo kept > /work/kept",
    )
    result = json.loads(r.stdout.splitlines()[-1])
    assert (result["scope"], result["snapshots"], result["uncaptured"]) == ("files", [], {})
    assert "warning" not in r.stderr and (ws / "kept").read_text() == "kept\n"


def test_files_only_run_in_a_container_warns_about_uncaptured_changes(mounted, box):
    ws = mounted
    # a change made before the run is not this run's
    subprocess.run(["docker", "exec", box, "touch", "/etc/earlier"], check=True)
    script = (
        "echo data > /work/result && mkdir -p /opt/cache && echo x > /opt/cache/blob"
        " && touch /etc/earlier"
    )
    r = ws.cowfs(
        "--json", "run", "--scope", "files", "--", "docker", "exec", box, "sh", "-c", script
    )
    result = json.loads(r.stdout.splitlines()[-1])
    lines = result["uncaptured"][box]
    assert "A /opt/cache/blob" in lines and "A /opt/cache" in lines
    assert "A /etc/earlier" in lines  # changed again during the run (its times moved)
    assert not any("/work" in line for line in lines)
    assert f"container {box} changed outside the workspace" in r.stderr
    assert "/opt/cache/blob" in r.stderr
    assert (ws / "result").read_text() == "data\n"
    run_record = ws.log()[-1]["runs"][-1]
    assert run_record["uncaptured"][box] == lines


# -- VMs -----------------------------------------------------------------------------------


def test_auto_escalates_to_the_registered_vm_by_a_user_rule(mounted, tiny_vm, tmp_path):
    """A remediation step that changes a VM's disk (qemu-io here, ssh in
    real life), classified `system` by the user's own rule: escalated to
    the registered libvirt domain, and reverted with the files."""
    ws, dom = mounted, tiny_vm
    ws.cowfs("provider", "add", "web", "--type", "libvirt", "--domain", dom.name())
    rule = tmp_path / "site.toml"
    rule.write_text('[[rule]]\nname = "disk surgery"\nscope = "system"\nprograms = ["qemu-io"]\n')
    disk = daemons.domain_disk(dom)
    before = ws.snapshot()
    r = ws.cowfs(
        "--json",
        "run",
        "--scope",
        "auto",
        "--policy",
        rule,
        "--",
        "sh",
        "-c",
        f"echo fixed > a.txt && qemu-io -f qcow2 -c 'write -P 0x5a "
        f"{daemons.MARKER_OFFSET} {daemons.MARKER_LEN}' {disk} && exit 1",
        check=False,
    )
    assert r.returncode == 1, r.stderr
    result = json.loads(r.stdout.splitlines()[-1])
    assert (result["scope"], result["snapshots"]) == ("system", ["web"])
    assert "disk surgery" in result["reasons"][0]
    assert not daemons.has_marker(dom)
    treesnap.assert_same(before, ws.snapshot())
    assert dom.snapshotListNames() == []
