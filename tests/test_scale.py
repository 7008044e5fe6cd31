"""Layers of tens of thousands of renames: the net changes (`status`,
`diff`), the view of a layer and `show` must equal what comparing the trees
directly says, and a rollback must give the tree back exactly -- the
journal reader that makes these linear in the layer's size is proven exact
here, on generated renames of nested directories and files, exchanges,
replacements (write a temporary file, rename it over), new files and
removals."""

from __future__ import annotations

import os
import random
import stat
import subprocess

import pytest
import xxhash

from cowfs.layers import treesnap
from cowfs.system import backing as B

from .helpers import COWFS, backing_dir, managed_workspace

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fuse")]

TOP, SUB, FILES = 12, 8, 24  # a base tree of 12 * 8 * 24 = 2,304 files
RENAMES = 24_000  # operations in all, over two layers


def inode_tree(root) -> dict[str, tuple[int, bool]]:
    """Path (relative) -> (inode, is a directory) of everything under *root*
    (the backing directory: inode numbers in the mount are the daemon's)."""
    out = {}
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        for name in dirs + files:
            p = name if rel == "." else f"{rel}/{name}"
            if p == ".cowfs":
                continue
            st = os.lstat(os.path.join(d, name))
            out[p] = (st.st_ino, stat.S_ISDIR(st.st_mode))
        if rel == ".":
            dirs[:] = [x for x in dirs if x != ".cowfs"]
    return out


def expected_changes(then: dict, now: dict) -> dict[str, tuple]:
    """The net changes from tree *then* to tree *now*, compared directly by
    object identity: an object whose own name or directory changed is
    renamed (R, from its old path; not one that only moved with a directory
    above it); one that is gone is deleted (D, at its old path) unless a new
    object stands where it would be now (M: every new file here has new
    bytes); other new objects are added (A)."""
    ino_then = {ino: p for p, (ino, _) in then.items()}
    ino_now = {ino: p for p, (ino, _) in now.items()}

    def place(p: str) -> str | None:
        """Where path *p* (then) is now, with its directory."""
        head, _, name = p.rpartition("/")
        if not head:
            return p
        here = ino_now.get(then[head][0])
        return None if here is None else f"{here}/{name}"

    out: dict[str, tuple] = {}
    accounted = set()
    for p, (ino, _) in then.items():
        q = ino_now.get(ino)
        at = place(p)
        if q is None:
            if at not in now:
                out[p] = ("D",)
            elif now[at][0] not in ino_then:
                out[at] = ("M",)
                accounted.add(now[at][0])
            # (else a renamed object took its place: listed as renamed)
        elif q != at:
            out[q] = ("R", p)
    for q, (ino, _) in now.items():
        if ino not in ino_then and ino not in accounted:
            out[q] = ("A",)
    return out


def listed(changes: list[dict]) -> dict[str, tuple]:
    return {
        c["path"]: (c["kind"], c["from"]) if c["kind"] == "R" else (c["kind"],) for c in changes
    }


class Shuffler:
    """Generates the operations, keeping its own list of what is where."""

    def __init__(self, root, rng: random.Random):
        self.root = str(root)
        self.rng = rng
        self.files: list[str] = []
        self.dirs: list[str] = []
        for p, (_, is_dir) in sorted(inode_tree(root).items()):
            (self.dirs if is_dir else self.files).append(p)
        self.n = 0

    def abs(self, p: str) -> str:
        return os.path.join(self.root, p)

    def fresh(self, d: str) -> str:
        self.n += 1
        return f"{d}/n{self.n}" if d else f"n{self.n}"

    def step(self) -> None:
        r = self.rng.random()
        files, dirs = self.files, self.dirs
        if r < 0.40:  # a file renamed, maybe elsewhere
            i = self.rng.randrange(len(files))
            dst = self.fresh(self.rng.choice(dirs + [""]))
            os.rename(self.abs(files[i]), self.abs(dst))
            files[i] = dst
        elif r < 0.60:  # written and renamed over (sed -i)
            p = self.rng.choice(files)
            tmp = self.fresh(p.rpartition("/")[0])
            with open(self.abs(tmp), "w") as f:
                f.write(f"replaced {self.n}\n")
            os.rename(self.abs(tmp), self.abs(p))
        elif r < 0.70:  # two files exchanged
            a, b = self.rng.sample(range(len(files)), 2)
            B.renameat2(
                -100,
                os.fsencode(self.abs(files[a])),
                -100,
                os.fsencode(self.abs(files[b])),
                B.RENAME_EXCHANGE,
            )
        elif r < 0.80:  # a new file
            p = self.fresh(self.rng.choice(dirs + [""]))
            with open(self.abs(p), "w") as f:
                f.write(f"new {self.n}\n")
            files.append(p)
        elif r < 0.88:  # a file removed
            p = files.pop(self.rng.randrange(len(files)))
            os.unlink(self.abs(p))
        else:  # a directory renamed, with all in it
            d = self.rng.choice(dirs)
            targets = [x for x in dirs + [""] if x != d and not x.startswith(d + "/")]
            dst = self.fresh(self.rng.choice(targets))
            os.rename(self.abs(d), self.abs(dst))
            move = {p: dst + p[len(d) :] for p in dirs + files if p == d or p.startswith(d + "/")}
            self.dirs = [move.get(p, p) for p in dirs]
            self.files = [move.get(p, p) for p in files]


def test_tens_of_thousands_of_renames_are_listed_viewed_and_undone_exactly(tmp_path):
    with managed_workspace(tmp_path / "ws") as ws:
        for t in range(TOP):
            for s in range(SUB):
                d = ws / f"t{t}" / f"s{s}"
                d.mkdir(parents=True)
                for f in range(FILES):
                    (d / f"f{f}.txt").write_text(f"{t}/{s}/{f}\n")
        ws.mount()
        rng = random.Random(12)
        shuffler = Shuffler(ws.path, rng)
        snaps, trees, layers = [], [], []
        for half in range(2):
            snaps.append(ws.snapshot())
            trees.append(inode_tree(backing_dir(ws)))
            layers.append(ws.checkpoint(f"half {half}"))
            for _ in range(RENAMES // 2):
                shuffler.step()
        now = inode_tree(backing_dir(ws))

        # the open layer, and both layers together, as compared directly
        assert listed(ws.json("status")["changes"]) == expected_changes(trees[1], now)
        since_first = ws.json("diff", "--name-status", str(layers[0]))["changes"]
        assert listed(since_first) == expected_changes(trees[0], now)
        assert listed(
            ws.json("rollback", "--dry-run", "--to", str(layers[0]))["changes"]
        ) == expected_changes(trees[0], now)

        # each layer's start, as the view shows it and `show` reads it
        for layer, snap, tree in zip(layers, snaps, trees, strict=False):
            view = tmp_path / f"view{layer}"
            view.mkdir()
            ws.cowfs("view", str(layer), str(view))
            try:
                treesnap.assert_same(snap, treesnap.snapshot(view))
            finally:
                subprocess.run(["umount", str(view)], check=True)
            some = rng.sample(sorted(p for p, (_, d) in tree.items() if not d), 20)
            for p in some:
                shown = subprocess.run(
                    [*COWFS, "-C", str(ws.path), "show", f"{layer}:{p}"],
                    capture_output=True,
                    check=True,
                ).stdout
                assert xxhash.xxh3_128_hexdigest(shown) == snap[os.fsencode(p)].digest

        ws.json("rollback", "--to", str(layers[1]))
        treesnap.assert_same(snaps[1], ws.snapshot())
        assert ws.json("redo")["restored"] == [layers[1]]
        assert inode_tree(backing_dir(ws)) == now  # the very same objects
        ws.json("rollback", "--to", str(layers[0]))
        treesnap.assert_same(snaps[0], ws.snapshot())
