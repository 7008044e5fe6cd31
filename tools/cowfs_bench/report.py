"""The report of a Bench: text, Markdown (the main table) and JSON."""

from __future__ import annotations

import itertools
import os
import platform
import statistics
import time

from .helpers import REPO, MiB, run, spread, summarize
from .providers import PROVIDER_OPS, provider_subjects


class Report:
    """The report of a Bench (a part of it: Bench derives from this)."""

    def medians(self, name: str) -> dict[str, dict[str, float]]:
        """placement -> target -> median seconds of step *name*."""
        return {
            p: {t: statistics.median(v) for t, v in by_t.items() if v}
            for p, by_t in self.samples[name].items()
        }

    def short_samples(self, name: str, targets: list[str]) -> list[str]:
        """Runs of step *name* with fewer samples than repetitions (of the
        targets that have the step at all)."""
        by_p = self.samples[name]
        have = {t for got in by_p.values() for t in got}
        return [
            f"{t} {p} n={len(by_p.get(p, {}).get(t, []))}"
            for p in self.args.placement
            for t in targets
            if t in have and len(by_p.get(p, {}).get(t, [])) < self.args.reps
        ]

    def main_table(self, targets: list[str]) -> list[str]:
        """Per step: native, then each target's median and ratio to native,
        a column per placement."""
        places = self.args.placement
        w = max([len(n) for n in self.order] + [30]) + 1
        nw, tw = 11, 17
        top = f"{'':<{w}}{'native':^{nw * len(places)}}" + "".join(
            f"{t:^{tw * len(places)}}" for t in targets[1:]
        )
        hdr = (
            f"{'step':<{w}}"
            + "".join(f"{p:>{nw}}" for p in places)
            + "".join(f"{p:>{tw}}" for _ in targets[1:] for p in places)
        )
        lines = [top, hdr, "-" * len(hdr)]
        last_wl = None
        for name in self.order:
            m = self.meta[name]
            if last_wl is not None and m["workload"] != last_wl:
                lines.append("")
            last_wl = m["workload"]
            med = self.medians(name)
            row = f"{name:<{w}}" + "".join(
                f"{self._fmt(med.get(p, {}).get('native'), m):>{nw}}" for p in places
            )
            for t in targets[1:]:
                for p in places:
                    mp = med.get(p, {})
                    cell = self._fmt(mp.get(t), m)
                    if mp.get("native"):
                        cell += " " + self._ratio(mp, t)
                    row += f"{cell:>{tw}}"
            short = self.short_samples(name, targets)
            if short:
                row += "  (" + ", ".join(short) + ")"
            lines.append(row)
        return lines

    def markdown(self) -> str:
        """The main table in Markdown (for the README): value (ratio)."""
        targets = [t.name for t in self.targets()]
        places = self.args.placement
        cols = [f"{t} {p}" for t in targets for p in places]
        lines = ["| step | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for name in self.order:
            m = self.meta[name]
            med = self.medians(name)
            cells = []
            for t in targets:
                for p in places:
                    mp = med.get(p, {})
                    cell = self._fmt(mp.get(t), m)
                    if t != "native" and mp.get(t) is not None and mp.get("native"):
                        cell += f" ({self._ratio(mp, t).replace('x', '×')})"
                    cells.append(cell)
            lines.append(f"| {name.strip()} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def report(self, elapsed: float, interrupted: bool) -> str:
        targets = [t.name for t in self.targets()]
        lines = []
        a = self.args
        lines.append(
            f"cowfs benchmark  ({time.strftime('%Y-%m-%d %H:%M:%S')}, "
            f"{elapsed / 60:.1f} min{', INTERRUPTED' if interrupted else ''})"
        )
        lines.append(
            f"  machine: {platform.node()}, kernel {platform.release()}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
        )
        lines.append(f"  cowfs:   {self.cowfs_rev}")
        lines.append(f"  fs:      {self.fs_desc}")
        lines += self.load.report()
        ti = self.tree_info
        if ti:
            lines.append(
                f"  tree:    {ti['source']}: {ti['files']:,} files, {ti['dirs']:,} dirs, "
                f"{ti['symlinks']} symlinks, {ti['bytes'] / MiB:.1f} MiB "
                f"(tarball {ti['tar_bytes'] / MiB:.1f} MiB)"
            )
        if self.order:
            cpus = ",".join(map(str, sorted(self.cpus["unpinned"])))
            lines.append(
                f"  method:  {a.reps} repetition(s), scale {a.scale:g}; in each "
                f"repetition every workload runs in each placement on each target, "
                f"orders rotating per repetition; fresh directory per run; sync + "
                f"256 MiB touch-and-free before every timed step; medians"
            )
            lines.append(
                f"  pinned = the workload and the daemons (all their threads) on CPU "
                f"{min(self.cpus['pinned'])}; unpinned = on CPUs {cpus}"
            )
            lines.append(
                "  ratio = target median time / native median time in the same "
                "placement (> 1 = slower)"
            )
            lines.append("")
            lines += self.main_table(targets)
        if self.latency:
            lines.append("")
            lines.append(
                "cowfs control latency (medians; daemon = 'daemon_ms' of the reply, "
                "CLI = wall clock of the cowfs command incl. interpreter start-up)"
            )
            sizes = sorted({n for d in self.latency.values() for n in d})
            hdr = f"{'operation':<38}" + "".join(
                f"{f'{n} files: daemon':>20}{'CLI':>9}" for n in sizes
            )
            lines.append(hdr)
            lines.append("-" * len(hdr))
            for name, d in self.latency.items():
                row = f"{name:<38}"
                for n in sizes:
                    if n in d and d[n]["daemon_ms"]:
                        row += f"{statistics.median(d[n]['daemon_ms']):>17.1f} ms"
                        row += f"{statistics.median(d[n]['wall_ms']):>6.0f} ms"
                    else:
                        row += f"{'-':>20}{'-':>9}"
                lines.append(row)
            lines.append(
                "  (checkpoint: taken when the layer below has the N changes; commit: "
                "merges a layer of N in-place edits; rollback: undoes N in-place edits)"
            )
        if self.startup:
            lines.append("")
            lines.append(
                f"start-up, wall clock (median of "
                f"{len(next(iter(self.startup.values())))}, unpinned): "
                + "; ".join(
                    f"{what} {statistics.median(v):.0f} ms" for what, v in self.startup.items()
                )
            )
        for engine, mm in self.memory.items():
            if not mm.get("after_walk"):
                continue
            am, aw = mm["after_mount"], mm["after_walk"]
            lines.append("")
            lines.append(
                f"cowfs daemon memory ({engine} engine, unpinned), {mm['files']:,} files "
                f"of 256 B in {-(-mm['files'] // 1000)} dirs (created natively, then "
                f"mounted):"
            )
            lines.append(
                f"  after mount ({mm['mount_wall_s']:.2f} s): "
                f"VmRSS {am['VmRSS']:.1f} MiB, "
                f"{am['fds']} open fds (limit {am.get('fd_limit')})"
            )
            failed = " -- FAILED, see below" if "walk_error" in mm else ""
            lines.append(
                f"  after `find . -type f -exec stat` of every file (cold cache){failed}: "
                f"VmRSS {aw['VmRSS']:.1f} MiB, VmHWM {aw['VmHWM']:.1f} MiB, "
                f"{aw['fds']:,} open fds; the walk listed {mm['walk_saw']:,} files"
            )
            if not failed:
                lines.append(
                    f"  that walk took {mm['cowfs_walk_s']:.2f} s through cowfs vs "
                    f"{mm['native_walk_s']:.2f} s native "
                    f"({mm['cowfs_walk_s'] / mm['native_walk_s']:.1f}x)"
                )
        if self.scaling:
            lines += self.scaling_report()
        lines += self.forks_report()
        if "providers" in a.workloads:
            lines += self.provider_report()
        if self.warnings:
            lines.append("")
            lines.append("cowfs mount warnings: " + "; ".join(sorted(self.warnings)))
        if self.notes:
            lines.append("")
            lines.extend(f"note: {n}" for n in self.notes)
        if self.failures:
            lines.append("")
            lines.append(f"FAILURES ({len(self.failures)}):")
            for f in self.failures:
                lines.append(f"  {f['workload']} on {f['target']} (rep {f['rep']}): {f['error']}")
        return "\n".join(lines)

    def provider_report(self) -> list[str]:
        p = self.providers
        files = p["samples"].get("files", {})
        lines = [
            "",
            f"provider snapshots: {p['reps']} repetition(s), kinds interleaved (order "
            f"rotates), one cowfs workspace; ms, median [min-max]",
            "  capture = checkpoint --provider P; restore = rollback of that layer (the "
            "restore, then the snapshot is discarded);",
            "  discard = commit of such a layer into the one below (merge, then the "
            "snapshot is discarded)",
            "  provider = the provider's own time ('seconds' of the reply); daemon = the "
            "whole operation ('daemon_ms'); wall = the cowfs command (incl. interpreter "
            "start-up)",
            "  vs files: +daemon = daemon median - the files-only daemon median (what the "
            "provider adds); wall/files = the ratio of wall medians",
        ]
        hdr = (
            f"{'kind':<19}{'operation':<25}{'provider':>18}{'daemon':>20}{'wall':>20}"
            f"{'+daemon':>9}{'wall/files':>11}"
        )
        lines += [hdr, "-" * len(hdr)]
        for s in provider_subjects(self, self.args.provider_kinds):
            samples = p["samples"].get(s.kind, {})
            why = p["skipped"].get(s.kind) or (None if samples else p["stopped"].get(s.kind))
            if why:
                lines.append(
                    f"{s.label:<19}{'skipped' if s.kind in p['skipped'] else 'FAILED'}"
                    f": {summarize(why, 1)}"
                )
                continue
            for i, (op, title) in enumerate(PROVIDER_OPS):
                d = samples.get(op, {})
                base = files.get(op, {})
                extra = ratio = "-"
                if d and base and s.kind != "files":
                    daemon, wall = (statistics.median(d[k]) for k in ("daemon_ms", "wall_ms"))
                    extra = f"{daemon - statistics.median(base['daemon_ms']):+.0f}"
                    ratio = f"{wall / statistics.median(base['wall_ms']):.2f}x"
                row = (
                    f"{s.label if i == 0 else '':<19}{title:<25}"
                    f"{spread(d.get('provider_ms', [])):>18}{spread(d.get('daemon_ms', [])):>20}"
                    f"{spread(d.get('wall_ms', [])):>20}{extra:>9}{ratio:>11}"
                )
                if len(d.get("wall_ms", [])) < p["reps"]:
                    row += (
                        f"  (n={len(d.get('wall_ms', []))}; "
                        f"{p['stopped'].get(s.kind, 'incomplete')})"
                    )
                lines.append(row)
        lines += [f"  {k}: {info}" for k, info in p["info"].items()]
        return lines

    @staticmethod
    def _fmt(secs, m) -> str:
        if secs is None:
            return "-"
        if m.get("per_op"):
            us = secs / m["ops"] * 1e6
            return f"{us:.1f} µs" if us < 100 else f"{us:.0f} µs"
        if m.get("ops"):
            rate = m["ops"] / secs
            return f"{rate / 1000:.1f}k/s" if rate >= 10_000 else f"{rate:.0f}/s"
        if m.get("bytes"):
            return f"{m['bytes'] / MiB / secs:.0f} MiB/s"
        return f"{secs * 1000:.0f} ms" if secs < 1 else f"{secs:.2f} s"

    @staticmethod
    def _ratio(med, t) -> str:
        if med.get(t) is None or not med.get("native"):
            return "-"
        r = med[t] / med["native"]
        return f"{r:.1f}x" if r < 100 else f"{r:.0f}x"

    def to_json(self, elapsed, interrupted) -> dict:
        return {
            "elapsed_s": elapsed,
            "interrupted": interrupted,
            "args": vars(self.args),
            "fs": self.fs_desc,
            "cowfs": self.cowfs_rev,
            "tree": self.tree_info,
            "kernel": platform.release(),
            "sizes": {
                "small_files": self.n_small,
                "seq_bytes": self.seq_size,
                "rand_file_bytes": self.rand_size,
                "rand_writes": self.rand_count,
                "latency_files": [5, self.lat_files],
                "memory_files": self.mem_files,
                "null_requests": self.null_count,
                "npm_packages": self.npm_packages,
            },
            "targets": [t.name for t in self.targets()],
            "placements": self.args.placement,
            "cpus": {p: sorted(c) for p, c in self.cpus.items()},
            "load": self.load.to_json(),
            "steps": [{"name": n, **self.meta[n], "seconds": self.samples[n]} for n in self.order],
            "latency": self.latency,
            "startup": self.startup,
            "memory": self.memory,
            "providers": self.providers,
            "scaling": self.scaling,
            "forks": self.forks,
            "digests": {f"{wl}/{rep}": v for (wl, rep), v in self.digests.items()},
            "notes": self.notes,
            "warnings": sorted(self.warnings),
            "failures": self.failures,
        }

    @property
    def cowfs_rev(self) -> str:
        r = run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], check=False)
        rev = r.stdout.decode().strip() or "?"
        dirty = run(["git", "-C", REPO, "status", "--porcelain", "--", "cowfs"], check=False)
        return f"{REPO} @ {rev}{' + uncommitted changes in cowfs/' if dirty.stdout.strip() else ''}"

    def scaling_report(self) -> list[str]:
        sizes = sorted({n for ops in self.scaling.values() for d in ops.values() for n in d})
        lines = [
            "",
            "cowfs stack operations by layer size (wall clock of the command, s; "
            "x10: growth per 10x more records, <= 12 is linear enough)",
        ]
        hdr = (
            f"{'kind':<9}{'operation':<28}"
            + "".join(f"{n:>10,}" for n in sizes)
            + "".join(f"{'x10':>7}" for _ in sizes[1:])
        )
        lines += [hdr, "-" * len(hdr)]
        for kind, ops in self.scaling.items():
            for op, d in ops.items():
                row = f"{kind:<9}{op:<28}"
                for n in sizes:
                    v = d.get(n)
                    row += (
                        f"{'-':>10}"
                        if v is None
                        else (f"{v:>10,}" if op == "records" else f"{v:>10.2f}")
                    )
                if op != "records":
                    for a, b in itertools.pairwise(sizes):
                        x = d.get(b, 0) / d[a] if d.get(a) and d.get(b) else None
                        row += f"{'-':>7}" if x is None else f"{x:>7.1f}"
                lines.append(row)
                kind = ""
        return lines
