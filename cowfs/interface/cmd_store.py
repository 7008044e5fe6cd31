"""The commands that look after the store and the workspace's setup:
gc, check, doctor, provider."""

from __future__ import annotations

import argparse

from .. import errors
from ..errors import CowfsError
from ..text import count, human_size
from .client import Client
from .command import Command, Parser, ask, call, client, out, progress_shown


class Gc(Command):
    name = "gc"
    help = (
        "free store space nothing needs (unused chunks, grave files no record holds); "
        "mounted or not"
    )
    examples = "  cowfs gc"
    ops = ("gc",)

    def run(self, args: argparse.Namespace) -> int:
        res = call(args, "gc")
        out(
            args,
            f"freed {human_size(res['freed_bytes'])}: "
            + (", ".join(res["done"]) or "nothing to free"),
            res,
        )
        return 0


class Check(Command):
    name = "check"
    help = (
        "verify the store: chunk hashes, reference counts, records, layers, the grave "
        "(read-only; mounted or not)"
    )
    examples = "  cowfs check\n  cowfs check --repair"
    ops = ("check", "repair")

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "--repair",
            action="store_true",
            help="repair what can be repaired without inventing data, then check again "
            "(asks first; without a terminal, refused unless --yes)",
        )
        s.add_argument("--yes", action="store_true", help="with --repair: do not ask")

    def run(self, args: argparse.Namespace) -> int:
        """Exit 0 when the store is consistent, 6 when problems remain."""
        ws = client(args)
        with progress_shown(args, "check"):
            res = ws.check()
        lines = self.found(res)
        if args.repair and not res["ok"]:
            fixable = [p for p in res["problems"] if p["repairable"]]
            if not fixable:
                lines.append(
                    "nothing here can be repaired without inventing data; a rollback "
                    "skips the objects named and reports them"
                )
            else:
                if not args.json:
                    print("\n".join(lines))
                    lines = []
                res = self.repair(args, ws, len(fixable))
                lines += self.repaired(res)
        out(args, "\n".join(lines), res)
        return 0 if res["ok"] else errors.STORE_ERROR

    @staticmethod
    def found(res: dict) -> list[str]:
        lines = [
            f"checked {count(res['chunks'], 'chunk')} ({count(res['bytes_checked'], 'byte')}), "
            f"{count(res['records'], 'record')}, {count(res['graves'], 'removed object')}"
            + (
                f" ({count(res['graves_hashed'], 'file')} by hash, "
                f"{count(res['grave_bytes_checked'], 'byte')})"
                if res.get("graves_hashed")
                else ""
            )
            + ": "
            + ("consistent" if res["ok"] else count(len(res["problems"]), "problem"))
        ]
        lines += [f"  {p['text']}" for p in res["problems"]]
        if res.get("unsealed"):
            lines.append(
                f"  note: {count(res['unsealed'], 'record')} written by an older cowfs "
                "without a checksum (read as they are)"
            )
        return lines

    @staticmethod
    def repair(args: argparse.Namespace, ws: Client, fixable: int) -> dict:
        if not args.yes:
            answer = ask(
                f"cowfs: repair {fixable} problem{'s' if fixable > 1 else ''}? [y/N] ",
                "yn",
                300,
            )
            if answer != "y":
                raise CowfsError(
                    "not repaired" + (" (no terminal: use --yes)" if answer is None else ""),
                    errors.STORE_ERROR,
                )
        with progress_shown(args, "repair"):
            return ws.check(repair=True)

    @staticmethod
    def repaired(res: dict) -> list[str]:
        lines = [f"repaired: {d}" for d in res["repaired"]]
        lines.append(
            "now "
            + ("consistent" if res["ok"] else f"{count(len(res['problems']), 'problem')} remain:")
        )
        return lines + [f"  {p['text']}" for p in res["problems"]]


class Doctor(Command):
    name = "doctor"
    help = "check FUSE, the daemon, the store and the providers"
    examples = "  cowfs doctor\n  cowfs doctor ~/project"

    def add_options(self, s: argparse.ArgumentParser) -> None:
        s.add_argument("target", nargs="?", metavar="PATH", help="a workspace (mounted or not)")
        s.add_argument(
            "--store", metavar="DIR", help="store of an unmounted workspace (default: PATH/.cowfs)"
        )

    def run(self, args: argparse.Namespace) -> int:
        from .doctor import report

        return report(args.target, args.json, store=args.store)


class Provider(Command):
    name = "provider"
    help = "register, list or remove the workspace's providers"
    examples = (
        "  cowfs provider add db --capture 'pg_dump app > \"$COWFS_STATE_DIR/d\"' "
        "--restore 'psql app < \"$COWFS_STATE_DIR/d\"'\n"
        "  cowfs provider list"
    )
    ops = ("provider_add", "provider_remove", "provider_list")

    def add_options(self, s: argparse.ArgumentParser) -> None:
        psub = s.add_subparsers(
            dest="action",
            required=True,
            metavar="ACTION",
            parser_class=Parser,
            help="add, list or remove",
        )
        a = psub.add_parser("add", help="register a provider")
        a.add_argument("name", help="the provider's name (used by checkpoint --provider)")
        a.add_argument(
            "--type",
            default="command",
            choices=("command", "docker", "libvirt"),
            help="command (your own capture/restore/discard commands; the default), "
            "docker (a container) or libvirt (a domain)",
        )
        a.add_argument("--capture", default="", metavar="CMD", help="command: take a snapshot")
        a.add_argument("--restore", default="", metavar="CMD", help="command: put it back")
        a.add_argument("--discard", default="", metavar="CMD", help="command: drop it")
        a.add_argument("--container", default="", metavar="NAME", help="docker: the container")
        a.add_argument("--domain", default="", metavar="NAME", help="libvirt: the domain")
        a.add_argument(
            "--diagnostics",
            default="",
            metavar="CMD",
            help="libvirt: run before a revert; its output is kept as a post-mortem",
        )
        a.add_argument(
            "--health",
            default="",
            metavar="CMD",
            help="libvirt: run after a revert; failing is reported",
        )
        psub.add_parser("list", help="list the registered providers")
        r = psub.add_parser("remove", help="unregister a provider")
        r.add_argument("name", help="the provider to unregister")

    def run(self, args: argparse.Namespace) -> int:
        ws = Client.attach(args.path)
        if args.action == "add":
            res = ws.call(
                "provider_add",
                name=args.name,
                type=args.type,
                capture=args.capture,
                restore=args.restore,
                discard=args.discard,
                container=args.container,
                domain=args.domain,
                diagnostics=args.diagnostics,
                health=args.health,
            )
            out(args, f"registered provider {args.name}", res)
        elif args.action == "remove":
            res = ws.call("provider_remove", name=args.name)
            out(args, f"removed provider {args.name}", res)
        else:
            res = ws.call("provider_list")["providers"]
            out(
                args,
                "\n".join(
                    f"{p['name']}  {p['type']}  "
                    + (
                        f"container: {p['container']}"
                        if p["type"] == "docker"
                        else f"domain: {p['domain']}"
                        if p["type"] == "libvirt"
                        else f"capture: {p.get('capture', '')}"
                    )
                    for p in res
                )
                or None,
                res,
            )
        return 0
