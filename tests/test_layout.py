"""The package's shape: its modules import each other one way (no cycle,
counting the imports inside functions too), and what is declared once
stays declared once."""

from __future__ import annotations

import ast
import pathlib
import typing

import cowfs
from cowfs.escalation import policy
from cowfs.interface import command, commands
from cowfs.service import operations, session

PACKAGE = pathlib.Path(cowfs.__file__).parent


def imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package's modules *path* imports, wherever in it (by their names,
    which are unique across the subpackages)."""
    here = path.parent.relative_to(PACKAGE.parent).parts  # ("cowfs", <subpackage>)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[: len(here) - node.level + 1])
            else:
                base = []
            dotted = base + (node.module.split(".") if node.module else [])
            if not dotted or dotted[0] != "cowfs":
                continue
            found.update(dotted[1:])  # (the module itself, or its subpackage)
            if (PACKAGE.parent.joinpath(*dotted) / "__init__.py").exists():
                found.update(a.name for a in node.names)  # (modules of a package)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("cowfs."):
                    found.update(a.name.split(".")[1:])
    return found & modules


def module_files() -> dict[str, pathlib.Path]:
    """Every module of the package, by name."""
    return {
        p.stem: p
        for p in PACKAGE.rglob("*.py")
        if p.stem not in ("__main__", "__init__") or p.parent == PACKAGE
    }


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports(path, set(files)) - {name} for name, path in files.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of *graph* (its modules in order), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_package_imports_one_way():
    graph = import_graph()
    assert "operations" in graph["session"] and "commands" in graph["cli"]  # (it reads them)
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def test_the_cycle_check_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_the_mcp_server_and_the_cli_do_not_import_each_other():
    graph = import_graph()
    assert "cli" not in graph["mcpserver"] and "mcpserver" not in graph["cli"]


def test_the_operations_are_declared_once():
    assert session.OPS == operations.SESSION_OPS
    for c in commands.COMMANDS.values():
        assert set(c.ops) <= operations.SESSION_OPS, c.name
    assert [c.name for c in commands.TOOLS] == [
        name for name, c in commands.COMMANDS.items() if c.tool is not None
    ]


def test_the_run_scopes_are_the_policys():
    # (command keeps its own copy: the policy module is too slow to load at every start)
    assert typing.get_args(command.RunScope) == typing.get_args(policy.RunScope)


def test_a_command_works_offline_when_its_operations_do():
    named = commands.COMMANDS
    assert all(named[c].offline() for c in ("status", "log", "rollback", "diff", "restore"))
    assert not any(named[c].offline() for c in ("checkpoint", "mount", "provider", "run"))


# The subpackages, lowest first: each imports only from those before it (and
# the top-level modules every layer shares), as the README's layer drawing says.
LAYERS = ["system", "storage", "layers", "fuse", "escalation", "service", "interface"]
# Imports against that order, each with its reason.
UPWARD = {
    # a view process reports that it is ready the way every process that
    # ``launch.start_and_wait`` starts does
    ("view", "launch"),
}


def test_the_subpackages_import_downward_only():
    files = module_files()
    layer = {
        name: (path.parent.name if path.parent != PACKAGE else None) for name, path in files.items()
    }
    rank = {name: LAYERS.index(pkg) if pkg else -1 for name, pkg in layer.items()}
    upward = {
        (m, d)
        for m, deps in import_graph().items()
        for d in deps
        if layer[m] is not None and rank[d] > rank[m]
    }
    assert upward == UPWARD
    assert sorted(
        p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"
    ) == sorted(LAYERS)
