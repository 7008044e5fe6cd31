"""Model-based test: random sequences of file operations and stack commands
through a real mount, checking that rollback is exact.

A hypothesis state machine mounts a fresh workspace per example and runs
random file operations on a small pool of names (so that collisions happen)
twice: through the cowfs mount and on a plain *shadow* directory on the same
filesystem.  The shadow is the oracle for the operations themselves: every
operation must succeed or fail exactly as it does natively (same errno), and
the live tree must match the shadow (names, types, bytes, modes, owners,
symlink targets, xattrs, hard links; mtimes are not comparable there).

The stack commands are checked against a model stack of
``(layer id, treesnap snapshot when the layer was opened)``:

* ``checkpoint`` pushes (id, snapshot of the tree right before it);
* ``rollback`` must bring the tree back to the top entry's snapshot exactly,
  mtimes included; ``rollback --to ID`` to that entry's snapshot;
* ``commit`` must leave the live tree unchanged; the top entry is dropped
  (its changes now belong to the layer below), and committing the base layer
  makes the current tree the new base state;
* unmount + mount must change nothing (neither the tree nor the stack);
* ``redo`` right after a rollback (even across a remount) must bring back
  the tree as it was before the rollback, mtimes included, and the stack
  (the same layer ids, each still rolling back to its own snapshot); after a
  checkpoint or commit it must refuse and change nothing; after file
  operations it may refuse (changing nothing) or go ahead, and then the tree
  must be the one before the rollback with those operations replayed on it
  (each with the result it had), and they belong to the top layer brought
  back (rolling it back undoes them too).

"nothing to roll back" (exit code 1) must come exactly when only an empty
base layer exists.  The model knows whether a layer is empty from the shadow:
an operation that changed the shadow's snapshot (mtimes included) made the
layer non-empty; one that succeeded without a visible change (chmod to the
same mode, rename of a name onto itself) may or may not have been recorded.

Settings come from the hypothesis profile loaded by conftest ("ci", "dev",
"soak"); COWFS_MAX_EXAMPLES overrides max_examples (used by tools/soak).
COWFS_MODEL_STATS names a file that receives counters (examples, steps, rules
run, errnos seen) after every example.
"""

from __future__ import annotations

import base64
import ctypes
import dataclasses
import errno
import json
import os
import random
import shutil
import stat
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cowfs.errors import NOTHING_TO_DO, REFUSED
from cowfs.interface.api import Workspace as Workspace_api
from cowfs.layers import treesnap
from cowfs.service import control
from cowfs.system.mounts import MountRecord, mount_table

from .helpers import Overlay, Workspace, mount, unmount_all

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fuse")]

CHUNK = 64 * 1024
MAX_FILE = 300 * 1024

# A small pool of names in a couple of directories: entries get created,
# replaced, moved and removed under each other's names all the time.
POOL = [
    "f1",
    "f2",
    "f3",
    "d1",
    "d2",
    "d1/f1",
    "d1/f2",
    "d1/f3",
    "d1/d2",
    "d2/f1",
    "d2/f2",
    "d1/d2/f1",
]
PATHS = st.sampled_from(POOL)
ATTR_PATHS = st.sampled_from(POOL + ["."])  # the workspace root too
# Relative targets without "..": whatever resolves through them stays inside
# the tree it is in (the workspace, or the shadow).
TARGETS = st.sampled_from(["f1", "f2", "d1", "d1/f2", "f3", "d2/f1", "nowhere"])
SEEDS = st.integers(0, 2**16)
BOUNDARY = st.builds(lambda k, d: max(0, k * CHUNK + d), st.integers(1, 4), st.integers(-300, 300))
OFFSETS = st.one_of(st.integers(0, 4096), BOUNDARY, st.integers(0, MAX_FILE))
SIZES = st.one_of(st.integers(0, 3000), BOUNDARY, st.integers(CHUNK, MAX_FILE))
LENGTHS = st.one_of(st.integers(1, 600), st.integers(1, CHUNK + CHUNK // 2))
MODES = st.one_of(
    st.sampled_from([0o644, 0o600, 0o755, 0o700, 0o000, 0o777]), st.integers(0, 0o7777)
)
IDS = st.sampled_from([0, 1000, 65534])
MTIMES = st.one_of(
    st.sampled_from([0, 10**9, 1_700_000_000_123_456_789]),
    st.builds(lambda s, ns: s * 10**9 + ns, st.integers(0, 2**33), st.integers(0, 10**9 - 1)),
)
XNAMES = st.sampled_from(["user.a", "user.b"])
XVALUES = st.one_of(st.binary(max_size=16), st.binary(min_size=200, max_size=2000))
XFLAGS = st.sampled_from([0, os.XATTR_CREATE, os.XATTR_REPLACE])

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
AT_FDCWD = -100
NB = os.O_NONBLOCK  # opening a FIFO for writing must not block (ENXIO instead)
_libc = ctypes.CDLL(None, use_errno=True)

# Counters for tools/soak (examples, steps, rules, errnos).
STATS: Counter = Counter()


def data_for(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def renameat2(src: str, dst: str, flags: int) -> None:
    if (
        _libc.renameat2(
            AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), ctypes.c_uint(flags)
        )
        != 0
    ):
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), src, None, dst)


def outcome(fn, root: str):
    """("ok", result) or ("error", errno name) of running fn on one tree."""
    try:
        return ("ok", fn(root))
    except OSError as e:
        return ("error", errno.errorcode.get(e.errno, e.errno))


def at(root: str, rel: str) -> str:
    return root if rel == "." else os.path.join(root, rel)


def copy_tree(src: str, dst: str) -> None:
    """cp -a: keeps modes, owners, times, xattrs, symlinks and hard links."""
    subprocess.run(["cp", "-a", "--", src, dst], check=True, capture_output=True)


def replace_tree(src: str, dst: str) -> None:
    shutil.rmtree(dst)
    copy_tree(src, dst)


def scratch_base() -> str:
    """A private directory per example; teardown() removes it (pytest's
    tmp_path is not available to a state machine)."""
    return os.environ.get("TMPDIR", "/tmp")


@dataclass
class Layer:
    """The model of one layer: its id, the tree when it was opened, a copy of
    the shadow at that moment, and whether the daemon should have recorded
    something in it: 0 nothing, 1 maybe (only invisible changes), 2 surely."""

    id: int
    snap: treesnap.Snapshot
    shadow: str
    dirty: int = 0


@dataclass
class Redo:
    """What a redo of the last rollback must bring back: the stack and the
    shadow before it, and the tree; *touched*: a file operation ran since
    (it may have ended the chance to redo), *ops*: those that succeeded,
    with their results (a redo that goes ahead keeps them), *dirty*: what
    they make of the top layer the redo brings back (see Layer)."""

    stack: list
    shadow: str
    live: treesnap.Snapshot
    touched: bool = False
    ops: list = dataclasses.field(default_factory=list)
    dirty: int = 0


class CowfsModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        STATS["examples"] += 1
        self.tmp = tempfile.mkdtemp(prefix="cowfs-model-", dir=scratch_base())
        self.ws = Workspace(Path(self.tmp) / "ws")
        # (beside the workspace, not in it: the rules give its root any mode
        # and owner, and a root others may write cannot keep a store inside)
        self.ws.store = Path(self.tmp) / "store"
        self.shadow = os.path.join(self.tmp, "shadow")
        self.copies = 0
        self.stack: list[Layer] = []
        self.redo_model: Redo | None = None
        self.ws.path.mkdir()

    @initialize()
    def mount(self):
        ws = str(self.ws.path)
        self.populate(ws)
        copy_tree(ws, self.shadow)
        self.ws.mount("--store", self.ws.store)
        layers = self.ws.log()
        assert len(layers) == 1, layers
        self.stack = [Layer(layers[0]["id"], self.ws.snapshot(), self.save_shadow())]

    def teardown(self):
        """Always: unmount, kill the daemon, then fail on any error it logged."""
        errors = []
        try:
            self.ws.teardown()
            errors = self.ws.daemon_errors()
        finally:
            if str(self.ws.path) not in _cowfs_mounts():
                shutil.rmtree(self.tmp, ignore_errors=True)
            path = os.environ.get("COWFS_MODEL_STATS")
            if path:
                with open(path, "w") as f:
                    json.dump(dict(STATS), f)
        assert not errors, "the daemon logged errors:\n" + "\n".join(errors)

    # -- helpers -----------------------------------------------------------------

    @staticmethod
    def populate(root: str) -> None:
        """The base state: small and multi-chunk files, a hard link, a
        symlink, an xattr, an empty directory, explicit mtimes."""
        with open(at(root, "f1"), "wb") as f:
            f.write(data_for(1, 100))
        os.setxattr(at(root, "f1"), "user.a", b"initial")
        with open(at(root, "f2"), "wb") as f:
            f.write(data_for(2, 3 * CHUNK + 1234))
        os.symlink("f1", at(root, "f3"))
        os.mkdir(at(root, "d1"))
        with open(at(root, "d1/f1"), "wb") as f:
            f.write(data_for(3, CHUNK + 7))
        os.link(at(root, "f2"), at(root, "d1/f2"))
        os.mkdir(at(root, "d2"), 0o750)
        for i, rel in enumerate(["f1", "f2", "d1/f1", "d1", "d2"]):
            os.utime(at(root, rel), ns=(10**18 + i, 10**18 + i * 1_000_001))

    def save_shadow(self) -> str:
        self.copies += 1
        dst = os.path.join(self.tmp, f"layer-{self.copies}")
        copy_tree(self.shadow, dst)
        return dst

    def drop(self, layer: Layer) -> None:
        shutil.rmtree(layer.shadow, ignore_errors=True)

    def ids(self) -> list[int]:
        return [layer.id for layer in self.stack]

    def check_log(self) -> None:
        assert [layer["id"] for layer in self.ws.log()] == self.ids()

    def both(self, name: str, fn) -> None:
        """Run fn on the shadow and on the mount: same result or same errno."""
        STATS[name] += 1
        STATS["steps"] += 1
        before = treesnap.snapshot(self.shadow)
        expected = outcome(fn, self.shadow)
        got = outcome(fn, str(self.ws.path))
        assert got == expected, (
            f"{name}: the native filesystem gives {expected}, the cowfs mount {got}"
        )
        if self.redo_model is not None:
            self.redo_model.touched = True
        if expected[0] == "error":
            STATS[f"errno {expected[1]}"] += 1
            return
        changed = bool(treesnap.compare(before, treesnap.snapshot(self.shadow)))
        top = self.stack[-1]
        top.dirty = max(top.dirty, 2 if changed else 1)
        if self.redo_model is not None:
            self.redo_model.ops.append((name, fn, expected))
            self.redo_model.dirty = max(self.redo_model.dirty, 2 if changed else 1)

    # -- file operations ---------------------------------------------------------

    @rule(path=PATHS, size=SIZES, seed=SEEDS, excl=st.booleans())
    def create_file(self, path, size, seed, excl):
        def op(root):
            flags = os.O_WRONLY | NB | os.O_CREAT | (os.O_EXCL if excl else os.O_TRUNC)
            fd = os.open(at(root, path), flags, 0o644)
            try:
                os.write(fd, data_for(seed, size))
            finally:
                os.close(fd)

        self.both("create_file", op)

    @rule(path=PATHS, offset=OFFSETS, length=LENGTHS, seed=SEEDS)
    def write_at(self, path, offset, length, seed):
        def op(root):
            fd = os.open(at(root, path), os.O_WRONLY | NB)
            try:
                os.pwrite(fd, data_for(seed, length), offset)
            finally:
                os.close(fd)

        self.both("write_at", op)

    @rule(path=PATHS, offset=BOUNDARY, length=st.integers(1, 2 * CHUNK + 10), seed=SEEDS)
    def write_across_chunks(self, path, offset, length, seed):
        """A write straddling one or more 64 KiB chunk boundaries."""

        def op(root):
            fd = os.open(at(root, path), os.O_RDWR | NB)
            try:
                os.pwrite(fd, data_for(seed, length), max(0, offset - length // 2))
            finally:
                os.close(fd)

        self.both("write_across_chunks", op)

    @rule(path=PATHS, size=SIZES)
    def truncate(self, path, size):
        self.both("truncate", lambda root: os.truncate(at(root, path), size))

    @rule(path=PATHS, length=LENGTHS, seed=SEEDS)
    def append(self, path, length, seed):
        def op(root):
            fd = os.open(at(root, path), os.O_WRONLY | os.O_APPEND | NB)
            try:
                os.write(fd, data_for(seed, length))
            finally:
                os.close(fd)

        self.both("append", op)

    @rule(src=PATHS, dst=PATHS)
    def rename(self, src, dst):
        self.both("rename", lambda root: os.rename(at(root, src), at(root, dst)))

    @rule(data=st.data())
    def rename_over_existing_file(self, data):
        """rename(2) onto another existing file (the replaced one must come back)."""
        files = sorted(p for p in POOL if stat.S_ISREG(_lmode(at(self.shadow, p))))
        if len(files) < 2:
            return
        src = data.draw(st.sampled_from(files), label="src")
        dst = data.draw(st.sampled_from([f for f in files if f != src]), label="dst")
        self.both("rename_over_existing_file", lambda root: os.rename(at(root, src), at(root, dst)))

    @rule(src=PATHS, dst=PATHS, flags=st.sampled_from([RENAME_NOREPLACE, RENAME_EXCHANGE]))
    def rename2(self, src, dst, flags):
        """renameat2 with RENAME_NOREPLACE / RENAME_EXCHANGE."""
        self.both("rename2", lambda root: renameat2(at(root, src), at(root, dst), flags))

    @rule(src=PATHS, dst=PATHS, follow=st.booleans())
    def link(self, src, dst, follow):
        self.both(
            "link", lambda root: os.link(at(root, src), at(root, dst), follow_symlinks=follow)
        )

    @rule(dest=TARGETS, path=PATHS)
    def symlink(self, dest, path):
        self.both("symlink", lambda root: os.symlink(dest, at(root, path)))

    @rule(path=PATHS)
    def unlink(self, path):
        self.both("unlink", lambda root: os.unlink(at(root, path)))

    @rule(path=PATHS, mode=st.sampled_from([0o755, 0o700, 0o777, 0o1777, 0o2750]))
    def mkdir(self, path, mode):
        self.both("mkdir", lambda root: os.mkdir(at(root, path), mode))

    @rule(path=PATHS)
    def mkfifo(self, path):
        self.both("mkfifo", lambda root: os.mkfifo(at(root, path), 0o640))

    @rule(path=PATHS)
    def rmdir(self, path):
        self.both("rmdir", lambda root: os.rmdir(at(root, path)))

    @rule(path=ATTR_PATHS, mode=MODES)
    def chmod(self, path, mode):
        self.both("chmod", lambda root: os.chmod(at(root, path), mode))

    @rule(path=ATTR_PATHS, uid=IDS, gid=IDS, follow=st.booleans())
    def chown(self, path, uid, gid, follow):
        self.both("chown", lambda root: os.chown(at(root, path), uid, gid, follow_symlinks=follow))

    @rule(path=ATTR_PATHS, mtime=MTIMES, follow=st.booleans())
    def utime(self, path, mtime, follow):
        self.both(
            "utime",
            lambda root: os.utime(at(root, path), ns=(mtime, mtime), follow_symlinks=follow),
        )

    @rule(path=ATTR_PATHS, name=XNAMES, value=XVALUES, flags=XFLAGS, follow=st.booleans())
    def setxattr(self, path, name, value, flags, follow):
        self.both(
            "setxattr",
            lambda root: os.setxattr(at(root, path), name, value, flags, follow_symlinks=follow),
        )

    @rule(path=ATTR_PATHS, name=XNAMES, follow=st.booleans())
    def removexattr(self, path, name, follow):
        self.both(
            "removexattr", lambda root: os.removexattr(at(root, path), name, follow_symlinks=follow)
        )

    # -- stack operations ----------------------------------------------------------

    def can_roll_back(self) -> bool:
        return len(self.stack) > 1 or self.stack[0].dirty > 0

    @rule()
    def checkpoint(self):
        STATS["checkpoint"] += 1
        snap = self.ws.snapshot()
        self.forget_redo()
        layer_id = self.ws.checkpoint("model")
        assert layer_id not in self.ids()
        self.stack.append(Layer(layer_id, snap, self.save_shadow()))

    @precondition(can_roll_back)
    @rule(then_redo=st.booleans())
    def rollback(self, then_redo):
        top = self.stack[-1]
        if len(self.stack) == 1 and top.dirty == 1:
            # Only changes nobody can see: the base layer may be empty or not.
            r = self.ws.cowfs("--json", "rollback", "--yes", check=False)
            if r.returncode == NOTHING_TO_DO:
                STATS["rollback (nothing, allowed)"] += 1
                assert "nothing to roll back" in r.stderr, r.stderr
                treesnap.assert_same(top.snap, self.ws.snapshot())
                top.dirty = 0
                return
            self.expect_redo(len(self.stack) - 1)
            assert r.returncode == 0, r.stderr
            res = json.loads(r.stdout)
        else:
            self.expect_redo(len(self.stack) - 1)
            res = self.ws.rollback()
        STATS["rollback"] += 1
        assert res["dropped"] == [top.id], (res, self.ids())
        assert not res["failures"], res["failures"]
        treesnap.assert_same(top.snap, self.ws.snapshot())
        self.restore_to(len(self.stack) - 1, res["top"])
        if then_redo:
            self.redo()

    @precondition(can_roll_back)
    @rule(data=st.data(), then_redo=st.booleans())
    def rollback_to(self, data, then_redo):
        STATS["rollback_to"] += 1
        i = data.draw(st.integers(0, len(self.stack) - 1), label="index")
        target = self.stack[i]
        self.expect_redo(i)
        res = self.ws.rollback(to=target.id)
        assert res["dropped"] == self.ids()[i:], (res, self.ids())
        assert not res["failures"], res["failures"]
        treesnap.assert_same(target.snap, self.ws.snapshot())
        self.restore_to(i, res["top"])
        if then_redo:
            self.redo()

    def restore_to(self, i: int, top_id: int) -> None:
        """Model of a rollback down to and including stack[i] (the dropped
        layers' shadows are kept by the redo model)."""
        target = self.stack[i]
        replace_tree(target.shadow, self.shadow)
        del self.stack[i + 1 :]
        if i == 0:
            # A fresh base layer opens, on the very same tree.
            self.stack = [Layer(top_id, target.snap, target.shadow)]
        else:
            self.stack.pop()
        assert top_id == self.stack[-1].id
        self.check_log()

    def expect_redo(self, i: int) -> None:
        """Before a rollback down to stack[i]: what its redo must bring back."""
        self.forget_redo()
        live = self.ws.snapshot()
        self.redo_model = Redo(
            [dataclasses.replace(layer) for layer in self.stack], self.save_shadow(), live
        )

    def forget_redo(self) -> None:
        """The last rollback can no longer be redone: drop the shadows only
        its model held."""
        if self.redo_model is None:
            return
        in_use = {layer.shadow for layer in self.stack}
        for layer in self.redo_model.stack:
            if layer.shadow not in in_use:
                self.drop(layer)
        shutil.rmtree(self.redo_model.shadow, ignore_errors=True)
        self.redo_model = None

    @rule()
    def redo(self):
        """Undo the last rollback: exact when nothing changed since, refused
        (changing nothing) when something did."""
        live = self.ws.snapshot()
        model = self.redo_model
        r = self.ws.cowfs("--json", "redo", check=False)
        if r.returncode != 0:
            STATS["redo refused"] += 1
            assert r.returncode in (NOTHING_TO_DO, REFUSED), (r.returncode, r.stderr)
            assert model is None or model.touched, (
                f"redo refused right after a rollback: {r.stderr}"
            )
            treesnap.assert_same(live, self.ws.snapshot())
            self.check_log()
            self.forget_redo()
            return
        assert model is not None, f"redo without a rollback to undo: {r.stdout}"
        STATS["redo after changes elsewhere" if model.ops else "redo"] += 1
        res = json.loads(r.stdout)
        assert not res["failures"], res["failures"]
        if not model.ops:
            treesnap.assert_same(model.live, self.ws.snapshot())
        # What changed since the rollback did not touch what the redo brings
        # back: the same operations on the tree before the rollback give the
        # same results, and that tree (the invariant compares it).
        for name, fn, expected in model.ops:
            got = outcome(fn, model.shadow)
            assert got == expected, f"{name} after the redo: {got}, since the rollback {expected}"
        # the stack is back as it was: every layer rolls back to its snapshot
        # (the layers below the rollback's are the same, with their shadows);
        # what changed since the rollback belongs to its top layer
        self.stack = model.stack
        self.stack[-1].dirty = max(self.stack[-1].dirty, model.dirty)
        replace_tree(model.shadow, self.shadow)
        shutil.rmtree(model.shadow, ignore_errors=True)
        self.redo_model = None
        assert res["top"] == self.stack[-1].id, (res, self.ids())
        self.check_log()

    @rule()
    def commit(self):
        live = self.ws.snapshot()
        top = self.stack[-1]
        if len(self.stack) == 1:
            r = self.ws.cowfs("--json", "commit", check=False)
            if top.dirty == 0 or (top.dirty == 1 and r.returncode == NOTHING_TO_DO):
                # (refused: the last rollback can still be redone)
                STATS["commit (nothing)"] += 1
                assert r.returncode == NOTHING_TO_DO and "nothing to commit" in r.stderr, (
                    r.returncode,
                    r.stderr,
                )
                top.dirty = 0
            else:
                STATS["commit base"] += 1
                self.forget_redo()
                assert r.returncode == 0, r.stderr
                res = json.loads(r.stdout)
                assert res["into"] is None and res["committed"] == top.id, res
                assert res["top"] != top.id, res
                self.drop(top)
                self.stack = [Layer(res["top"], live, self.save_shadow())]
        else:
            STATS["commit"] += 1
            self.forget_redo()
            below = self.stack[-2]
            res = self.ws.commit()
            assert res["committed"] == top.id and res["into"] == below.id, res
            below.dirty = max(below.dirty, top.dirty)
            self.drop(top)
            self.stack.pop()
        treesnap.assert_same(live, self.ws.snapshot())
        self.check_log()

    @precondition(lambda self: bool(self.stack))
    @rule(data=st.data())
    def show_past(self, data):
        """`show` reads any layer's start without restoring it: for every
        name in the pool (and the root), what it gives equals the tree
        recorded when that layer was opened (what `rollback --to` gives)."""
        STATS["show_past"] += 1
        target = self.stack[data.draw(st.integers(0, len(self.stack) - 1), label="index")]
        rec = MountRecord.load(str(self.ws.path))
        for rel in ["."] + POOL:
            info = control.call(rec, "show", layer=target.id, path=rel, missing_ok=True)
            entry = target.snap.get(os.fsencode(rel) if rel != "." else treesnap.ROOT)
            where = f"show {target.id}:{rel}"
            if entry is None:
                assert info["kind"] is None, (where, info)
                continue
            assert (info["kind"], info["mode"], info["uid"], info["gid"]) == (
                entry.kind,
                entry.mode,
                entry.uid,
                entry.gid,
            ), (where, info, entry)
            assert info["mtime_ns"] == entry.mtime_ns, (where, info, entry)
            xattrs = tuple(
                sorted((base64.b64decode(n), base64.b64decode(v)) for n, v in info["xattrs"])
            )
            assert xattrs == entry.xattrs, (where, xattrs, entry.xattrs)
            if entry.kind == "file":
                data_ = b"".join(Workspace_api(rec)._pages(target.id, rel, info))
                assert (len(data_), xxhash.xxh3_128_hexdigest(data_)) == (
                    entry.size,
                    entry.digest,
                ), where
            elif entry.kind == "symlink":
                assert os.fsencode(info["target"]) == entry.target, where
            elif entry.kind == "dir":
                prefix = b"" if rel == "." else os.fsencode(rel) + b"/"
                names = sorted(
                    p[len(prefix) :]
                    for p in target.snap
                    if p != treesnap.ROOT and p.startswith(prefix) and b"/" not in p[len(prefix) :]
                )
                assert sorted(os.fsencode(n) for n in info["entries"]) == names, where

    @precondition(lambda self: bool(self.stack))
    @rule(data=st.data())
    def view_past(self, data):
        """`view ID DIR` mounts the tree as it was when layer ID was opened:
        exactly what was recorded then (what `rollback --to ID` gives),
        mtimes and hard links included; writing there fails with EROFS."""
        STATS["view_past"] += 1
        target = self.stack[data.draw(st.integers(0, len(self.stack) - 1), label="index")]
        where = tempfile.mkdtemp(dir=self.tmp, prefix="view-")
        self.ws.cowfs("view", str(target.id), where)
        try:
            treesnap.assert_same(target.snap, treesnap.snapshot(where))
            try:
                open(os.path.join(where, "new-file"), "w")
            except OSError as e:
                assert e.errno == errno.EROFS
            else:
                raise AssertionError("a view accepted a write")
        finally:
            r = self.ws.cowfs("unmount", where, check=False)
            if r.returncode != 0 or where in mount_table():
                subprocess.run(["umount", "-l", where], capture_output=True)

    @precondition(lambda self: len(self.stack) == 1 and self.stack[0].dirty == 0)
    @rule()
    def nothing_to_roll_back(self):
        """Only an empty base layer: the answer is exit code 1, and nothing moves."""
        STATS["nothing_to_roll_back"] += 1
        live = self.ws.snapshot()
        r = self.ws.cowfs("rollback", check=False)
        assert r.returncode == NOTHING_TO_DO and "nothing to roll back" in r.stderr, (
            r.returncode,
            r.stdout,
            r.stderr,
        )
        treesnap.assert_same(live, self.ws.snapshot())
        self.check_log()

    @rule()
    def remount(self):
        """Unmount and mount again: the tree and the whole stack persist."""
        STATS["remount"] += 1
        live = self.ws.snapshot()
        self.ws.unmount()
        treesnap.assert_same(live, unmounted_view(treesnap.snapshot(self.ws.path)))
        self.ws.mount("--store", self.ws.store)
        treesnap.assert_same(live, self.ws.snapshot())
        self.check_log()

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def live_tree_matches_the_shadow(self):
        if not self.stack:  # before mount()
            return
        diffs = treesnap.compare(treesnap.snapshot(self.shadow), self.ws.snapshot(), mtimes=False)
        assert not diffs, "the mounted tree differs from the native shadow:\n  " + "\n  ".join(
            diffs[:50]
        )


def unmounted_view(snap: treesnap.Snapshot) -> treesnap.Snapshot:
    """The backing tree as the mount shows it.  A file whose replaced or
    unlinked twin was hard-linked into the store (by design: pre-images are
    moved, not copied) has st_nlink > 1 in the backing directory although no
    other name in the tree shares it; the mounted view does not count the
    store's links, so neither does this comparison."""
    group = Counter(e.link for e in snap.values() if e.link is not None)
    return treesnap.Snapshot(
        (rel, dataclasses.replace(e, link=None) if e.link == rel and group[rel] == 1 else e)
        for rel, e in snap.items()
    )


def _lmode(path: str) -> int:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0


def _cowfs_mounts() -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.startswith("fuse.cowfs "):
                out.append(left.split(" ")[4])
    return out


_overrides = {}
if os.environ.get("COWFS_MAX_EXAMPLES"):
    _overrides["max_examples"] = int(os.environ["COWFS_MAX_EXAMPLES"])
# The profile (conftest) is loaded by now and is the parent of these settings.
CowfsModel.TestCase.settings = settings(CowfsModel.TestCase.settings, **_overrides)

TestCowfsModel = CowfsModel.TestCase


class _Environment:
    """Runs the model with ENV set (for the daemons it starts)."""

    ENV: dict[str, str] = {}

    def setUp(self):
        self._saved = {k: os.environ.get(k) for k in self.ENV}
        os.environ.update(self.ENV)

    def tearDown(self):
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class TestCowfsModelPyfuse3(_Environment, TestCowfsModel):
    """The same model on the pyfuse3 engine."""

    ENV = {"COWFS_ENGINE": "pyfuse3"}


class TestCowfsModelSmallBatches(_Environment, TestCowfsModel):
    """The same model with rollbacks in batches of 3 undo steps at most:
    its layers then take many batches each, most of them planned and kept
    while the one before is taken by the daemon's helper process."""

    ENV = {"COWFS_UNDO_BATCH": "3"}


class CowfsModelOnOverlay(CowfsModel):
    """The same model with the workspace on an overlay (as a fork's is):
    the base state is the overlay's lower layer, on a tmpfs of its own, so
    every object the rules first meet is a lower object -- numbered past
    2**63, copied up at its first change (whole data, metadata only, a
    directory with a redirect), served by passthrough through the overlay."""

    def __init__(self):
        super().__init__()
        base = Path(self.tmp)
        os.rmdir(self.ws.path)
        self.lower = base / "lower"
        self.lower.mkdir()
        mount("-t", "tmpfs", "-o", "mode=0755", "cowfs-model", str(self.lower))
        self.overlay = Overlay(base, self.lower)
        self.ws = Workspace(self.overlay.merged / "ws")
        self.ws.store = self.overlay.merged / "store"

    @initialize()
    def mount(self):
        lower_ws = str(self.lower / "ws")
        os.mkdir(lower_ws)
        self.populate(lower_ws)
        copy_tree(lower_ws, self.shadow)
        self.overlay.mount()
        self.ws.mount("--store", self.ws.store)
        layers = self.ws.log()
        assert len(layers) == 1, layers
        self.stack = [Layer(layers[0]["id"], self.ws.snapshot(), self.save_shadow())]

    def teardown(self):
        try:
            self.ws.teardown()
        finally:
            self.overlay.unmount()
            unmount_all(self.lower)
        super().teardown()


# (fewer examples than the others unless asked for more: its base state is
# the same, only its backing differs)
CowfsModelOnOverlay.TestCase.settings = settings(
    CowfsModel.TestCase.settings,
    max_examples=int(os.environ.get("COWFS_MAX_EXAMPLES") or 10),
)


class TestCowfsModelOnOverlay(CowfsModelOnOverlay.TestCase):
    pass
