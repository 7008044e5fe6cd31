"""The escalation policy of ``cowfs run --scope auto``: which commands need
no checkpoint, which need the workspace files only, and which change the
machine outside the workspace and so escalate to a container or VM snapshot.

The rules are data, in ``policy.toml`` next to this module (documented
there), extended by the user's own policy files, read first.  A command is
classified without running it: shell strings are split into simple commands,
wrappers looked through, paths resolved against the workspace.

Also here: the watch on containers that a run did not snapshot, which
compares ``docker diff`` before and after it to tell what changed outside
the workspace and was not captured.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Literal, get_args

from .. import errors
from ..errors import CowfsError

if TYPE_CHECKING:
    import docker  # (untyped: its objects are Any to mypy)

SCOPES = ("none", "files", "system")
RunScope = Literal["auto", "files", "container", "vm"]
RUN_SCOPES: tuple[str, ...] = get_args(RunScope)
RANK = {s: i for i, s in enumerate(SCOPES)}
KEYWORDS = {"{", "}", "!", "if", "then", "elif", "else", "fi", "while", "until", "do", "done"}
RULE_KEYS = {
    "name",
    "scope",
    "programs",
    "subcommands",
    "value_options",
    "if_args",
    "unless_args",
    "if_outside",
    "unless_inside",
    "unless_program_inside",
}
CONTAINER_CLIS = ("docker", "podman")
EXEC_VALUE_OPTIONS = {
    "-e",
    "--env",
    "--env-file",
    "-u",
    "--user",
    "-w",
    "--workdir",
    "--detach-keys",
}


class PolicyError(CowfsError):
    code = errors.USAGE


@dataclass
class Rule:
    name: str
    scope: str
    source: str
    programs: list[str]
    subcommands: list[str] = field(default_factory=list)
    value_options: list[str] = field(default_factory=list)
    if_args: list[str] = field(default_factory=list)
    unless_args: list[str] = field(default_factory=list)
    if_outside: str = ""
    unless_inside: list[str] = field(default_factory=list)
    unless_program_inside: bool = False

    @classmethod
    def parse(cls, d: dict, source: str, index: int) -> Rule:
        where = f"{source}: rule {index + 1}"
        if not isinstance(d, dict):
            raise PolicyError(f"{where}: a rule is a table")
        unknown = set(d) - RULE_KEYS
        if unknown:
            raise PolicyError(f"{where}: unknown key {sorted(unknown)[0]!r}")
        if d.get("scope") not in SCOPES:
            raise PolicyError(f"{where}: scope must be one of {', '.join(SCOPES)}")
        if d.get("if_outside", "") not in ("", "any", "last"):
            raise PolicyError(f'{where}: if_outside is "any" or "last"')
        lists = (
            "programs",
            "subcommands",
            "value_options",
            "if_args",
            "unless_args",
            "unless_inside",
        )
        for key in lists:
            v = d.get(key, [])
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise PolicyError(f"{where}: {key} is a list of strings")
        if not d.get("programs"):
            raise PolicyError(f"{where}: programs is required")
        if not isinstance(d.get("unless_program_inside", False), bool):
            raise PolicyError(f"{where}: unless_program_inside is true or false")
        return cls(
            name=str(d.get("name", f"rule {index + 1}")),
            source=source,
            **{k: v for k, v in d.items() if k != "name"},
        )

    def describe(self) -> str:
        return f"rule {self.name!r} ({self.source})"


@dataclass
class Verdict:
    """How a command was classified: its scope, why (one reason per part
    that decided it) and the containers it runs in (``docker exec``)."""

    scope: str
    reasons: list[str] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)

    def widen(self, other: Verdict) -> None:
        if RANK[other.scope] > RANK[self.scope]:
            self.scope, self.reasons = other.scope, list(other.reasons)
        elif other.scope == self.scope:
            self.reasons += [r for r in other.reasons if r not in self.reasons]
        self.containers += [c for c in other.containers if c not in self.containers]


@dataclass
class Where:
    """What "inside the workspace" means for a command: its working
    directory and the directories that are the workspace."""

    cwd: str
    roots: list[str]
    path_env: str = ""

    def inside(self, path: str) -> bool:
        p = os.path.normpath(os.path.join(self.cwd, path))
        return any(p == r or p.startswith(r.rstrip("/") + "/") for r in self.roots)


def user_policy_files() -> list[str]:
    """The policy files read before the built-in one, most important first."""
    files = [p for p in os.environ.get("COWFS_POLICY", "").split(":") if p]
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    files += [os.path.join(config, "cowfs", "policy.toml"), "/etc/cowfs/policy.toml"]
    return files


class Policy:
    def __init__(self, documents: list[tuple[str, dict]]):
        """*documents*: (source, parsed TOML), most important first."""
        self.sources = [src for src, _ in documents]
        self.rules: list[Rule] = []
        self.settings: dict = {}
        self.wrappers: dict[str, dict] = {}
        for src, doc in reversed(documents):
            unknown = set(doc) - {"settings", "wrappers", "rule"}
            if unknown:
                raise PolicyError(f"{src}: unknown table {sorted(unknown)[0]!r}")
            self.settings.update(doc.get("settings", {}))
            self.wrappers.update(doc.get("wrappers", {}))
        for src, doc in documents:
            rules = doc.get("rule", [])
            if not isinstance(rules, list):
                raise PolicyError(f"{src}: rule must be an array of tables ([[rule]])")
            self.rules += [Rule.parse(r, src, i) for i, r in enumerate(rules)]
        for key in ("default", "run_scope"):
            allowed = SCOPES if key == "default" else RUN_SCOPES
            if self.settings.get(key) not in allowed:
                raise PolicyError(f"policy setting {key} must be one of {', '.join(allowed)}")
        if self.settings.get("unescalated") not in ("warn", "refuse"):
            raise PolicyError("policy setting unescalated must be warn or refuse")

    @classmethod
    def load(cls, files: Sequence[str] = ()) -> Policy:
        """The built-in policy extended by *files* (given explicitly, they
        must exist) and the user's policy files (read when present)."""
        docs = [(p, read_toml(p)) for p in files]
        docs += [(p, read_toml(p)) for p in user_policy_files() if os.path.isfile(p)]
        builtin = resources.files("cowfs.escalation").joinpath("policy.toml")
        docs.append(("built-in policy", tomllib.loads(builtin.read_text())))
        return cls(docs)

    # -- classification -------------------------------------------------------------

    def classify(self, cmd: Sequence[str] | str, where: Where) -> Verdict:
        """The scope of *cmd*: an argument list or a shell string."""
        if isinstance(cmd, str):
            return self._classify_shell(cmd, where, depth=0)
        return self._classify_argv(list(cmd), where, depth=0)

    def _classify_shell(self, text: str, where: Where, depth: int) -> Verdict:
        verdict = Verdict("none")
        if depth > 8:
            return Verdict(self.settings["default"], ["nested too deeply to classify"])
        # command substitutions run commands of their own
        for inner in re.findall(r"\$\(([^()]*)\)|`([^`]*)`", text):
            verdict.widen(self._classify_shell(inner[0] or inner[1], where, depth + 1))
        text = re.sub(r"\$\([^()]*\)|`[^`]*`", "x", text)
        try:
            lex = shlex.shlex(text.replace("\n", ";"), posix=True, punctuation_chars=True)
            lex.whitespace_split = True
            lex.commenters = "#"
            tokens = list(lex)
        except ValueError as e:
            return Verdict(self.settings["default"], [f"cannot parse the shell command: {e}"])
        argv: list[str] = []
        redirects: list[str] = []
        i = 0
        while i <= len(tokens):
            tok = tokens[i] if i < len(tokens) else ";"
            operator = bool(tok) and set(tok) <= set(";&|()<>")
            if operator and ("<" in tok or ">" in tok):
                target = tokens[i + 1] if i + 1 < len(tokens) else ""
                if ">" in tok and not tok.endswith("&"):
                    redirects.append(target)
                i += 1  # the target (a file, an fd or a here-document word) is no argument
            elif operator or (not argv and tok in KEYWORDS):
                if argv or redirects:
                    verdict.widen(self._simple(argv, redirects, where, depth))
                argv, redirects = [], []
            else:
                argv.append(tok)
            i += 1
        return verdict

    def _simple(self, argv: list[str], redirects: list[str], where: Where, depth: int) -> Verdict:
        verdict = self._classify_argv(argv, where, depth)
        for target in redirects:
            if target in ("", "-") or self._safe(target):
                continue
            if not where.inside(target):
                verdict.widen(Verdict("system", [f"writes to {target} (outside the workspace)"]))
            elif verdict.scope == "none":
                verdict.widen(Verdict("files", [f"writes to {target}"]))
        return verdict

    def _safe(self, path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, pat) for pat in self.settings.get("safe_paths", []))

    def _classify_argv(self, argv: list[str], where: Where, depth: int) -> Verdict:
        while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
            argv = argv[1:]  # VAR=value before the command
        if not argv:
            return Verdict("none")
        prog = os.path.basename(argv[0])
        if prog in self.wrappers:
            spec = self.wrappers[prog]
            rest = skip_options(
                argv[1:],
                spec.get("value_options", []),
                spec.get("operands", 0),
                assignments=prog == "env",
            )
            if rest:
                return self._classify_argv(rest, where, depth + 1)
        if prog in self.settings.get("shells", []) and "-c" in argv[1:-1]:
            return self._classify_shell(argv[argv.index("-c", 1) + 1], where, depth + 1)
        if prog == "busybox" and len(argv) > 1:
            return self._classify_argv(argv[1:], where, depth + 1)
        if fnmatch.fnmatchcase(prog, "python*") and "-m" in argv[1:-1]:
            module_at = argv.index("-m", 1) + 1
            return self._match(argv[module_at], argv[0], argv[module_at + 1 :], where)
        if prog in CONTAINER_CLIS and len(argv) > 2 and argv[1] == "exec":
            return self._container_exec(argv[2:], where, depth)
        return self._match(prog, argv[0], argv[1:], where)

    def _container_exec(self, args: list[str], where: Where, depth: int) -> Verdict:
        rest = skip_options(args, EXEC_VALUE_OPTIONS, 0)
        if len(rest) < 2:
            return Verdict(self.settings["default"], ["container exec without a command"])
        container, inner = rest[0], rest[1:]
        workdir = option_value(args[: len(args) - len(rest)], ("-w", "--workdir"))
        verdict = self._classify_argv(inner, container_where(container, where, workdir), depth + 1)
        verdict.containers = [container] + [c for c in verdict.containers if c != container]
        return verdict

    def _match(self, prog: str, program_path: str, args: list[str], where: Where) -> Verdict:
        for rule in self.rules:
            if matches(rule, prog, program_path, args, where, self._safe):
                return Verdict(rule.scope, [f"{prog}: {rule.describe()}"])
        return Verdict(self.settings["default"], [f"{prog}: no rule matches; the default"])


def read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise PolicyError(f"policy file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(f"policy file {path}: {e}") from None


def skip_options(
    args: list[str], value_options: Iterable[str], operands: int, assignments: bool = False
) -> list[str]:
    """What follows the options (and the values of *value_options*), the
    first *operands* operands and, for env, VAR=value assignments."""
    value_options = set(value_options)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if a.startswith("-") and a != "-":
            i += 2 if a in value_options else 1
        elif assignments and "=" in a:
            i += 1
        else:
            break
    return args[i + operands :] if i + operands <= len(args) else []


def option_value(args: list[str], names: Sequence[str]) -> str | None:
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "=") and n.startswith("--"):
                return a[len(n) + 1 :]
    return None


def operands(args: list[str], value_options: Iterable[str]) -> list[str]:
    """The non-option arguments."""
    value_options = set(value_options)
    out, i, only = [], 0, False
    while i < len(args):
        a = args[i]
        if not only and a == "--":
            only = True
        elif not only and a.startswith("-") and a != "-":
            i += 1 if a in value_options else 0
        else:
            out.append(a)
        i += 1
    return out


def path_of(arg: str) -> str:
    """The path in an argument: `of=/x`, `--target=/x` or the argument."""
    if "=" in arg and not arg.startswith("/"):
        return arg.split("=", 1)[1]
    return arg


def matches(
    rule: Rule,
    prog: str,
    program_path: str,
    args: list[str],
    where: Where,
    safe: Callable[[str], bool],
) -> bool:
    if not any(fnmatch.fnmatchcase(prog, p) for p in rule.programs):
        return False
    ops = operands(args, rule.value_options)
    if rule.subcommands and (not ops or ops[0] not in rule.subcommands):
        return False
    if rule.if_args and not any(fnmatch.fnmatchcase(a, p) for a in args for p in rule.if_args):
        return False
    if any(fnmatch.fnmatchcase(a, p) for a in args for p in rule.unless_args):
        return False
    if rule.if_outside:
        candidates = (
            ops[-1:]
            if rule.if_outside == "last"
            else ops + [a for a in args if a.startswith("-") and "=" in a]
        )
        if not any(outside(path_of(a), where, safe) for a in candidates):
            return False
    if rule.unless_inside:
        value = option_value(args, rule.unless_inside)
        if value is not None and where.inside(value):
            return False
    if rule.unless_program_inside and program_inside(program_path, where):
        return False
    return True


def outside(path: str, where: Where, safe: Callable[[str], bool]) -> bool:
    return bool(path) and not safe(path) and not where.inside(path)


def program_inside(program: str, where: Where) -> bool:
    """Whether *program* (a path, or a name looked up in PATH) lives in
    the workspace, e.g. the pip of a virtual environment there."""
    if "/" in program:
        return where.inside(program)
    found = shutil.which(program, path=where.path_env or os.environ.get("PATH", ""))
    return found is not None and where.inside(found)


# -- containers -----------------------------------------------------------------------


def docker_client() -> docker.DockerClient | None:
    """A docker client, or None when the SDK or the docker daemon is unavailable."""
    try:
        import docker

        client = docker.from_env(timeout=30)
        client.ping()
        return client
    except Exception:
        return None


def container_where(name: str, host: Where, workdir: str | None) -> Where:
    """Inside container *name*: the workspace is where the host's workspace
    is bind-mounted; without the docker daemon, nothing is known to be inside."""
    client = docker_client()
    roots: list[str] = []
    cwd = workdir or "/"
    if client is not None:
        try:
            attrs = client.containers.get(name).attrs
            roots = [
                m["Destination"]
                for m in attrs.get("Mounts", [])
                if host.inside(m.get("Source", "/nonexistent"))
            ]
            cwd = workdir or attrs.get("Config", {}).get("WorkingDir") or "/"
        except Exception:
            pass
        finally:
            client.close()
    return Where(cwd if cwd.startswith("/") else "/" + cwd, roots)


class ContainerWatch:
    """What changed in containers' own filesystems (outside their mounts)
    while a command ran: ``docker diff`` before and after, each entry
    compared also by the file's status in the container's writable layer
    where the storage driver exposes it, so a file changed again shows."""

    KINDS = {0: "M", 1: "A", 2: "D"}

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self.client = docker_client() if self.names else None
        self.before = {n: self._state(n) for n in self.names} if self.client else {}

    def _state(self, name: str) -> dict[str, tuple] | None:
        assert self.client is not None  # (asked only when there is one)
        try:
            c = self.client.containers.get(name)
            mounts = [m["Destination"] for m in c.attrs.get("Mounts", [])]
            upper = (c.attrs.get("GraphDriver") or {}).get("Data", {}).get("UpperDir")
            state = {}
            for entry in c.diff() or []:
                path = entry["Path"]
                under = any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)
                above = any(m.startswith(path.rstrip("/") + "/") for m in mounts)
                if under or (above and entry["Kind"] == 0):
                    continue
                sig: tuple = (self.KINDS.get(entry["Kind"], "?"),)
                if upper:
                    try:
                        st = os.lstat(upper + path)
                        sig += (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
                    except OSError:
                        pass
                state[path] = sig
            return state
        except Exception:
            return None

    def changes(self) -> dict[str, list[str]]:
        """Container -> "KIND PATH" lines of what changed since the start."""
        out: dict[str, list[str]] = {}
        if self.client is None:
            return out
        try:
            for name in self.names:
                before, after = self.before.get(name), self._state(name)
                if before is None or after is None:
                    continue
                lines = [
                    f"{sig[0]} {path}"
                    for path, sig in sorted(after.items())
                    if before.get(path) != sig
                ]
                undone = {"A": "D", "D": "A"}  # gone from the diff: put back as it was
                lines += [
                    f"{undone.get(before[path][0], 'M')} {path}"
                    for path in sorted(set(before) - set(after))
                ]
                if lines:
                    out[name] = lines
        finally:
            self.client.close()
        return out
