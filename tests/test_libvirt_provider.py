"""The libvirt provider against a real libvirtd with qemu: a VM's disk (and
a running VM's memory) is reverted together with the workspace."""

from __future__ import annotations

from cowfs import treesnap

from . import engines
from .engines import libvirt_conn, tiny_vm  # noqa: F401  (fixtures)


def add_vm(ws, dom):
    ws.cowfs("provider", "add", "vm", "--type", "libvirt", "--domain", dom.name())


def test_shut_off_vm_disk_is_reverted_with_the_files(mounted, tiny_vm):
    ws, dom = mounted, tiny_vm
    add_vm(ws, dom)
    before = ws.snapshot()
    layer = ws.json("checkpoint", "-m", "fix /etc", "--provider", "vm")
    assert layer["snapshots"][0]["data"]["snapshot"] in dom.snapshotListNames()
    engines.write_marker(dom)
    (ws / "a.txt").write_text("fixed\n")
    assert engines.has_marker(dom)
    ws.rollback()
    assert not engines.has_marker(dom)
    treesnap.assert_same(before, ws.snapshot())
    assert dom.snapshotListNames() == []          # dropped with its layer


def test_running_vm_is_reverted_and_merges_keep_the_chain_short(mounted, tiny_vm):
    ws, dom = mounted, tiny_vm
    dom.create()
    add_vm(ws, dom)
    first = ws.json("checkpoint", "--provider", "vm")["id"]
    ws.json("checkpoint", "--provider", "vm")
    assert len(dom.snapshotListNames()) == 2
    ws.commit()                                   # the upper snapshot is no longer needed
    assert dom.snapshotListNames() == [f"cowfs-layer-{first}"]
    engines.write_marker(dom)
    ws.rollback()
    assert dom.isActive() and not engines.has_marker(dom)
    assert dom.snapshotListNames() == []
