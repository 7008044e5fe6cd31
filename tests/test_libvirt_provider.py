"""The libvirt provider against a real libvirtd with qemu: a VM's disk (and
a running VM's memory) is reverted together with the workspace."""

from __future__ import annotations

from cowfs.layers import treesnap
from tools import provider_daemons as daemons

from .test_providers import KillSwitch, crash_during


def add_vm(ws, dom):
    ws.cowfs("provider", "add", "vm", "--type", "libvirt", "--domain", dom.name())


def test_shut_off_vm_disk_is_reverted_with_the_files(mounted, tiny_vm):
    ws, dom = mounted, tiny_vm
    add_vm(ws, dom)
    before = ws.snapshot()
    layer = ws.json("checkpoint", "-m", "fix /etc", "--provider", "vm")
    assert layer["snapshots"][0]["data"]["snapshot"] in dom.snapshotListNames()
    daemons.write_marker(dom)
    (ws / "a.txt").write_text("fixed\n")
    assert daemons.has_marker(dom)
    ws.rollback()
    assert not daemons.has_marker(dom)
    treesnap.assert_same(before, ws.snapshot())
    assert dom.snapshotListNames() == []  # dropped with its layer


def test_running_vm_is_reverted_and_merges_keep_the_chain_short(mounted, tiny_vm):
    ws, dom = mounted, tiny_vm
    dom.create()
    add_vm(ws, dom)
    first = ws.json("checkpoint", "--provider", "vm")["id"]
    ws.json("checkpoint", "--provider", "vm")
    assert len(dom.snapshotListNames()) == 2
    ws.commit()  # the upper snapshot is no longer needed
    assert dom.snapshotListNames() == [f"cowfs-layer-{first}"]
    daemons.write_marker(dom)
    ws.rollback()
    assert dom.isActive() and not daemons.has_marker(dom)
    assert dom.snapshotListNames() == []


def test_diagnostics_are_kept_and_a_failed_health_check_is_loud(mounted, tiny_vm):
    ws, dom = mounted, tiny_vm
    ws.cowfs(
        "provider",
        "add",
        "vm",
        "--type",
        "libvirt",
        "--domain",
        dom.name(),
        "--diagnostics",
        'echo "post-mortem of $COWFS_DOMAIN: disk full"',
        "--health",
        'test -n "$COWFS_DOMAIN"',
    )
    ws.json("checkpoint", "-m", "risky", "--provider", "vm")
    daemons.write_marker(dom)
    res = ws.rollback()
    assert res["postmortems"][0]["output"].strip() == f"post-mortem of {dom.name()}: disk full"
    assert not daemons.has_marker(dom)
    base = ws.log()[-1]
    assert base["postmortems"][0]["domain"] == dom.name()
    assert "post-mortem of" in ws.cowfs("log").stdout

    ws.cowfs(
        "provider",
        "add",
        "sick",
        "--type",
        "libvirt",
        "--domain",
        dom.name(),
        "--health",
        "echo 'web1 does not answer' >&2; exit 1",
    )
    ws.json("checkpoint", "--provider", "sick")
    r = ws.cowfs("rollback", check=False)
    assert r.returncode == 10
    assert "restore sick of layer" in r.stderr and "health check failed" in r.stderr
    assert "web1 does not answer" in r.stderr


def test_checkpoint_vm_shorthand_registers_the_domain(mounted, tiny_vm):
    ws, dom = mounted, tiny_vm
    layer = ws.json("checkpoint", "--vm", dom.name())
    name = layer["snapshots"][0]["provider"]
    assert [p["domain"] for p in ws.json("provider", "list") if p["name"] == name] == [dom.name()]
    daemons.write_marker(dom)
    ws.rollback()
    assert not daemons.has_marker(dom)
    ws.json("checkpoint", "--vm", dom.name())  # the same provider is reused
    assert len(ws.json("provider", "list")) == 1


def test_a_failed_health_check_keeps_the_post_mortem(mounted, tiny_vm):
    ws, dom = mounted, tiny_vm
    ws.cowfs(
        "provider",
        "add",
        "sick",
        "--type",
        "libvirt",
        "--domain",
        dom.name(),
        "--diagnostics",
        "echo diag-output",
        "--health",
        "false",
    )
    layer = ws.json("checkpoint", "--provider", "sick")["id"]
    daemons.write_marker(dom)
    r = ws.cowfs("rollback", check=False)
    assert r.returncode == 10
    assert f"restore sick of layer {layer}: reverted, but the health check failed" in r.stderr
    assert not daemons.has_marker(dom)  # the revert itself happened
    postmortems = ws.log()[-1]["postmortems"]
    assert [(p["provider"], p["domain"], p["layer"], p["output"].strip()) for p in postmortems] == [
        ("sick", dom.name(), layer, "diag-output")
    ]
    assert dom.snapshotListNames() == []


def test_a_rollback_killed_before_the_revert_is_finished_by_the_next_mount(
    mounted, tiny_vm, tmp_path
):
    ws, dom = mounted, tiny_vm
    switch = KillSwitch(tmp_path / "kill")
    ws.cowfs(
        "provider",
        "add",
        "vm",
        "--type",
        "libvirt",
        "--domain",
        dom.name(),
        "--diagnostics",
        switch.guard("vm $COWFS_LAYER") + "echo diag-output",
    )
    before = ws.snapshot()
    layer = ws.json("checkpoint", "--provider", "vm")["id"]
    daemons.write_marker(dom)
    (ws / "a.txt").write_text("changed\n")
    err = crash_during(ws, switch, f"vm {layer}", "rollback")
    assert f"restore vm of layer {layer} (again: it was interrupted)" in err
    assert not daemons.has_marker(dom)
    assert dom.snapshotListNames() == []
    treesnap.assert_same(before, ws.snapshot())
    assert [p["output"].strip() for p in ws.log()[-1]["postmortems"]] == ["diag-output"]
