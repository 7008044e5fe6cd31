"""The command line and main()."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from cowfs.interface.cli import parse_number

from . import __doc__ as DESCRIPTION  # (the package's docstring)
from .bench import Bench
from .cowfs_only import SCALING_KINDS
from .helpers import COWFS, REPO, VENV_PY, perf, run
from .providers import PROVIDER_KINDS

DEFAULT_TREE = "/usr/lib/python3/dist-packages"
ENGINES = ("kernel", "pyfuse3")  # cowfs mount --engine
PLACEMENTS = ("pinned", "unpinned")
ALL_WORKLOADS = (
    "tree",
    "cp",
    "cat",
    "npm",
    "null",
    "git",
    "small",
    "seq",
    "rand",
    "grave",
    "latency",
    "memory",
    "scaling",
    "forks",
    "providers",
)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="tools/bench",
        description=DESCRIPTION.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--reps", type=parse_number, help="repetitions (default 3; 1 with --quick)")
    p.add_argument("--scale", type=float, help="size factor (default 1.0; 0.03 with --quick)")
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    p.add_argument(
        "--fs",
        choices=("ext4", "tmpfs"),
        default="ext4",
        help="journaled ext4 on a loop device (default) or tmpfs",
    )
    p.add_argument("--json", metavar="FILE", help="save raw results as JSON")
    p.add_argument("--no-memory", action="store_true", help="skip the 100k-file memory test")
    p.add_argument("--no-overlay", action="store_true", help="skip fuse-overlayfs")
    p.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"cowfs engines to measure, each a target (default {','.join(ENGINES)}; "
        "the first also serves the cowfs-only workloads)",
    )
    p.add_argument(
        "--placement",
        default=",".join(PLACEMENTS),
        help="pinned (the workload and the daemons on one CPU), unpinned, or both "
        f"(default {','.join(PLACEMENTS)})",
    )
    p.add_argument("--markdown", action="store_true", help="also print the main table in Markdown")
    p.add_argument(
        "--workloads",
        default=",".join(ALL_WORKLOADS),
        help=f"comma-separated subset of {','.join(ALL_WORKLOADS)}",
    )
    p.add_argument(
        "--providers",
        action="store_true",
        help="only the provider snapshot timings (--workloads providers)",
    )
    p.add_argument(
        "--provider-kinds",
        default=",".join(PROVIDER_KINDS),
        help=f"comma-separated subset of {','.join(PROVIDER_KINDS)} "
        "(files-only is always measured, as the baseline)",
    )
    p.add_argument(
        "--scaling-kinds",
        default=",".join(SCALING_KINDS),
        help=f"comma-separated subset of {','.join(SCALING_KINDS)} (--workloads scaling)",
    )
    p.add_argument(
        "--fork-sizes",
        type=lambda v: [parse_number(x) for x in v.split(",")],
        help="workspace sizes in files for --workloads forks, as given (default "
        "1000,10000,100000 times --scale; 1000000 is a long build)",
    )
    p.add_argument(
        "--provider-reps",
        type=parse_number,
        help="repetitions of each provider cycle (default 10; 3 with --quick)",
    )
    p.add_argument(
        "--tree", default=DEFAULT_TREE, help=f"source tree for the tarball (default {DEFAULT_TREE})"
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=900,
        help="seconds before a step counts as hung and its daemon is killed",
    )
    a = p.parse_args(argv)
    if a.reps is None:
        a.reps = 1 if a.quick else 3
    if a.scale is None:
        a.scale = 0.03 if a.quick else 1.0
    if a.provider_reps is None:
        a.provider_reps = 3 if a.quick else 10
    a.workloads = (
        ["providers"] if a.providers else [w.strip() for w in a.workloads.split(",") if w.strip()]
    )
    for what in ("provider_kinds", "scaling_kinds", "engines", "placement"):
        setattr(a, what, [k.strip() for k in getattr(a, what).split(",") if k.strip()])
    for what, given, known in (
        ("workloads", a.workloads, ALL_WORKLOADS),
        ("provider kinds", a.provider_kinds, PROVIDER_KINDS),
        ("scaling kinds", a.scaling_kinds, SCALING_KINDS),
        ("engines", a.engines, ENGINES),
        ("placements", a.placement, PLACEMENTS),
    ):
        bad = set(given) - set(known)
        if bad:
            p.error(f"unknown {what}: {', '.join(sorted(bad))}")
    if not a.engines or not a.placement:
        p.error("--engines and --placement need at least one value")
    if not a.scale > 0:
        p.error("--scale must be positive")
    return a


def use_this_checkout(args) -> None:
    """Make every cowfs process the bench starts import this checkout's
    package: PYTHONPATH first, and run from / (python -m puts the working
    directory first, where another checkout's cowfs/ could be)."""
    for name in ("json", "tree"):
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [REPO, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    os.chdir("/")
    for how, code in (
        ("the cowfs command", "import sys; sys.path[0] = sys.argv[1]"),
        ("python -m cowfs.service.daemon", "pass"),
    ):
        r = run(
            [VENV_PY, "-c", f"{code}; import cowfs; print(cowfs.__file__)", os.path.dirname(COWFS)]
        )
        got = os.path.dirname(r.stdout.decode().strip())
        if got != os.path.join(REPO, "cowfs"):
            sys.exit(f"bench: {how} would import cowfs from {got}, not {REPO}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench: must run as root (loop mounts, drop_caches)", file=sys.stderr)
        return 2

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignored
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    use_this_checkout(args)
    bench = Bench(args)
    start = perf()
    interrupted = False
    bench.load.start()
    try:
        bench.make_fs()
        if {"tree", "cp", "cat", "git", "grave"} & set(args.workloads):
            bench.make_tarball()
        print(f"bench: {bench.fs_desc}", file=sys.stderr)
        bench.run_all()
    except KeyboardInterrupt:
        interrupted = True
        print("bench: interrupted; cleaning up", file=sys.stderr)
    except Exception as e:
        bench.fail("setup", "-", -1, e)
    finally:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            bench.place("unpinned")
            bench.cleanup()
        finally:
            signal.signal(signal.SIGINT, old)
    bench.load.finish()
    elapsed = perf() - start
    print(bench.report(elapsed, interrupted))
    if args.markdown:
        print("\n" + bench.markdown())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(bench.to_json(elapsed, interrupted), f, indent=1)
        print(f"\nraw results: {args.json}")
    if interrupted:
        return 130
    return 1 if bench.failures else 0
