"""The package's shape: its modules import each other one way (no cycle,
counting the imports inside functions too), and what is declared once
stays declared once."""

from __future__ import annotations

import ast
import pathlib
import typing

import cowfs
from cowfs import command, commands, operations, policy, session

PACKAGE = pathlib.Path(cowfs.__file__).parent


def imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package's modules *path* imports, wherever in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(a.name for a in node.names)
            elif node.module and node.module.split(".")[0] == "cowfs":
                parts = node.module.split(".")
                found.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("cowfs."))
    return found & modules


def import_graph() -> dict[str, set[str]]:
    files = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem != "__main__"}
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
