"""Stores are trusted only where they are safe (DESIGN.md, "Threat model";
cowfs/system/trust.py): an agent inside a workspace can plant a `.cowfs` of its
own below the root, and a command run by root after the unmount must never
use it -- nor make a store anywhere.  What the agent does runs as the user
"nobody" (tests/users.py), through root's mount."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from cowfs.errors import NO_STORE, STORE_ERROR
from cowfs.system.mounts import is_cowfs_mount

from . import users
from .helpers import Workspace, managed_workspace, run
from .test_nonroot import UserMount, fuse_for_users, preload  # noqa: F401  (a fixture)

AGENT = pwd.getpwnam("nobody")


def as_agent(fn, *args):
    return users.run_as(AGENT.pw_uid, AGENT.pw_gid, fn, *args)


def one_line(r: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr


def listing(top: Path) -> dict[str, tuple[int, int, bytes | None]]:
    """Every path below *top*: (owner, mode, contents of regular files)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            data = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[str(p.relative_to(top))] = (st.st_uid, st.st_mode, data)
    return out


def setuid_files(top: Path) -> list[str]:
    return sorted(
        str(p)
        for p in top.rglob("*")
        if not p.is_symlink() and p.lstat().st_mode & (stat.S_ISUID | stat.S_ISGID)
    )


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory the agent can reach (tmp_path's cannot), root's, 0755."""
    where = Path(tempfile.mkdtemp(prefix="cowfs-sec-"))
    os.chmod(where, 0o755)
    try:
        yield where
    finally:
        subprocess.run(["rm", "-rf", str(where)], check=False)


@pytest.fixture
def ws(base, fuse) -> Iterator[Workspace]:
    with managed_workspace(base / "ws") as w:
        yield w


def evil_store(sub: Path, scratch: Path) -> bytes:
    """The bytes of a genuine store of the workspace *sub* whose base layer,
    rolled back, makes sub/id (a copy of /usr/bin/id) root's and setuid: what
    an agent that can write bytes anywhere it may could craft.  (Made here
    by mounting *sub* with a store elsewhere; the file ends as the agent's.)"""
    shutil.copy("/usr/bin/id", sub / "id")
    os.chown(sub / "id", 0, 0)
    os.chmod(sub / "id", 0o4755)
    w = Workspace(sub)
    try:
        w.mount("--store", scratch)
        os.chown(sub / "id", AGENT.pw_uid, AGENT.pw_gid)
        os.chmod(sub / "id", 0o755)
        w.unmount()
    finally:
        w.teardown()
    env = lmdb.open(str(scratch / "db"), max_dbs=32)
    meta = env.open_db(b"meta")
    with env.begin(write=True, db=meta) as txn:  # (no drift record: nothing to refuse)
        txn.delete(b"drift")
        txn.delete(b"state")
    env.close()
    data = (scratch / "db" / "data.mdb").read_bytes()
    shutil.rmtree(scratch)
    return data


def plant(store: Path, data: bytes | None) -> None:
    """As the agent: a store directory with db/ (and *data* in data.mdb)."""

    def make() -> None:
        os.makedirs(store / "db")
        if data is not None:
            (store / "db" / "data.mdb").write_bytes(data)

    as_agent(make)


@pytest.mark.parametrize("planted", ["evil store", "empty db"])
@pytest.mark.parametrize("ws_store", ["ws/.cowfs", "elsewhere"])
def test_a_store_the_agent_planted_below_the_root_is_never_used(base, ws, planted, ws_store):
    """The finding: the agent made sub/.cowfs/db through root's mount; after
    the unmount root's `cowfs -C ws/sub status` made a store there (exit 0)
    and, with the agent's bytes in data.mdb, `rollback --yes` made the
    agent's copy of id setuid root.  Now the workspace's own store is used
    (path sub inside it) or, where it has none above, the planted one is
    refused -- never used, nothing made in it, nothing made setuid."""
    sub = ws / "sub"
    sub.mkdir()
    os.chown(sub, AGENT.pw_uid, AGENT.pw_gid)
    data = evil_store(sub, base / "scratch") if planted == "evil store" else None
    assert not setuid_files(ws.path)
    if ws_store == "ws/.cowfs":
        ws.mount()
    else:
        ws.mount("--store", base / "wsstore")
    planted_at = sub / ".cowfs"
    plant(planted_at, data)
    ws.unmount()
    before = listing(planted_at)

    r = run("-C", sub, "--json", "status", check=False)
    if ws_store == "ws/.cowfs":  # the workspace's own store, with the agent's work in it
        assert r.returncode == 0, r.stderr
        paths = {c["path"] for c in json.loads(r.stdout)["changes"]}
        assert "sub/.cowfs" in paths, paths
    else:
        assert r.returncode == STORE_ERROR, r.stderr
        said = f"refusing to use the cowfs store {planted_at}: {sub} is owned by uid "
        assert said in one_line(r)
    assert listing(planted_at) == before  # no lock, no grave, no lock.mdb: nothing made

    r = run("-C", sub, "--json", "rollback", "--yes", check=False)
    if ws_store == "ws/.cowfs":
        assert r.returncode == 0, r.stderr
        assert not planted_at.exists()  # (the agent's work, rolled back with the rest)
    else:
        assert r.returncode == STORE_ERROR
        one_line(r)
        assert listing(planted_at) == before
    assert not setuid_files(ws.path)
    if data is not None:
        st = os.lstat(sub / "id")
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (AGENT.pw_uid, 0o755)
    # nor does a mount of sub take the agent's store (or make one in sub)
    if ws_store == "elsewhere":
        r = run("mount", sub, check=False)
        assert r.returncode == STORE_ERROR and not is_cowfs_mount(str(sub)), r.stderr
        assert listing(planted_at) == before


def test_offline_commands_never_make_a_store(tmp_path):
    """On a path with no store every offline command is exit 4 naming the
    path, and no .cowfs (nor --store DIR) is made."""
    plain = tmp_path / "plain"
    plain.mkdir()
    view = tmp_path / "view"
    view.mkdir()
    commands = [
        ["status"],
        ["log"],
        ["rollback", "--yes"],
        ["commit"],
        ["redo"],
        ["gc"],
        ["check"],
        ["diff"],
        ["show", "1:x"],
        ["audit"],
        ["view", "1", str(view)],
    ]
    for args in commands:
        r = run("-C", plain, *args, check=False)
        assert r.returncode == NO_STORE, (args, r.returncode, r.stderr)
        assert str(plain) in one_line(r), (args, r.stderr)
        assert os.listdir(plain) == [] and os.listdir(view) == [], args
    missing = tmp_path / "missing"
    for args in (["status"], ["rollback", "--yes"], ["check"]):
        r = run("-C", plain, "--store", missing, *args, check=False)
        assert r.returncode == NO_STORE, (args, r.returncode, r.stderr)
        assert str(missing) in one_line(r)
        assert not missing.exists() and os.listdir(plain) == []


def test_a_mount_makes_a_private_store(workspace):
    workspace.mount()
    workspace.unmount()
    for d in (".cowfs", ".cowfs/db", ".cowfs/grave"):
        st = os.lstat(workspace / d)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700), d


@pytest.mark.parametrize(
    "spoil, said",
    [
        (lambda w: os.chmod(w / ".cowfs", 0o777), ".cowfs is writable by others (mode 0777)"),
        (lambda w: os.chmod(w / ".cowfs", 0o1777), "(mode 1777) (sticky, but the store's own)"),
        (lambda w: os.chmod(w / ".cowfs" / "db", 0o770), "db is writable by its group (mode 0770)"),
        (lambda w: os.chmod(w / ".cowfs" / "grave", 0o702), "grave is writable by others"),
        (lambda w: os.chown(w / ".cowfs", AGENT.pw_uid, -1), ".cowfs is owned by uid 65534"),
        (lambda w: os.chown(w / ".cowfs" / "db", AGENT.pw_uid, -1), "db is owned by uid 65534"),
        (
            lambda w: os.chown(w / ".cowfs" / "db" / "data.mdb", AGENT.pw_uid, -1),
            "data.mdb is owned by uid 65534",
        ),
        (lambda w: os.chmod(w.path, 0o777), "ws is writable by others (mode 0777)"),
        (lambda w: os.chmod(w.path, 0o775), "ws is writable by its group (mode 0775)"),
        (lambda w: os.chown(w.path, AGENT.pw_uid, -1), "ws is owned by uid 65534, not by root"),
    ],
    ids=[
        "store-0777",
        "store-sticky",
        "db-group-writable",
        "grave-other-writable",
        "store-agents",
        "db-agents",
        "data.mdb-agents",
        "ws-0777",
        "ws-0775",
        "ws-agents",
    ],
)
def test_an_unsafe_store_is_refused_offline_and_by_mount(workspace, spoil, said):
    workspace.mount()
    (workspace / "f").write_text("f\n")
    workspace.unmount()
    spoil(workspace)
    store = workspace / ".cowfs"
    before = listing(store)
    for args in (["status"], ["rollback", "--yes"], ["log"], ["check"]):
        r = workspace.cowfs(*args, check=False)
        assert r.returncode == STORE_ERROR, (args, r.stderr)
        line = one_line(r)
        assert "refusing to use the cowfs store" in line and said in line, line
    r = run("mount", workspace.path, check=False)
    assert r.returncode == STORE_ERROR and said in one_line(r), r.stderr
    assert not is_cowfs_mount(str(workspace.path))
    assert listing(store) == before  # (no mode "fixed", nothing made)
    assert (workspace / "f").exists()


def test_sticky_directories_above_a_store(base, fuse):
    """A world-writable sticky directory above the store (/tmp-like) is
    safe when what lies in it on the store's path is root's: nobody else
    can rename it.  Without the sticky bit, or with the agent's directory
    next, it is not."""
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with managed_workspace(shared / "ws") as w:
        w.mount()
        (w / "f").write_text("f\n")
        w.unmount()
        assert [c["path"] for c in w.json("status")["changes"]] == ["f"]
        os.chmod(shared, 0o777)
        r = w.cowfs("status", check=False)
        assert r.returncode == STORE_ERROR
        assert f"{shared} is writable by others (mode 0777)" in one_line(r)
        os.chmod(shared, 0o1777)
        os.chown(w.path, AGENT.pw_uid, AGENT.pw_gid)  # (in a sticky dir: the agent's)
        r = w.cowfs("status", check=False)
        assert r.returncode == STORE_ERROR
        assert f"{w.path} is owned by uid {AGENT.pw_uid}" in one_line(r)


def test_a_store_given_in_the_agents_directory_is_refused(base, ws):
    agent = base / "agent"
    agent.mkdir()
    os.chown(agent, AGENT.pw_uid, AGENT.pw_gid)
    # a genuine store of ws, once root's, now in a directory the agent owns
    ws.mount("--store", base / "real")
    (ws / "f").write_text("f\n")
    ws.unmount()
    shutil.move(base / "real", agent / "real")
    for args in (["status"], ["rollback", "--yes"], ["check"]):
        r = run("-C", ws.path, "--store", agent / "real", *args, check=False)
        assert r.returncode == STORE_ERROR, (args, r.stderr)
        assert f"{agent} is owned by uid {AGENT.pw_uid}" in one_line(r)
    r = run("mount", "--store", agent / "real", ws.path, check=False)
    assert r.returncode == STORE_ERROR and not is_cowfs_mount(str(ws.path)), r.stderr
    # the agent's own store directory, and a new one the agent could swap
    plant(agent / "own", None)
    r = run("-C", ws.path, "--store", agent / "own", "status", check=False)
    assert r.returncode == STORE_ERROR and "owned by uid" in one_line(r)
    r = run("mount", "--store", agent / "new", ws.path, check=False)
    assert r.returncode == STORE_ERROR, r.stderr
    assert f"refusing to create a cowfs store in {agent}" in one_line(r)
    assert not (agent / "new").exists() and not is_cowfs_mount(str(ws.path))
    assert (ws / "f").exists()


def test_a_store_below_another_workspaces_root_is_not_adopted(workspace):
    """Two stores above the path, both root's: the outer workspace's counts
    (the inner one lies in its tree); given with --store, the inner one."""
    outer = workspace
    outer.mount()
    (outer / "top.txt").write_text("top\n")
    outer.unmount()
    inner = Workspace(outer.path / "inner")
    inner.path.mkdir()
    try:
        inner.mount()
        (inner / "x").write_text("x\n")
        inner.unmount()
    finally:
        inner.teardown()
    r = run("-C", inner.path, "--json", "status")
    assert [c["path"] for c in json.loads(r.stdout)["changes"]] == ["top.txt"]
    r = run("-C", inner.path, "--store", inner.path / ".cowfs", "--json", "status")
    assert [c["path"] for c in json.loads(r.stdout)["changes"]] == ["x"]


def test_a_store_inside_a_mounted_workspace_is_refused(ws, tmp_path):
    """Made through a mount (here root's own, so only the mount gives it
    away): whoever may write there could have made it."""
    ws.mount()
    os.makedirs(ws / "sub" / ".cowfs" / "db")
    other = tmp_path / "other"
    other.mkdir()
    r = run("-C", other, "--store", ws / "sub" / ".cowfs", "status", check=False)
    assert r.returncode == STORE_ERROR
    assert f"lies inside the mounted cowfs workspace at {ws.path}" in one_line(r)
    assert os.listdir(ws / "sub" / ".cowfs") == ["db"]


@pytest.mark.usefixtures("fuse_for_users")
def test_a_users_own_store_serves_them_and_is_refused_to_root(base, fuse):
    """A user who mounts their own workspace owns its store: their offline
    commands use it; root's refuse it (the user could have written it)."""
    preload()
    ws = base / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("alpha\n")
    for p in (ws, ws / "a.txt"):
        os.chown(p, AGENT.pw_uid, AGENT.pw_gid)
    m = UserMount(base, "auto")
    try:
        assert m.start().get("ok")
        as_agent(lambda: (ws / "a.txt").write_text("changed\n"))
        code, _, err = users.cowfs_as(AGENT.pw_uid, AGENT.pw_gid, "/", ["unmount", str(ws)])
        assert code == 0, err
        os.waitpid(m.pid, 0)
        m.pid = 0
        st = os.lstat(ws / ".cowfs")
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (AGENT.pw_uid, 0o700)

        r = run("-C", ws, "status", check=False)
        assert r.returncode == STORE_ERROR
        assert f"{ws} is owned by uid {AGENT.pw_uid}, not by root" in one_line(r)
        code, out, err = users.cowfs_as(AGENT.pw_uid, AGENT.pw_gid, ws, ["--json", "status"])
        assert code == 0, err
        res = json.loads(out)
        assert res["mounted"] is False and [c["path"] for c in res["changes"]] == ["a.txt"]
        code, _, err = users.cowfs_as(AGENT.pw_uid, AGENT.pw_gid, ws, ["rollback", "--yes"])
        assert code == 0, err
        assert (ws / "a.txt").read_text() == "alpha\n"
    finally:
        m.stop()
