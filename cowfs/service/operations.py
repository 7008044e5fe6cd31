"""The operations of the control channel, each declared once: the session
method that carries it out (named after it), whether it also works on the
store of a workspace that is not mounted, whether it changes the tree or the
store so that it cannot stop half-way, and what its progress says.

The session's table of operations, the client's offline fallback and the
command line's Ctrl-C and progress handling are derived from this list; the
commands and MCP tools that expose the operations are declared in
``commands`` (which names the operations they send).  This module is below
the session (which reads it) and imports nothing of the package.
"""

from __future__ import annotations

from typing import NamedTuple


class Operation(NamedTuple):
    name: str  # the op on the channel = the Session method that carries it out
    offline: bool = False  # also on the store of an unmounted workspace (session.offline)
    long: str | None = None  # cannot stop half-way: what the messages call it
    doing: str | None = None  # what its progress says (a spinner on a terminal)
    tree: bool = False  # puts the tree as the layers say: refused offline after drift


OPERATIONS = (
    Operation("checkpoint"),
    Operation("commit", offline=True, long="commit", doing="committing", tree=True),
    Operation("rollback", offline=True, long="rollback", doing="rolling back", tree=True),
    Operation("redo", offline=True, long="redo", doing="redoing the rollback", tree=True),
    Operation("provider_add"),
    Operation("provider_remove"),
    Operation("provider_list"),
    Operation("status", offline=True),
    Operation("gc", offline=True, long="gc", doing="freeing unused store space"),
    Operation("changes", offline=True),
    Operation("show", offline=True),
    Operation("diff", offline=True),
    Operation("view", offline=True),
    Operation("audit", offline=True),
    Operation("audit_prune", offline=True),
    Operation("audit_note"),
    Operation("annotate"),
    Operation("check", doing="checking the store"),  # (offline: Session.inspect, see check)
    Operation("repair", doing="repairing the store"),
    Operation("log", offline=True),
    Operation("restore", offline=True, long="restore", doing="restoring"),
)

BY_NAME = {op.name: op for op in OPERATIONS}
SESSION_OPS = frozenset(BY_NAME)  # what the daemon hands to its session
OFFLINE_OPS = frozenset(op.name for op in OPERATIONS if op.offline)
LONG_OPS = {op.name: op.long for op in OPERATIONS if op.long}
DOING = {op.name: op.doing for op in OPERATIONS if op.doing}
TREE_OPS = tuple(op.name for op in OPERATIONS if op.tree)
