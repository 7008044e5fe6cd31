"""Providers: state outside the files, snapshotted together with a layer.

A checkpoint is a group: the file layer plus a snapshot from each provider
asked for.  A rollback restores the snapshots of every dropped layer (last
taken first), then the files, then discards those snapshots; a merge or a
base commit discards the snapshots that are no longer needed.  Every
restore and discard is a step of the store's pending record, marked before
and after it runs: after a crash the next mount runs the steps left (a step
that was running is run again; a finished one never is).

Providers are registered per workspace in ``STORE/cowfs.toml``::

    [provider.db]
    type = "command"
    capture = "pg_dump app > \"$COWFS_STATE_DIR/dump.sql\""
    restore = "psql app < \"$COWFS_STATE_DIR/dump.sql\""
    discard = ""            # optional; the state directory is removed anyway

Command providers run their commands with ``sh -c`` and these variables:
COWFS_PROVIDER, COWFS_LAYER, COWFS_WORKSPACE and COWFS_STATE_DIR, a private
directory in the store for that provider and layer.

Every method runs outside the daemon's event loop (it may take long).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import tomli_w

from ..errors import USAGE, CowfsError
from ..system import backing

if TYPE_CHECKING:
    import docker  # (the provider libraries are untyped: their objects are Any to mypy)
    import libvirt

CONFIG = "cowfs.toml"


class ProviderError(Exception):
    """A provider step failed.  *postmortem*: diagnostics captured before
    the failure, kept with the layer all the same."""

    def __init__(self, message: str, postmortem: dict | None = None):
        super().__init__(message)
        self.postmortem = postmortem


@dataclass
class Context:
    """Where a provider's snapshot of one layer lives."""

    layer: int
    workspace: str
    state_dir: str


class Provider:
    """capture / restore / discard / describe for one kind of state."""

    type = ""

    def __init__(self, name: str, config: dict):
        self.name = name
        self.config = config

    @staticmethod
    def validate(config: dict) -> None:
        """Refuse (CowfsError, USAGE) a configuration this kind cannot use."""
        raise NotImplementedError

    def capture(self, ctx: Context) -> dict:
        """Take a snapshot; return what restore and discard need (JSON)."""
        raise NotImplementedError

    def restore(self, ctx: Context, snapshot: dict) -> dict | None:
        """Put the snapshot back; may return a post-mortem to keep (or raise
        ProviderError carrying one).  A restore interrupted by a crash is run
        again, so it must work from whatever state it was left in."""
        raise NotImplementedError

    def discard(self, ctx: Context, snapshot: dict) -> None:
        """Free the snapshot.  Idempotent: a discard interrupted by a crash
        is run again, and what is already gone counts as discarded."""
        raise NotImplementedError

    def forget(self, ctx: Context) -> None:
        """Remove whatever a capture for ctx.layer may have made, without
        its snapshot data (a capture a crash interrupted); idempotent."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


def run_sh(
    provider: str, what: str, cmd: str, ctx: Context, check: bool = True, **extra: str
) -> str:
    """Run a user-given shell command for a provider; its stdout (and, when
    *check* is false, its stderr and exit status too)."""
    if not cmd.strip():
        return ""
    env = dict(
        os.environ,
        COWFS_PROVIDER=provider,
        COWFS_LAYER=str(ctx.layer),
        COWFS_WORKSPACE=ctx.workspace,
        COWFS_STATE_DIR=ctx.state_dir,
        **extra,
    )
    r = subprocess.run(
        ["sh", "-c", cmd],
        env=env,
        cwd="/",
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        errors="replace",
        umask=backing.user_umask(),
        start_new_session=True,
    )  # (not hit by a Ctrl-C)
    if not check:
        return r.stdout + r.stderr + (f"\n(exit {r.returncode})" if r.returncode else "")
    if r.returncode != 0:
        tail = (r.stderr.strip() or r.stdout.strip()).splitlines()[-3:]
        raise ProviderError(
            f"{what} command exited {r.returncode}" + (f": {' / '.join(tail)}" if tail else "")
        )
    return r.stdout


class CommandProvider(Provider):
    type = "command"

    @staticmethod
    def validate(config: dict) -> None:
        for key in ("capture", "restore"):
            if not isinstance(config.get(key), str) or not config[key].strip():
                raise CowfsError(f"a command provider needs a {key} command", USAGE)
        if not isinstance(config.get("discard", ""), str):
            raise CowfsError("the discard command must be a string", USAGE)

    def _sh(self, what: str, ctx: Context, **extra: str) -> str:
        return run_sh(self.name, what, self.config.get(what) or "", ctx, True, **extra)

    def capture(self, ctx: Context) -> dict:
        self._sh("capture", ctx)
        return {}

    def restore(self, ctx: Context, snapshot: dict) -> None:
        self._sh("restore", ctx)
        return None

    def discard(self, ctx: Context, snapshot: dict) -> None:
        self._sh("discard", ctx)

    def forget(self, ctx: Context) -> None:
        self.discard(ctx, {})

    def describe(self) -> str:
        return f"command provider (capture: {self.config['capture']})"


class DockerProvider(Provider):
    """``docker commit`` of a container into an image tagged after the
    workspace and layer; restore stops and removes the container and creates
    it again from that image with the same configuration (name, command,
    entrypoint, env, working dir, labels, mounts, network) and starts it if it
    was running."""

    type = "docker"

    @staticmethod
    def validate(config: dict) -> None:
        if not isinstance(config.get("container"), str) or not config["container"]:
            raise CowfsError("a docker provider needs --container NAME", USAGE)

    def _client(self) -> docker.DockerClient:
        try:
            import docker
        except ImportError:
            raise ProviderError(
                "the docker Python SDK is not installed (pip install 'cowfs[providers]')"
            ) from None
        return docker.from_env()

    def capture(self, ctx: Context) -> dict:
        client = self._client()
        c = client.containers.get(self.config["container"])
        a = c.attrs
        tag = f"{self._tag_prefix(ctx)}{c.id[:12]}"
        image = c.commit(*tag.split(":"))
        cfg, host = a["Config"], a["HostConfig"]
        return {
            "image": image.id,
            "tag": tag,
            "name": a["Name"].lstrip("/"),
            "running": a["State"]["Running"],
            "config": {
                "command": cfg.get("Cmd"),
                "entrypoint": cfg.get("Entrypoint"),
                "environment": cfg.get("Env"),
                "working_dir": cfg.get("WorkingDir"),
                "labels": cfg.get("Labels"),
                "user": cfg.get("User"),
                "tty": cfg.get("Tty"),
                "stdin_open": cfg.get("OpenStdin"),
                "hostname": cfg.get("Hostname"),
            },
            "host": {
                "binds": host.get("Binds"),
                "network_mode": host.get("NetworkMode"),
                "privileged": host.get("Privileged"),
            },
        }

    def restore(self, ctx: Context, snapshot: dict) -> None:
        import docker.errors

        client = self._client()
        try:
            client.containers.get(snapshot["name"]).remove(force=True)
        except docker.errors.NotFound:
            pass
        new = client.api.create_container(
            snapshot["image"],
            name=snapshot["name"],
            **{k: v for k, v in snapshot["config"].items() if v is not None},
            host_config=client.api.create_host_config(
                **{k: v for k, v in snapshot["host"].items() if v is not None}
            ),
        )
        if snapshot["running"]:
            client.api.start(new["Id"])

    def discard(self, ctx: Context, snapshot: dict) -> None:
        import docker.errors

        try:
            # Removing the tag frees the image, or (while a restored container
            # runs from it) leaves it to that container.
            self._client().images.remove(snapshot["tag"], force=True)
        except docker.errors.NotFound:
            pass

    @staticmethod
    def _tag_prefix(ctx: Context) -> str:
        repo = f"cowfs/{os.path.basename(ctx.workspace.rstrip('/')).lower() or 'root'}"
        return f"{repo}:layer-{ctx.layer}-"

    def forget(self, ctx: Context) -> None:
        prefix = self._tag_prefix(ctx)
        for image in self._client().images.list(prefix.split(":")[0]):
            for tag in image.tags:
                if tag.startswith(prefix):
                    self.discard(ctx, {"tag": tag})

    def describe(self) -> str:
        return f"docker container {self.config['container']}"


class LibvirtProvider(Provider):
    """An internal snapshot of a libvirt domain per checkpoint (memory and
    disk of a running domain, the disk of a shut-off one); rollback reverts
    to it, merging or committing deletes it, so the chain stays short: one
    snapshot per open layer that asked for one.  Optional ``diagnostics``
    (run before a revert; its output is kept as a post-mortem) and ``health``
    (run after it; a failure is reported) shell commands get COWFS_DOMAIN."""

    type = "libvirt"
    URI = "qemu:///system"

    @staticmethod
    def validate(config: dict) -> None:
        if not isinstance(config.get("domain"), str) or not config["domain"]:
            raise CowfsError("a libvirt provider needs --domain NAME", USAGE)
        for key in ("diagnostics", "health"):
            if not isinstance(config.get(key, ""), str):
                raise CowfsError(f"the {key} command must be a string", USAGE)

    def _domain(self) -> tuple[libvirt.virConnect, libvirt.virDomain]:
        try:
            import libvirt
        except ImportError:
            raise ProviderError(
                "libvirt-python is not installed (pip install 'cowfs[providers]')"
            ) from None
        libvirt.registerErrorHandler(lambda *_: None, None)
        conn = libvirt.open(self.config.get("uri") or self.URI)
        try:
            return conn, conn.lookupByName(self.config["domain"])
        except BaseException:
            conn.close()
            raise

    def capture(self, ctx: Context) -> dict:
        conn, dom = self._domain()
        try:
            name = self._snapshot_name(ctx)
            xml = (
                f"<domainsnapshot><name>{name}</name><description>cowfs layer "
                f"{ctx.layer} of {ctx.workspace}</description></domainsnapshot>"
            )
            dom.snapshotCreateXML(xml, 0)
            return {"snapshot": name, "running": bool(dom.isActive())}
        finally:
            conn.close()

    def restore(self, ctx: Context, snapshot: dict) -> dict | None:
        domain = self.config["domain"]
        postmortem = None
        if self.config.get("diagnostics"):
            output = run_sh(
                self.name,
                "diagnostics",
                self.config["diagnostics"],
                ctx,
                check=False,
                COWFS_DOMAIN=domain,
            )
            postmortem = {"provider": self.name, "domain": domain, "output": output[-16384:]}
        # The post-mortem describes the state before the revert: it is kept
        # whether or not the revert and the health check succeed.
        try:
            conn, dom = self._domain()
            try:
                dom.revertToSnapshot(dom.snapshotLookupByName(snapshot["snapshot"]), 0)
            finally:
                conn.close()
        except Exception as e:
            raise ProviderError(f"revert failed: {e}", postmortem) from e
        try:
            run_sh(self.name, "health", self.config.get("health", ""), ctx, COWFS_DOMAIN=domain)
        except ProviderError as e:
            raise ProviderError(f"reverted, but the health check failed: {e}", postmortem) from None
        return postmortem

    def discard(self, ctx: Context, snapshot: dict) -> None:
        import libvirt

        try:
            conn, dom = self._domain()
        except libvirt.libvirtError as e:
            if e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return  # the domain is gone, and its snapshots with it
            raise
        try:
            dom.snapshotLookupByName(snapshot["snapshot"]).delete(0)
        except libvirt.libvirtError as e:
            if e.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN_SNAPSHOT:
                raise
        finally:
            conn.close()

    @staticmethod
    def _snapshot_name(ctx: Context) -> str:
        return f"cowfs-layer-{ctx.layer}"

    def forget(self, ctx: Context) -> None:
        self.discard(ctx, {"snapshot": self._snapshot_name(ctx)})

    def describe(self) -> str:
        return f"libvirt domain {self.config['domain']}"


# the provider class for each value of a provider's `type`
TYPES: dict[str, type[Provider]] = {
    "command": CommandProvider,
    "docker": DockerProvider,
    "libvirt": LibvirtProvider,
}


class Registry:
    """The providers registered in a store (``STORE/cowfs.toml``), reached
    through the store's directory fd (the store is hidden under the mount)."""

    def __init__(self, store_dirfd: int, workspace: str):
        self.dirfd = store_dirfd
        self.workspace = workspace
        self.base = f"/proc/{os.getpid()}/fd/{store_dirfd}"

    def _load(self) -> dict:
        try:
            with open(os.path.join(self.base, CONFIG), "rb") as f:
                return tomllib.load(f)
        except FileNotFoundError:
            return {}
        except tomllib.TOMLDecodeError as e:
            raise CowfsError(f"{CONFIG} in the store is not valid TOML: {e}", USAGE) from None

    def _save(self, data: dict) -> None:
        path = os.path.join(self.base, CONFIG)
        with open(
            os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600),
            "wb",
        ) as f:
            tomli_w.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    def configs(self) -> dict[str, dict]:
        return dict(self._load().get("provider", {}))

    def get(self, name: str) -> Provider:
        config = self.configs().get(name)
        if config is None:
            raise CowfsError(f"no provider {name!r} (see 'cowfs provider list')", USAGE)
        cls = TYPES.get(config.get("type", ""))
        if cls is None:
            raise CowfsError(f"provider {name!r} has unknown type {config.get('type')!r}", USAGE)
        return cls(name, config)

    def add(self, name: str, config: dict) -> None:
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise CowfsError(f"bad provider name {name!r} (letters, digits, - and _)", USAGE)
        cls = TYPES.get(config.get("type", ""))
        if cls is None:
            raise CowfsError(
                f"unknown provider type {config.get('type')!r} (known: {', '.join(TYPES)})", USAGE
            )
        cls.validate(config)
        data = self._load()
        data.setdefault("provider", {})[name] = config
        self._save(data)

    def ensure(self, kind: str, key: str, target: str) -> str:
        """The provider of *kind* for *target* (a container or domain name),
        registered under a derived name when there is none yet."""
        for name, config in self.configs().items():
            if config.get("type") == kind and config.get(key) == target:
                return name
        prefix = "container" if kind == "docker" else "vm"
        name = f"{prefix}-" + "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in target)
        self.add(name, {"type": kind, key: target})
        return name

    def remove(self, name: str) -> None:
        data = self._load()
        if name not in data.get("provider", {}):
            raise CowfsError(f"no provider {name!r}", USAGE)
        del data["provider"][name]
        self._save(data)

    def context(self, name: str, layer: int) -> Context:
        state = os.path.join(self.base, "providers", name, str(layer))
        os.makedirs(state, mode=0o700, exist_ok=True)
        return Context(layer, self.workspace, state)

    def drop_state(self, ctx: Context) -> None:
        shutil.rmtree(ctx.state_dir, ignore_errors=True)
