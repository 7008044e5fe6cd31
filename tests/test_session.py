"""The session without FUSE: the layer lifecycle on a workspace's store, with
no mount (an offline session) and with mount hooks that only note what the
session asks of them."""

from __future__ import annotations

import functools

import trio

from cowfs.service.session import NO_MOUNT, MountHooks, Session


class Noting(MountHooks):
    """Mount hooks that note each call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def flush(self) -> None:
        self.calls.append("flush")

    def layer_switched(self) -> None:
        self.calls.append("layer_switched")

    async def after_undo(self, touched) -> None:
        self.calls.append("after_undo")

    def after_commit(self, freed: list) -> None:
        self.calls.append("after_commit")

    def engine_info(self) -> dict | None:
        return {"name": "noted"}


def run(fn, **args):
    return trio.run(functools.partial(fn, **args))


def test_a_session_without_a_mount_runs_the_layer_lifecycle(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    session = Session(str(ws))
    session.open()
    try:
        assert session.hooks is NO_MOUNT
        one = run(session.checkpoint, message="one")
        two = run(session.checkpoint, message="two")
        assert [layer["message"] for layer in run(session.log)["layers"]] == ["base", "one", "two"]
        assert run(session.status)["engine"] is None
        assert run(session.commit) == {"committed": two["id"], "into": one["id"], "top": one["id"]}
        undone = run(session.rollback)
        assert undone["dropped"] == [one["id"]] and not undone["failures"]
        assert run(session.redo)["restored"] == [one["id"]]
        assert session.pending() is None
    finally:
        session.close()


def test_the_session_calls_its_mount_hooks(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    session = Session(str(ws))
    session.open()
    hooks = Noting()
    session.attach(hooks)
    try:
        run(session.checkpoint, message="one")
        assert hooks.calls == ["flush", "layer_switched"]
        hooks.calls.clear()
        run(session.checkpoint, message="two")
        run(session.commit)
        assert hooks.calls == ["flush", "layer_switched", "flush", "layer_switched", "after_commit"]
        hooks.calls.clear()
        run(session.rollback)
        assert hooks.calls == ["flush", "after_undo"]
        assert run(session.status)["engine"] == {"name": "noted"}
    finally:
        session.close()
