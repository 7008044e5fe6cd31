"""Benchmark cowfs against the native filesystem and fuse-overlayfs.

One run makes a journaled ext4 on a loop device (a sparse image in /tmp) or a
tmpfs (--fs tmpfs), and for each repetition runs every workload on every
target -- native directory, a cowfs mount served by the kernel engine
(cowfs-kernel), one served by the pyfuse3 engine (cowfs-pyfuse3),
fuse-overlayfs (when installed) -- in each placement: pinned (the bench's
own loops, every command it runs and every daemon it starts, all their
threads, on CPU 0) and unpinned (every CPU the bench started with).  Within a repetition the
placements and the targets run in an order that rotates from one repetition
to the next, each run in a fresh directory.  Before every timed step it syncs
and touches-and-frees 256 MiB of memory (first touch of long-free memory is
slow in this VM: balloon page reporting, see shared/PERF_NOTES.md).  It
reports medians and the ratio of each target's median time to native's in
the same placement (> 1 = slower), pinned and unpinned side by side, then
cowfs-only control latencies (checkpoint / commit / rollback) and the
daemon's memory after walking a big tree.  Everything it mounts is unmounted
and every scratch file removed at the end, also on failure or Ctrl-C.

Workloads on every target: tree (tar -x of a real tree, cold read, rm -rf),
cp (cp -a of that tree into a fresh directory), cat (cat of every file of
it, cold cache then warm), npm (many small files in nested directories, like
node_modules), null (one request that does nothing: fgetxattr of a missing
user.* attribute, in a tight loop; µs per request), git, small (create /
stat / read / delete of 10k files), seq, rand, grave.  The cp and cat trees
are extracted (natively) before the mount, as a checkout one then works in.
cowfs only (first engine of --engines, unpinned): latency, scaling,
providers; memory runs once per engine.

Cold reads: before a cold-read step the page cache is dropped
(echo 3 > /proc/sys/vm/drop_caches).  That also evicts the kernel's page cache
of FUSE files, so no remount is needed; the FUSE daemons keep their own
in-memory state (that is part of what is measured).  The loop device uses
buffered I/O on its image file, which drop_caches drops as well.  On tmpfs a
"cold" read is a memory read.

The grave workload removes (rm -rf) a tree that existed before the layer --
the tarball tree plus 64 MiB files -- so cowfs keeps every file whole in its
grave and hashes it in the background; on cowfs it also measures, from a cold
cache, the time from the start of the rm until that pass has caught up (read
from the store, which that workspace keeps beside it) and the rollback,
which verifies every hash.

Forks (cowfs only, the first engine of --engines): for workspaces of
1,000, 10,000 and 100,000 files (times --scale; --fork-sizes gives them, as
many files as said, 1000000 included), four forks made and dropped through
the API (the daemon's operation and its answer; the first one starts the
workspace's zygote) and one each through the CLI (its interpreter's start
included); at the largest size, the disk 8 forks changing 10 files each
take, reads (cold, warm) of files unchanged since the fork point and
creates of 4 KiB files in a fork against the same in its workspace, pinned
and unpinned, and an adopt of 10,000 new files (times --scale).

Providers (last in a full run, or alone with --providers): on one cowfs
workspace, for the files alone and for each provider kind -- a command provider
(cp of a small file to $COWFS_STATE_DIR), a running busybox container with the
workspace bind-mounted (docker), a tiny running and a tiny shut-off libvirt
domain -- it repeats a cycle: checkpoint (capture), a change in the files and
in the provider's state, rollback (restore), checkpoint, change, commit (merge:
the snapshot is discarded), checking every result.  It reports the provider's
own time from the reply, the daemon's time of the whole operation and the
command's wall clock, against the files-only cycle.  dockerd and libvirtd are
started when they are not running (tools/provider_daemons.py; they are left running,
as the tests leave them); an engine that cannot run here is reported as
skipped, with the reason.  The container, every snapshot image, the domains
with their snapshots and disks, and a busybox image built for the run are
removed at the end, also on failure or Ctrl-C.

Run as root:  tools/bench [--quick] [--reps N] [--scale F] [--fs ext4|tmpfs]
                          [--json FILE] [--markdown] [--no-memory] [--workloads a,b,...]
                          [--engines kernel,pyfuse3] [--placement pinned,unpinned]
                          [--providers] [--provider-reps N] [--provider-kinds a,b,...]
                          [--fork-sizes N,N,...]
"""

from __future__ import annotations

from .cli import main

__all__ = ["main"]
