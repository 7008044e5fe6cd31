"""Real programs inside a mounted workspace: whatever git, tar, sed, python,
gcc, sqlite3, rm and mv do there, a rollback puts the tree back exactly.

Every test takes a snapshot right before a checkpoint, lets real programs
change the workspace, rolls back, and compares the whole tree (names, types,
bytes, modes, owners, mtimes, symlink targets, xattrs, hard links) with
``treesnap.assert_same``.  Material that lives outside the workspace (source
trees for tarballs, a HOME for git) goes under pytest's ``tmp_path``.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from cowfs.layers import treesnap

T0 = 1_600_000_000  # a fixed, old mtime (2020-09-13), so "unchanged" is visible


# -- helpers -------------------------------------------------------------------------


def sh(cwd, *cmd, env=None, input=None) -> subprocess.CompletedProcess:
    """Run a real program; fail with its stderr if it exits non-zero."""
    argv = [str(c) for c in cmd]
    r = subprocess.run(
        argv, cwd=cwd, env=env, input=input, capture_output=True, text=True, timeout=120
    )
    if r.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} (in {cwd}) exited {r.returncode}:\n"
            f"stdout: {r.stdout}\nstderr: {r.stderr}"
        )
    return r


def settle_mtimes(root: Path, when: int = T0) -> None:
    """Give every entry under root (root included) the same fixed mtime."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in dirnames + filenames:
            os.utime(
                os.path.join(dirpath, name), ns=(when * 10**9, when * 10**9), follow_symlinks=False
            )
        os.utime(dirpath, ns=(when * 10**9, when * 10**9))


def make_project(root: Path) -> None:
    """A small project: sources, docs, a binary blob, a script, a symlink."""
    (root / "src" / "lib").mkdir(parents=True)
    (root / "docs").mkdir()
    (root / "data").mkdir()
    (root / "README.md").write_text("# demo project\n\nSome words.\n")
    (root / "src" / "app.py").write_text("from lib import util\nprint(util.answer())\n")
    (root / "src" / "lib" / "__init__.py").write_text("")
    (root / "src" / "lib" / "util.py").write_text("def answer():\n    return 42\n")
    (root / "docs" / "guide.md").write_text("guide\n" * 50)
    (root / "data" / "blob.bin").write_bytes(os.urandom(300_000))
    (root / "run.sh").write_text("#!/bin/sh\necho run\n")
    os.chmod(root / "run.sh", 0o755)
    os.symlink("docs/guide.md", root / "guide")
    os.setxattr(root / "README.md", "user.note", b"project readme")
    settle_mtimes(root)


def mounted_project(ws) -> None:
    make_project(ws.path)
    ws.mount()


def changed(before: treesnap.Snapshot, after: treesnap.Snapshot) -> list[str]:
    diffs = treesnap.compare(before, after)
    assert diffs, "the program changed nothing; the test would prove nothing"
    return diffs


def git_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        HOME=str(home),
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_AUTHOR_NAME="Test Author",
        GIT_AUTHOR_EMAIL="author@example.com",
        GIT_COMMITTER_NAME="Test Committer",
        GIT_COMMITTER_EMAIL="committer@example.com",
        GIT_AUTHOR_DATE="2024-01-02T03:04:05Z",
        GIT_COMMITTER_DATE="2024-01-02T03:04:05Z",
        GIT_TERMINAL_PROMPT="0",
    )
    return env


GIT = [
    "git",
    "-c",
    "init.defaultBranch=main",
    "-c",
    "gc.auto=0",
    "-c",
    "maintenance.auto=false",
    "-c",
    "advice.detachedHead=false",
]


def git(cwd, env, *args) -> str:
    return sh(cwd, *GIT, *args, env=env).stdout


# -- 1. git --------------------------------------------------------------------------


def test_git_init_commit_branch_switch_then_rollback(workspace, tmp_path):
    ws = workspace
    mounted_project(ws)
    env = git_env(tmp_path)
    before = ws.snapshot()
    ws.checkpoint("git")

    git(ws.path, env, "init", "-q")
    git(ws.path, env, "add", "-A")
    git(ws.path, env, "commit", "-q", "-m", "initial")
    git(ws.path, env, "branch", "feature")
    git(ws.path, env, "switch", "-q", "feature")
    (ws / "src" / "lib" / "util.py").write_text("def answer():\n    return 43\n")
    (ws / "feature.txt").write_text("only on feature\n")
    os.unlink(ws / "docs" / "guide.md")
    git(ws.path, env, "add", "-A")
    git(ws.path, env, "commit", "-q", "-m", "feature work")
    git(ws.path, env, "switch", "-q", "main")  # rewrites the differing files
    assert (ws / "docs" / "guide.md").read_text() == "guide\n" * 50
    assert not (ws / "feature.txt").exists()
    git(ws.path, env, "switch", "-q", "feature")
    assert (ws / "feature.txt").exists()
    assert git(ws.path, env, "rev-parse", "--abbrev-ref", "HEAD").strip() == "feature"
    assert git(ws.path, env, "rev-list", "--count", "HEAD").strip() == "2"
    git(ws.path, env, "fsck", "--no-progress")
    changed(before, ws.snapshot())

    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())
    assert not (ws / ".git").exists()


def make_repo(root: Path, env) -> None:
    """A repository with history on two branches, already packed once."""
    make_project(root)
    git(root, env, "init", "-q")
    git(root, env, "add", "-A")
    git(root, env, "commit", "-q", "-m", "initial")
    git(root, env, "switch", "-q", "-c", "feature")
    (root / "src" / "lib" / "util.py").write_text("def answer():\n    return 7\n")
    (root / "feature.txt").write_text("feature\n")
    git(root, env, "add", "-A")
    git(root, env, "commit", "-q", "-m", "feature 1")
    git(root, env, "switch", "-q", "main")
    git(root, env, "gc", "-q", "--prune=now")  # a pack and packed-refs exist
    (root / "docs" / "guide.md").write_text("main moved on\n")
    git(root, env, "commit", "-q", "-a", "-m", "main 2")  # and a few loose objects
    git(root, env, "tag", "v1")
    settle_mtimes(root, T0 + 100)


def test_git_switch_commit_gc_in_existing_repo_then_rollback(workspace, tmp_path):
    ws = workspace
    env = git_env(tmp_path)
    make_repo(ws.path, env)
    ws.mount()
    head_before = git(ws.path, env, "rev-parse", "HEAD").strip()
    before = ws.snapshot()
    ws.checkpoint("switch + commit + gc")

    git(ws.path, env, "switch", "-q", "feature")
    (ws / "feature.txt").write_text("feature, more\n")
    (ws / "new-on-feature.c").write_text("int main(void) { return 0; }\n")
    git(ws.path, env, "add", "-A")
    git(ws.path, env, "commit", "-q", "-m", "feature 2")
    # Repacks everything: new pack (tmp file + rename), old pack and loose
    # objects unlinked, refs packed (lock file renamed, loose refs unlinked).
    git(ws.path, env, "gc", "-q", "--prune=now", "--aggressive")
    git(ws.path, env, "fsck", "--no-progress", "--strict")
    assert not any((ws / ".git" / "objects").glob("??/*")), "gc left loose objects"
    assert (ws / ".git" / "packed-refs").exists()
    after = ws.snapshot()
    changed(before, after)

    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())
    # The repository works again, at the old state.
    assert git(ws.path, env, "rev-parse", "HEAD").strip() == head_before
    assert git(ws.path, env, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"
    git(ws.path, env, "fsck", "--no-progress", "--strict")
    assert git(ws.path, env, "status", "--porcelain").strip() == ""


def test_git_local_clone_hard_links_objects_then_rollback(workspace, tmp_path):
    ws = workspace
    env = git_env(tmp_path)
    (ws / "repo").mkdir()
    make_repo(ws / "repo", env)
    settle_mtimes(ws.path, T0 + 200)
    ws.mount()
    before = ws.snapshot()
    ws.checkpoint("clone")

    # A local clone hard-links the object files of the source repository.
    sh(ws.path, *GIT, "clone", "-q", "--no-checkout", "repo", "clone", env=env)
    git(ws / "clone", env, "checkout", "-q", "feature")
    packs = list((ws / "clone" / ".git" / "objects" / "pack").glob("*.pack"))
    assert packs and any(os.stat(p).st_nlink == 2 for p in packs)
    git(ws / "repo", env, "gc", "-q", "--prune=now")  # unlinks one name of the links
    git(ws / "clone", env, "fsck", "--no-progress")
    changed(before, ws.snapshot())

    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


# -- 2. tar --------------------------------------------------------------------------


LONG_DIR = "d" * 150
LONG_NAME = "n" * 200


def make_tar_tree(src: Path) -> None:
    """Nested dirs, symlinks, hard links, odd modes, long names, mtimes, xattrs."""
    src.mkdir()
    (src / "top.txt").write_text("top\n")
    (src / "bin").mkdir()
    (src / "bin" / "run").write_text("#!/bin/sh\necho hi\n")
    os.chmod(src / "bin" / "run", 0o755)
    (src / "secret").write_text("s3cret\n")
    os.chmod(src / "secret", 0o600)
    (src / "setuid").write_bytes(b"\x7fELF-ish")
    os.chmod(src / "setuid", 0o4755)
    (src / "sticky").mkdir()
    os.chmod(src / "sticky", 0o1777)
    deep = src / "deep" / "a" / "b" / "c" / "d" / "e"
    deep.mkdir(parents=True)
    (deep / "leaf.txt").write_text("leaf\n")
    (src / LONG_DIR).mkdir()
    (src / LONG_DIR / LONG_NAME).write_text("a long path\n")
    (src / "ünïcødé ñame.txt").write_text("unicode\n")
    (src / "big.bin").write_bytes(os.urandom(1_500_000))
    os.link(src / "top.txt", src / "deep" / "a" / "hard-top")
    os.link(src / "big.bin", src / LONG_DIR / "big-link")
    os.symlink("top.txt", src / "link-to-top")
    os.symlink("deep/a", src / "link-to-dir")
    os.symlink("nowhere/at/all", src / "dangling")
    os.symlink("/etc/hostname", src / "absolute")
    (src / "empty").mkdir()
    os.chmod(src / "empty", 0o700)
    os.mkfifo(src / "fifo")
    os.setxattr(src / "top.txt", "user.origin", b"tarball")
    os.setxattr(src / "deep", "user.dirtag", b"deep")
    settle_mtimes(src, T0 - 86_400)
    os.utime(src / "top.txt", ns=(T0 * 10**9, 1_234_567_890_123_456_789 // 1000 * 1000))
    os.utime(src / "deep" / "a" / "b", ns=(T0 * 10**9, 1_000_000_000 * 10**9))
    os.chmod(src, 0o750)


def make_tarball(src: Path, tarball: Path) -> None:
    sh(src, "tar", "--xattrs", "--xattrs-include=*", "--format=posix", "-cf", tarball, ".")


def extract(ws, tarball, *extra, into=".") -> None:
    sh(ws.path, "tar", "--xattrs", "--xattrs-include=*", "-xpf", tarball, *extra, "-C", into)


def test_tar_extract_into_workspace_then_rollback(workspace, tmp_path):
    ws = workspace
    src = tmp_path / "src"
    make_tar_tree(src)
    tarball = tmp_path / "tree.tar"
    make_tarball(src, tarball)
    mounted_project(ws)
    before = ws.snapshot()
    ws.checkpoint("tar -x")

    (ws / "dest").mkdir()
    extract(ws, tarball, into="dest")
    # What tar made through the mount is exactly the source tree.
    treesnap.assert_same(treesnap.snapshot(src), treesnap.snapshot(ws / "dest"))
    # And once more straight into the workspace root ("./" retimes/chmods the root).
    extract(ws, tarball)
    assert stat.S_IMODE(os.stat(ws.path).st_mode) == 0o750
    changed(before, ws.snapshot())

    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


@pytest.mark.parametrize(
    "mode",
    [[], ["--overwrite"], ["--recursive-unlink"]],
    ids=["default-unlink", "overwrite", "recursive-unlink"],
)
def test_tar_extract_over_existing_files_then_rollback(workspace, tmp_path, mode):
    ws = workspace
    src = tmp_path / "src"
    make_tar_tree(src)
    tarball = tmp_path / "tree.tar"
    make_tarball(src, tarball)
    # The workspace already holds an older, different version of the tree.
    dest = ws / "dest"
    old = tmp_path / "old"
    make_tar_tree(old)
    (old / "top.txt").write_text("old top, longer than the new one\n")
    (old / "big.bin").write_bytes(os.urandom(700_000))  # still hard-linked
    os.unlink(old / "link-to-top")
    (old / "link-to-top").write_text("a file where the tar has a symlink\n")
    os.unlink(old / "secret")
    os.symlink("top.txt", old / "secret")  # a symlink where the tar has a file
    os.chmod(old / "bin" / "run", 0o700)
    (old / "only-old.txt").write_text("tar leaves me alone\n")
    os.setxattr(old / "top.txt", "user.origin", b"old")
    settle_mtimes(old, T0 + 1000)
    sh(tmp_path, "cp", "-a", old, dest)  # keeps hard links, fifo, xattrs
    settle_mtimes(dest, T0 + 1000)
    ws.mount()
    before = ws.snapshot()
    ws.checkpoint("tar -x over existing")

    extract(ws, tarball, *mode, into="dest")
    assert (dest / "top.txt").read_text() == "top\n"
    assert os.readlink(dest / "link-to-top") == "top.txt"
    assert not (dest / "secret").is_symlink()
    # --recursive-unlink empties an existing directory before extracting into it.
    assert (dest / "only-old.txt").exists() == (mode != ["--recursive-unlink"])
    changed(before, ws.snapshot())

    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())
    assert (dest / "top.txt").read_text() == "old top, longer than the new one\n"


# -- 3. sed -i -----------------------------------------------------------------------


def test_sed_in_place_on_several_files_then_rollback(workspace):
    ws = workspace
    mounted_project(ws)
    (ws / "conf").mkdir()
    for i in range(5):
        (ws / "conf" / f"c{i}.conf").write_text(f"name = old{i}\nport = {8000 + i}\n" * 20)
    os.chmod(ws / "conf" / "c1.conf", 0o600)
    os.setxattr(ws / "conf" / "c2.conf", "user.owner", b"ops")  # sed -i drops it
    os.link(ws / "conf" / "c3.conf", ws / "c3-hardlink.conf")  # sed -i breaks the link
    os.symlink("conf/c4.conf", ws / "c4-symlink.conf")
    settle_mtimes(ws.path, T0 + 5)
    before = ws.snapshot()
    ws.checkpoint("sed -i")

    sh(
        ws.path,
        "sed",
        "-i",
        "s/old/new/; s/port = 80/port = 90/",
        *(f"conf/c{i}.conf" for i in range(4)),
        "README.md",
        "src/lib/util.py",
    )
    sh(ws.path, "sed", "-i", "--follow-symlinks", "1i # edited via a symlink", "c4-symlink.conf")
    sh(ws.path, "sed", "-i.bak", "s/guide/GUIDE/g", "docs/guide.md")  # leaves a backup
    assert "new0" in (ws / "conf" / "c0.conf").read_text()
    assert os.stat(ws / "c3-hardlink.conf").st_nlink == 1
    assert os.path.islink(ws / "c4-symlink.conf")
    assert (ws / "docs" / "guide.md.bak").exists()
    assert not [n for n in os.listdir(ws / "conf") if n.startswith("sed")]
    changed(before, ws.snapshot())

    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


# -- 4. python -----------------------------------------------------------------------


def python_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "PYTHONDONTWRITEBYTECODE",
            "PYTHONPYCACHEPREFIX",
            "SOURCE_DATE_EPOCH",
            "VIRTUAL_ENV",
            "PYTHONHOME",
            "PYTHONPATH",
        )
    }
    return env


def test_python_compileall_then_rollback(workspace):
    ws = workspace
    mounted_project(ws)
    pkg = ws / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("VERSION = '1'\n")
    (pkg / "mod.py").write_text("def f(x):\n    return x * 2\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "deep.py").write_text("import pkg.mod\nVALUE = pkg.mod.f(21)\n")
    settle_mtimes(ws.path, T0 + 7)
    before = ws.snapshot()
    ws.checkpoint("compileall")

    sh(ws.path, "python3", "-m", "compileall", "-q", "pkg", "src", env=python_env())
    assert list((pkg / "sub" / "__pycache__").glob("deep.*.pyc"))
    r = sh(ws.path, "python3", "-c", "import pkg.sub.deep as d; print(d.VALUE)", env=python_env())
    assert r.stdout.strip() == "42"
    changed(before, ws.snapshot())

    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())
    assert not (pkg / "__pycache__").exists()


def test_python_venv_creation_then_rollback(workspace):
    ws = workspace
    mounted_project(ws)
    before = ws.snapshot()
    ws.checkpoint("venv")

    sh(ws.path, "python3", "-m", "venv", "--without-pip", ".venv", env=python_env())
    r = sh(
        ws.path,
        ws / ".venv" / "bin" / "python",
        "-c",
        "import sys; print(sys.prefix != sys.base_prefix)",
        env=python_env(),
    )
    assert r.stdout.strip() == "True"
    assert (ws / ".venv" / "pyvenv.cfg").exists()
    changed(before, ws.snapshot())

    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


# -- 5. gcc --------------------------------------------------------------------------


C_MAIN = (
    '#include <stdio.h>\n#include "util.h"\nint main(void) {\n'
    '    printf("%d %s\\n", twice(21), greeting());\n    return 0;\n}\n'
)
C_UTIL_H = "int twice(int x);\nconst char *greeting(void);\n"
C_UTIL_V1 = (
    '#include "util.h"\nint twice(int x) { return 2 * x; }\n'
    'const char *greeting(void) { return "old"; }\n'
)
C_UTIL_V2 = (
    '#include "util.h"\nint twice(int x) { return x + x; }\n'
    'const char *greeting(void) { return "new build"; }\n'
)


def build(cwd) -> None:
    sh(cwd, "gcc", "-O1", "-Wall", "-c", "main.c", "util.c")
    sh(cwd, "gcc", "-o", "prog", "main.o", "util.o")


def test_gcc_compile_and_link_then_rollback(workspace):
    ws = workspace
    make_project(ws.path)
    c = ws / "c"
    c.mkdir()
    (c / "main.c").write_text(C_MAIN)
    (c / "util.h").write_text(C_UTIL_H)
    (c / "util.c").write_text(C_UTIL_V1)
    sh(c, "gcc", "-o", "prog", "main.c", "util.c")  # an older binary, no objects yet
    settle_mtimes(ws.path, T0 + 9)
    ws.mount()
    assert sh(c, "./prog").stdout == "42 old\n"
    before = ws.snapshot()
    ws.checkpoint("gcc")

    (c / "util.c").write_text(C_UTIL_V2)
    build(c)
    assert (c / "main.o").exists() and (c / "util.o").exists()
    assert sh(c, "./prog").stdout == "42 new build\n"
    changed(before, ws.snapshot())

    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())
    assert sh(c, "./prog").stdout == "42 old\n"


def test_gcc_build_in_scratch_dir_install_and_clean_then_rollback(workspace):
    """The usual build pattern: compile in a fresh scratch directory, install the
    result elsewhere with mv, remove the scratch directory."""
    ws = workspace
    make_project(ws.path)
    (ws / "c").mkdir()
    (ws / "c" / "main.c").write_text(C_MAIN)
    (ws / "c" / "util.h").write_text(C_UTIL_H)
    (ws / "c" / "util.c").write_text(C_UTIL_V1)
    (ws / "bin").mkdir()
    settle_mtimes(ws.path, T0 + 10)
    ws.mount()
    before = ws.snapshot()
    ws.checkpoint("build, install, clean")

    sh(ws.path, "mkdir", "-p", "build/obj")
    sh(ws.path, "gcc", "-c", "c/main.c", "-o", "build/obj/main.o")
    sh(ws.path, "gcc", "-c", "c/util.c", "-o", "build/obj/util.o")
    sh(ws.path, "gcc", "-o", "build/prog", "build/obj/main.o", "build/obj/util.o")
    sh(ws.path, "mv", "build/prog", "bin/prog")
    sh(ws.path, "rm", "-rf", "build")
    assert sh(ws.path, "bin/prog").stdout == "42 old\n"
    changed(before, ws.snapshot())

    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())
    assert not (ws / "bin" / "prog").exists()


# -- 6. sqlite3 ----------------------------------------------------------------------


SELECT = "select id, name, qty from items order by id;"


def test_sqlite_transactions_then_rollback(workspace):
    ws = workspace
    mounted_project(ws)
    s0 = ws.snapshot()
    first = ws.checkpoint("create db")

    sh(
        ws.path,
        "sqlite3",
        "app.db",
        input=(
            "pragma journal_mode=delete;\n"
            "create table items (id integer primary key, name text, qty integer, pad blob);\n"
            "create index items_name on items(name);\n"
            "begin;\n"
            + "".join(
                f"insert into items values ({i}, 'item{i}', {i * 10}, randomblob(300));\n"
                for i in range(1, 401)
            )
            + "commit;\n"
        ),
    )
    rows_v1 = sh(ws.path, "sqlite3", "app.db", SELECT).stdout
    assert rows_v1.count("\n") == 400
    s1 = ws.snapshot()
    db_v1 = (ws / "app.db").read_bytes()
    ws.checkpoint("modify rows")

    # Pages rewritten in place; app.db-journal is created and deleted per transaction.
    sh(
        ws.path,
        "sqlite3",
        "app.db",
        input=(
            "begin;\n"
            "update items set qty = qty + 1, name = 'renamed' || id where id % 3 = 0;\n"
            "delete from items where id between 100 and 150;\n"
            "insert into items values (1000, 'late', 1, randomblob(5000));\n"
            "commit;\n"
            "begin;\nupdate items set qty = -1 where id = 1;\ncommit;\n"
        ),
    )
    rows_v2 = sh(ws.path, "sqlite3", "app.db", SELECT).stdout
    assert rows_v2 != rows_v1
    assert not (ws / "app.db-journal").exists()
    changed(s1, ws.snapshot())

    ws.rollback()
    treesnap.assert_same(s1, ws.snapshot())
    assert (ws / "app.db").read_bytes() == db_v1
    assert sh(ws.path, "sqlite3", "app.db", SELECT).stdout == rows_v1
    assert sh(ws.path, "sqlite3", "app.db", "pragma integrity_check;").stdout.strip() == "ok"

    ws.rollback(to=first)
    treesnap.assert_same(s0, ws.snapshot())
    assert not (ws / "app.db").exists()


def test_sqlite_wal_mode_then_rollback(workspace):
    ws = workspace
    mounted_project(ws)
    sh(
        ws.path,
        "sqlite3",
        "wal.db",
        input=(
            "pragma journal_mode=wal;\n"
            "create table t (id integer primary key, v text);\n"
            + "".join(f"insert into t values ({i}, 'v{i}');\n" for i in range(200))
        ),
    )
    rows_v1 = sh(ws.path, "sqlite3", "wal.db", "select * from t order by id;").stdout
    before = ws.snapshot()
    ws.checkpoint("wal writes")

    # The -wal file and the mmapped -shm file come and go with the connection.
    sh(
        ws.path,
        "sqlite3",
        "wal.db",
        input=(
            "begin;\nupdate t set v = 'changed' where id % 2 = 0;\ncommit;\n"
            "delete from t where id > 150;\n"
        ),
    )
    assert (
        sh(
            ws.path, "sqlite3", "wal.db", "select count(*) from t where v = 'changed';"
        ).stdout.strip()
        == "76"
    )
    changed(before, ws.snapshot())

    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())
    assert sh(ws.path, "sqlite3", "wal.db", "select * from t order by id;").stdout == rows_v1


# -- 7. rm -rf -----------------------------------------------------------------------


def test_rm_rf_subtree_then_rollback(workspace):
    ws = workspace
    make_project(ws.path)
    v = ws / "victim"
    (v / "a" / "b" / "c").mkdir(parents=True)
    (v / "ro").mkdir()
    (v / "top.txt").write_text("top\n")
    (v / "a" / "mid.txt").write_text("mid\n" * 1000)
    (v / "a" / "b" / "c" / "deep.bin").write_bytes(os.urandom(2_100_000))
    (v / "ro" / "locked.txt").write_text("locked\n")
    os.chmod(v / "ro" / "locked.txt", 0o444)
    os.chmod(v / "ro", 0o555)
    os.symlink("top.txt", v / "link")
    os.symlink("a/b", v / "dirlink")
    os.symlink("../docs", v / "outlink")  # rm must not follow it
    os.symlink("/nonexistent/target", v / "dangling")
    os.mkfifo(v / "a" / "fifo")
    os.link(ws / "README.md", v / "readme-hardlink")  # a link to a survivor
    os.link(v / "a" / "mid.txt", v / "a" / "b" / "mid-again")  # links inside the tree
    os.setxattr(v / "a", "user.dir", b"attr on a dir")
    os.setxattr(v / "top.txt", "user.file", b"attr on a file")
    settle_mtimes(ws.path, T0 + 11)
    os.chmod(v, 0o711)
    ws.mount()
    before = ws.snapshot()
    ws.checkpoint("rm -rf")

    sh(ws.path, "rm", "-rf", "victim")
    assert not (ws / "victim").exists()
    assert os.stat(ws / "README.md").st_nlink == 1
    assert (ws / "docs" / "guide.md").exists()
    changed(before, ws.snapshot())

    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())
    assert os.stat(ws / "README.md").st_nlink == 2


# -- 8. mv ---------------------------------------------------------------------------


def test_mv_directories_then_rollback(workspace):
    ws = workspace
    make_project(ws.path)
    (ws / "archive").mkdir()
    (ws / "archive" / "old.txt").write_text("old\n")
    (ws / "empty-target").mkdir()
    os.chmod(ws / "empty-target", 0o700)
    os.setxattr(ws / "empty-target", "user.keep", b"me")
    (ws / "build").mkdir()
    (ws / "build" / "out").mkdir()
    (ws / "build" / "out" / "artifact").write_bytes(os.urandom(50_000))
    os.symlink("out/artifact", ws / "build" / "latest")
    (ws / "notes.txt").write_text("notes\n")
    (ws / "todo.txt").write_text("todo\n")
    settle_mtimes(ws.path, T0 + 13)
    ws.mount()
    before = ws.snapshot()
    ws.checkpoint("mv")

    sh(ws.path, "mv", "src", "source")  # rename a dir with content
    sh(ws.path, "mv", "docs", "archive/")  # move a dir into another dir
    sh(ws.path, "mv", "-T", "build", "empty-target")  # replace an empty dir
    sh(ws.path, "mv", "source/lib", "archive/docs/")  # a nested dir, across parents
    sh(ws.path, "mv", "notes.txt", "todo.txt")  # a file over a file
    sh(ws.path, "mv", "archive", "data/")  # and the moved dirs again
    assert (ws / "data" / "archive" / "docs" / "lib" / "util.py").exists()
    assert (ws / "empty-target" / "out" / "artifact").exists()
    assert os.readlink(ws / "empty-target" / "latest") == "out/artifact"
    assert (ws / "todo.txt").read_text() == "notes\n"
    changed(before, ws.snapshot())

    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


# -- 9. several steps, a commit in the middle, rollback --to the first ---------------


def test_many_programs_checkpoints_commit_and_rollback_to_first(workspace, tmp_path):
    ws = workspace
    env = git_env(tmp_path)
    mounted_project(ws)
    (ws / "c").mkdir()
    (ws / "c" / "main.c").write_text(C_MAIN)
    (ws / "c" / "util.h").write_text(C_UTIL_H)
    (ws / "c" / "util.c").write_text(C_UTIL_V1)
    src = tmp_path / "src"
    make_tar_tree(src)
    tarball = tmp_path / "tree.tar"
    make_tarball(src, tarball)

    s0 = ws.snapshot()
    first = ws.checkpoint("git init")
    git(ws.path, env, "init", "-q")
    git(ws.path, env, "add", "-A")
    git(ws.path, env, "commit", "-q", "-m", "initial")

    s1 = ws.snapshot()
    second = ws.checkpoint("sed + commit")
    sh(ws.path, "sed", "-i", "s/return 42/return 6 * 7/", "src/lib/util.py")
    sh(ws.path, "sed", "-i", "s/old/older/", "c/util.c")
    git(ws.path, env, "commit", "-q", "-a", "-m", "edits")

    ws.checkpoint("build")
    build(ws / "c")
    sh(ws.path, "python3", "-m", "compileall", "-q", "src", env=python_env())
    assert sh(ws / "c", "./prog").stdout == "42 older\n"

    live = ws.snapshot()
    res = ws.commit()  # merges "build" into "sed + commit"
    assert res["into"] == second
    treesnap.assert_same(live, ws.snapshot())
    assert [layer["id"] for layer in ws.log()][-1] == second

    s3 = ws.snapshot()
    ws.checkpoint("clean + extract + mv")
    sh(ws.path, "rm", "-rf", "c", "src")
    (ws / "vendor").mkdir()
    extract(ws, tarball, into="vendor")
    sh(ws.path, "mv", "vendor", "docs/")
    git(ws.path, env, "add", "-A")
    git(ws.path, env, "commit", "-q", "-m", "restructure")
    git(ws.path, env, "gc", "-q", "--prune=now")
    changed(s3, ws.snapshot())

    ws.rollback(to=first)
    treesnap.assert_same(s0, ws.snapshot())
    assert all(layer["id"] < first for layer in ws.log())
    assert not (ws / ".git").exists()
    # Nothing from any of the steps is left, and s1 really differed.
    changed(s0, s1)


def make_npm_packages(root: Path, names: list[str]) -> dict[str, str]:
    """Local npm packages packed as tarballs (npm ci installs them with no
    registry): name -> the tarball's file: spec."""
    specs = {}
    for i, name in enumerate(names):
        src = root / name
        (src / "lib").mkdir(parents=True)
        (src / "package.json").write_text(
            f'{{"name": "{name}", "version": "1.0.{i}", "main": "lib/index.js"}}\n'
        )
        for k in range(8):
            (src / "lib" / f"m{k}.js").write_text(f"module.exports = {k * (i + 1)};\n")
        (src / "lib" / "index.js").write_text("module.exports = require('./m1');\n")
        (src / "bin.js").write_text("#!/usr/bin/env node\n")
        os.chmod(src / "bin.js", 0o755)
        packed = sh(root, "npm", "pack", "--silent", "--pack-destination", root, src).stdout
        specs[name] = "file:" + str(root / packed.strip().splitlines()[-1])
    return specs


def npm_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "npm-home"
    home.mkdir(exist_ok=True)
    return {
        **os.environ,
        "HOME": str(home),
        "npm_config_cache": str(home / "cache"),
        "npm_config_update_notifier": "false",
        "npm_config_fund": "false",
        "npm_config_audit": "false",
    }


def test_npm_ci_over_the_same_tree_is_no_change_then_a_rollback(workspace, tmp_path):
    """`npm ci` removes node_modules and installs it again: over a lock
    file that did not change, the tree it makes is the one that was there,
    and `status`, `diff` and `log` say so (no change); a rollback after a
    real change of a dependency is exact."""
    ws = workspace
    ws.mount()
    env = npm_env(tmp_path)
    specs = make_npm_packages(tmp_path / "pkgs", ["left-pad-local", "util-local", "tool-local"])
    deps = ", ".join(f'"{n}": "{s}"' for n, s in specs.items())
    (ws / "package.json").write_text(
        f'{{"name": "app", "version": "1.0.0", "dependencies": {{{deps}}}}}\n'
    )
    sh(ws.path, "npm", "install", "--offline", env=env)
    assert (ws / "node_modules" / "util-local" / "lib" / "m7.js").exists()
    ws.commit()
    before = ws.snapshot()
    layer = ws.checkpoint("npm ci")
    sh(ws.path, "npm", "ci", "--offline", env=env)
    assert [(c["path"], c["kind"]) for c in ws.json("status")["changes"]] == []
    assert ws.json("diff")["changes"] == []
    assert [x["changes"] for x in ws.json("log") if x["id"] == layer] == [0]
    # a dependency at another version: only what differs is listed
    pkg = tmp_path / "pkgs" / "util-local"
    (pkg / "lib" / "m3.js").write_text("module.exports = 'three';\n")
    (pkg / "package.json").write_text('{"name": "util-local", "version": "1.1.0"}\n')
    packed = sh(tmp_path / "pkgs", "npm", "pack", "--silent", pkg, env=env).stdout.strip()
    sh(ws.path, "npm", "install", "--offline", f"file:{tmp_path / 'pkgs' / packed}", env=env)
    paths = {c["path"] for c in ws.json("status")["changes"]}
    assert "node_modules/util-local/lib/m3.js" in paths
    assert not any(p.startswith("node_modules/left-pad-local") for p in paths), paths
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())
