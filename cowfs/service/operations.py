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
    # what a user other than the owner needs to be granted (``cowfs mount
    # --allow``) to ask for it: "read" or "step" (None: the owner and root only)
    grant: str | None = None


OPERATIONS = (
    Operation("checkpoint", grant="step"),
    Operation("commit", offline=True, long="commit", doing="committing", tree=True, grant="step"),
    Operation(
        "rollback", offline=True, long="rollback", doing="rolling back", tree=True, grant="step"
    ),
    Operation(
        "redo", offline=True, long="redo", doing="redoing the rollback", tree=True, grant="step"
    ),
    Operation("provider_add"),
    Operation("provider_remove"),
    Operation("provider_list", grant="read"),
    Operation("status", offline=True, grant="read"),
    Operation("gc", offline=True, long="gc", doing="freeing unused store space"),
    Operation("changes", offline=True, grant="read"),
    Operation("show", offline=True, grant="read"),
    Operation("diff", offline=True, grant="read"),
    Operation("view", offline=True, grant="read"),
    Operation("audit", offline=True),
    Operation("audit_prune", offline=True),
    Operation("audit_note"),
    Operation("annotate", grant="step"),
    Operation("check", doing="checking the store"),  # (offline: Session.inspect, see check)
    Operation("repair", doing="repairing the store"),
    Operation("log", offline=True, grant="read"),
    Operation("restore", offline=True, long="restore", doing="restoring", grant="step"),
    Operation("fork", doing="making the fork"),
    Operation("forks", offline=True, grant="read"),
    Operation("fork_changes"),
    Operation("fork_compare"),
    Operation("adopt", long="adopt", doing="adopting the fork"),
    Operation("drop", offline=True, long="drop", doing="dropping the fork"),
)

# what each grant lets a user other than the owner ask for: the operations
# declared with it, "step" those of "read" too, and any grant the daemon's ping
GRANTED = {"read": frozenset({"ping", *(op.name for op in OPERATIONS if op.grant == "read")})}
GRANTED["step"] = GRANTED["read"] | {op.name for op in OPERATIONS if op.grant == "step"}


def allowed(grants: frozenset[str]) -> frozenset[str]:
    """The operations the grants named *grants* ("read", "step") let a user ask for."""
    return frozenset().union(*(GRANTED.get(g, ()) for g in grants))


BY_NAME = {op.name: op for op in OPERATIONS}
SESSION_OPS = frozenset(BY_NAME)  # what the daemon hands to its session
OFFLINE_OPS = frozenset(op.name for op in OPERATIONS if op.offline)
LONG_OPS = {op.name: op.long for op in OPERATIONS if op.long}
DOING = {op.name: op.doing for op in OPERATIONS if op.doing}
TREE_OPS = tuple(op.name for op in OPERATIONS if op.tree)
