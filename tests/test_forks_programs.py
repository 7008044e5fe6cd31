"""Real programs in forks, at the same time, while the workspace changes
too: git, gcc and python each in a fork of their own (run at the
workspace's own path), every fork's result compared with the same
commands run natively on a copy of the fork point, then adopted one after
the other -- the workspace ends with each fork's work and its own, and
the conflict the last one makes is named exactly; pip and npm likewise;
and eight forks at once each installing and testing a project (pip,
pytest), the first whose tests pass adopted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from cowfs.interface.api import seen_at
from cowfs.layers import treesnap

from .helpers import COWFS
from .test_forks import fork, forks_of, parent  # noqa: F401  (the fixture)
from .test_programs import C_MAIN, C_UTIL_H, C_UTIL_V1, C_UTIL_V2, GIT, git_env

pytestmark = pytest.mark.slow

SCRIPT = (
    "import json, pathlib, sys\n"
    "out = pathlib.Path('out'); out.mkdir(exist_ok=True)\n"
    "(out / 'report.json').write_text(json.dumps({'cwd': str(pathlib.Path.cwd())}))\n"
    "pathlib.Path('c/util.c').write_text(pathlib.Path('c/util.c').read_text() + '/* py */\\n')\n"
)


def steps(env: dict) -> dict[str, list[list[str]]]:
    """What each fork runs (each a list of commands, in the workspace's root)."""
    return {
        "git": [
            [*GIT, "checkout", "-q", "-b", "feature"],
            ["sh", "-c", "echo 'more words' >> notes.md"],
            [*GIT, "commit", "-qam", "feature work"],
            [*GIT, "gc", "-q"],
        ],
        "gcc": [
            ["sh", "-c", f"printf '%s' '{C_UTIL_V2}' > c/util.c"],
            ["gcc", "-O1", "-Wall", "-c", "c/main.c", "-o", "c/main.o"],
            ["gcc", "-O1", "-Wall", "-c", "c/util.c", "-o", "c/util.o"],
            ["gcc", "-o", "c/prog", "c/main.o", "c/util.o"],
        ],
        "python": [
            ["python3", "-c", SCRIPT],
            ["sh", "-c", "printf 'x = 1\\n' > out/mod.py"],
            ["python3", "-m", "compileall", "-q", "--invalidation-mode", "unchecked-hash", "out"],
        ],
    }


def run_all(cwd: Path, cmds: list[list[str]], env: dict) -> None:
    for cmd in cmds:
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{cmd}: {r.stderr}"


def run_in_forks(ws, plan: dict[str, list[list[str]]], env: dict, meanwhile) -> None:
    """Each fork's commands (``cowfs run --fork``, at the workspace's own
    path), every fork at once, while *meanwhile* changes the workspace."""
    errors: list[str] = []

    def in_fork(name: str) -> None:
        for cmd in plan[name]:
            r = subprocess.run(
                [*COWFS, "run", "--fork", name, "--on-fail", "keep", "--", *cmd],
                cwd=ws.path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if r.returncode != 0:
                errors.append(f"{name}: {cmd}: {r.stderr}")

    threads = [threading.Thread(target=in_fork, args=(n,)) for n in plan]
    for t in threads:
        t.start()
    meanwhile()
    for t in threads:
        t.join()
    assert not errors, errors


def test_git_gcc_and_python_in_forks_at_once_then_adopted(parent, tmp_path):  # noqa: F811
    ws = parent
    env = git_env(tmp_path)
    (ws / "c").mkdir()
    (ws / "c" / "main.c").write_text(C_MAIN)
    (ws / "c" / "util.h").write_text(C_UTIL_H)
    (ws / "c" / "util.c").write_text(C_UTIL_V1)
    (ws / "notes.md").write_text("# notes\n")
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "start"]):
        subprocess.run([*GIT, *cmd], cwd=ws.path, env=env, check=True, capture_output=True)
    native_base = tmp_path / "native-base"
    subprocess.run(["cp", "-a", str(ws.path), str(native_base)], check=True)
    shutil.rmtree(native_base / ".cowfs", ignore_errors=True)  # (mounted: not there anyway)
    plan = steps(env)
    paths = {name: fork(ws, name) for name in plan}
    # every fork at once, each at the workspace's own path; the workspace too

    def meanwhile() -> None:
        for i in range(50):
            (ws / f"parent-{i}.txt").write_text(f"the workspace's own {i}\n")
        with open(ws / "c" / "util.h", "a") as f:
            f.write("/* the workspace's */\n")

    run_in_forks(ws, plan, env, meanwhile)
    # each fork is what the same commands make natively on the fork point
    for name, cmds in plan.items():
        native = tmp_path / f"native-{name}"
        subprocess.run(["cp", "-a", str(native_base), str(native)], check=True)
        run_all(native, cmds, env)
        got = treesnap.snapshot(paths[name])
        want = treesnap.snapshot(native)
        if name == "python":  # (it says where it ran: the workspace's path, as named)
            assert (paths[name] / "out" / "report.json").read_text() == (f'{{"cwd": "{ws.path}"}}')
            want.pop(b"out/report.json"), got.pop(b"out/report.json")
        for snap in (want, got):  # (git's index holds the files' inode and device numbers)
            snap.pop(b".git/index", None)
        diffs = treesnap.compare(want, got, mtimes=False)
        assert not diffs, f"fork {name} differs from the native run:\n" + "\n".join(diffs[:20])
    # adopt: gcc's build, then git's branch; python changed util.c, which
    # gcc's adopted change changed too: a conflict, named exactly
    before = ws.snapshot()
    ws.json("adopt", "gcc")
    r = subprocess.run(["./c/prog"], cwd=ws.path, capture_output=True, text=True, timeout=60)
    assert r.stdout == "42 new build\n"
    ws.json("adopt", "git")
    log = subprocess.run(
        [*GIT, "log", "--format=%s", "feature"],
        cwd=ws.path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert log[:2] == ["feature work", "start"]
    fsck = subprocess.run([*GIT, "fsck"], cwd=ws.path, env=env, capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stderr
    r = ws.cowfs("adopt", "python", check=False)
    assert r.returncode == 15
    assert r.stdout.splitlines() == ["C c/util.c\tfork: M\tworkspace: M"], r.stdout
    ws.json("adopt", "--prefer", "parent", "python")
    assert (ws / "out" / "report.json").exists()
    assert "/* py */" not in (ws / "c" / "util.c").read_text()
    assert (ws / "parent-49.txt").read_text() == "the workspace's own 49\n"
    assert "/* the workspace's */" in (ws / "c" / "util.h").read_text()
    assert forks_of(ws) == {}
    # the three adopts are three layers: rolled back, the workspace is as before
    ws.rollback(ws.log()[-3]["id"])
    treesnap.assert_same(before, ws.snapshot())
    assert os.path.exists(ws / "parent-0.txt")


def make_wheel(where: Path) -> Path:
    """A pure-Python wheel, made here (pip installs it with no index)."""
    import base64
    import hashlib
    import zipfile

    files = {
        "forkpkg/__init__.py": "VALUE = 42\n",
        "forkpkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: forkpkg\nVersion: 1.0\n",
        "forkpkg-1.0.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: cowfs-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append("forkpkg-1.0.dist-info/RECORD,,")
    files["forkpkg-1.0.dist-info/RECORD"] = "\n".join(record) + "\n"
    wheel = where / "forkpkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


def forks_and_a_copy(ws, names, tmp_path: Path) -> tuple[Path, dict[str, Path]]:
    """A copy of the workspace (the fork point, for native runs), and a
    fork of it named each of *names*: where each is mounted."""
    native_base = tmp_path / "native-base"
    subprocess.run(["cp", "-a", str(ws.path), str(native_base)], check=True)
    return native_base, {name: fork(ws, name) for name in names}


def parent_writes(ws) -> None:
    """The workspace's own changes while its forks work."""
    for i in range(50):
        (ws / f"parent-{i}.txt").write_text(f"the workspace's own {i}\n")


def assert_as_native(ws, base: Path, native: Path, cmds, env: dict, forked: Path) -> None:
    """*cmds* run natively on *native*, a copy of *base* (the fork point),
    seen at the workspace's path as the fork ran them (a mount namespace
    of their own), make the tree the fork *forked* holds."""
    subprocess.run(["cp", "-a", str(base), str(native)], check=True)
    for cmd in cmds:
        r = subprocess.run(
            seen_at(str(native), str(ws.path), str(ws.path), cmd),
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
    diffs = treesnap.compare(treesnap.snapshot(native), treesnap.snapshot(forked), mtimes=False)
    assert not diffs, f"fork {forked} differs from the native run:\n" + "\n".join(diffs[:20])


def test_pip_and_npm_in_forks_at_once_then_adopted(parent, tmp_path):  # noqa: F811
    """pip and npm, each in a fork, at once, while the workspace changes:
    each fork is what the same commands make natively on a copy of the
    fork point seen at the same path (a mount namespace of its own); what
    they installed works at the workspace's path, in the fork and once
    adopted; the two adopts rolled back leave the workspace as it was."""
    import sys

    from .test_programs import make_npm_packages, npm_env

    ws = parent
    env = npm_env(tmp_path)
    wheel = make_wheel(tmp_path)
    specs = make_npm_packages(tmp_path / "pkgs", ["left-pad-local", "util-local"])
    (ws / "package.json").write_text('{"name": "app", "version": "1.0.0", "private": true}\n')
    plan = {
        "pip": [
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-compile"]
            + ["--disable-pip-version-check", "--target", "site", str(wheel)],
        ],
        "npm": [["npm", "install", "--offline", "--no-fund", *specs.values()]],
    }
    native_base, paths = forks_and_a_copy(ws, plan, tmp_path)
    run_in_forks(ws, plan, env, lambda: parent_writes(ws))
    check = {
        "pip": [
            sys.executable,
            "-c",
            "import sys; sys.path[:0] = ['site']; import forkpkg; assert forkpkg.VALUE == 42",
        ],
        "npm": ["node", "-e", "if (require('util-local') !== 2) process.exit(1)"],
    }
    for name, cmds in plan.items():
        assert_as_native(ws, native_base, tmp_path / f"native-{name}", cmds, env, paths[name])
        r = subprocess.run(
            [*COWFS, "run", "--fork", name, "--", *check[name]],
            cwd=ws.path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
    before = ws.snapshot()
    for name in plan:
        ws.json("adopt", name)
        r = subprocess.run(check[name], cwd=ws.path, env=env, capture_output=True, timeout=120)
        assert r.returncode == 0, r.stderr
    assert (ws / "parent-49.txt").read_text() == "the workspace's own 49\n"
    assert forks_of(ws) == {}
    ws.rollback(ws.log()[-2]["id"])
    treesnap.assert_same(before, ws.snapshot())


CALC_TESTS = """\
import sys, pathlib
sys.path[:0] = [str(pathlib.Path(__file__).parent.parent / "site")]
from forkpkg import VALUE
from calc import add, scale

def test_add():
    assert add(2, 3) == 5

def test_add_negative():
    assert add(-2, -3) == -5

def test_scale_uses_the_dependency():
    assert scale(1) == VALUE

def test_scale_zero():
    assert scale(0) == 0
"""


def calc_variant(i: int) -> str:
    """Attempt *i* at the project's module: only attempts 5 and 6 are right."""
    plus = "a + b" if i in (5, 6) else f"a + b + {i % 3 or 1}"
    return f"def add(a, b):\n    return {plus}\n\n\ndef scale(x):\n    return x * 42\n"


def test_eight_forks_install_and_test_a_project_at_once_then_the_first_to_pass_is_adopted(
    parent,  # noqa: F811
    tmp_path,
):
    """Best of 8 by hand: eight forks at once, each writing its attempt at
    a module, installing the project's dependency with pip and running its
    tests with pytest (test results and pytest's cache are part of each
    fork's tree), while the workspace changes: every fork is exactly what
    the same commands make natively on a copy of the fork point; the first
    whose tests pass is adopted, the others dropped; the adopt rolled back
    leaves the workspace as it was."""
    import sys

    ws = parent
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    wheel = make_wheel(tmp_path)
    (ws / "tests").mkdir()
    (ws / "tests" / "test_calc.py").write_text(CALC_TESTS)
    (ws / "pytest.ini").write_text("[pytest]\ntestpaths = tests\npythonpath = .\n")
    (ws / "calc.py").write_text("def add(a, b):\n    raise NotImplementedError\n")
    plan = {
        f"try{i}": [
            ["sh", "-c", 'printf "%s" "$1" > calc.py', "attempt", calc_variant(i)],
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-compile"]
            + ["--disable-pip-version-check", "--target", "site", str(wheel)],
            ["sh", "-c", '"$1" -m pytest -q -p no:randomly >/dev/null; echo $? > tested', "pytest"]
            + [sys.executable],
        ]
        for i in range(8)
    }
    native_base, paths = forks_and_a_copy(ws, plan, tmp_path)

    def meanwhile() -> None:
        parent_writes(ws)
        (ws / "calc.py").write_text("def add(a, b):\n    return NotImplemented\n")

    run_in_forks(ws, plan, env, meanwhile)
    outcome = {name: (paths[name] / "tested").read_text().strip() for name in plan}
    assert outcome == {f"try{i}": "0" if i in (5, 6) else "1" for i in range(8)}, outcome
    for name, cmds in plan.items():
        assert (paths[name] / ".pytest_cache").is_dir()
        assert_as_native(ws, native_base, tmp_path / f"native-{name}", cmds, env, paths[name])
    before = ws.snapshot()
    adopted = ws.json("adopt", "try5", "--prefer", "fork")  # (calc.py: both changed it)
    assert [c["path"] for c in adopted["conflicts"]] == ["calc.py"], adopted["conflicts"]
    for name in plan:
        if name != "try5":
            ws.cowfs("drop", name)
    assert forks_of(ws) == {}
    assert (ws / "calc.py").read_text() == calc_variant(5)
    assert (ws / "parent-49.txt").read_text() == "the workspace's own 49\n"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=ws.path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert ws.log()[-1]["message"] == "adopt try5" and ws.log()[-1]["id"] == adopted["layer"]
    ws.rollback(adopted["layer"])
    treesnap.assert_same(before, ws.snapshot())
