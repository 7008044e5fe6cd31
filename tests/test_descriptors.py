"""An agent that holds more files open than the daemon may have descriptors
(DESIGN, threat model: many open descriptors never deny service to other
users or to the control channel).  A real unprivileged user ("nobody") holds
100,000 files of the workspace open, from several processes (a process of
its own may have 20,000 at most here); meanwhile another user reads a file
and lists a directory, and root's `cowfs status` and `cowfs checkpoint`
answer in a bounded time.  The daemon keeps its backing descriptors in a
bounded cache (cowfs/fuse/inodes.py) and reopens evicted ones on demand: a file
the agent opened first, whose descriptor went long ago, is still written
through its handle.  Once the agent lets go, a rollback puts back the tree
exactly.

The smaller tests run the daemon with a limit of 600 descriptors (the cache
holds 300): files held open past that, an unlinked file held open (its fd
is kept: it has no name to be reopened by), a user who holds its share of
those refused more (EMFILE) while others go on, and passthrough files,
which the kernel serves from its own reference to the backing file."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pwd
import resource
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cowfs.layers import treesnap

from . import users
from .helpers import COWFS, Workspace, managed_workspace

pytestmark = pytest.mark.usefixtures("fuse", "each_engine")

AGENT = pwd.getpwnam("nobody")
OTHER = 1234  # another user, who only reads
DIRS, PER_DIR = 100, 1000  # 100,000 files
PER_HOLDER = 15_000  # files one holder process keeps open (its limit: the hard one)
BOUND = 60  # seconds another user's request, or root's command, may take


def name(i: int) -> str:
    return f"d{i // PER_DIR:02d}/f{i % PER_DIR:03d}"


def content(i: int) -> bytes:
    return b"file %d\n" % i


@pytest.fixture
def big(engine):
    """A workspace of 100,000 small files, made in the backing directory
    before mounting (as many creates through FUSE would take minutes), in
    a directory other users can reach; its snapshot before the mount, and
    the base layer's id."""
    base = Path(tempfile.mkdtemp(prefix="cowfs-fds-"))
    os.chmod(base, 0o755)
    try:
        with managed_workspace(base / "ws") as ws:
            os.chmod(ws.path, 0o755)
            for d in range(DIRS):
                os.mkdir(ws / f"d{d:02d}")
            for i in range(DIRS * PER_DIR):
                fd = os.open(ws / name(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                os.write(fd, content(i))
                os.close(fd)
            (ws / "agent").mkdir()
            (ws / "agent" / "log").write_bytes(b"first line\n")
            for p in (ws / "agent", ws / "agent" / "log"):
                os.chown(p, AGENT.pw_uid, AGENT.pw_gid)
            before = ws.snapshot()
            ws.mount()
            yield ws, before, ws.log()[0]["id"]
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


class Holder:
    """A process of the agent's that opens files of the mount (relative to
    *root*, an O_PATH descriptor on it: the directories above are root's)
    and keeps them open until told to let go.  The first holder also opens
    the agent's own file for appending, before everything else, and appends
    a line when told to."""

    ends: list[int] = []  # the test's ends of every holder's pipes

    def __init__(self, root: int, first: int, count: int, writer: bool):
        self.cmd_r, self.cmd_w = os.pipe()
        self.res_r, self.res_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the agent
            code = 1
            try:
                # (not the test's ends of other holders' pipes: each must
                # see the end of its own when the test lets go of it)
                for fd in [*Holder.ends, self.cmd_w, self.res_r]:
                    os.close(fd)
                self._run(root, first, count, writer)
                code = 0
            finally:
                os._exit(code)
        os.close(self.cmd_r)
        os.close(self.res_w)
        Holder.ends += [self.cmd_w, self.res_r]

    def _run(self, root: int, first: int, count: int, writer: bool) -> None:  # pragma: no cover
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        users.become(AGENT.pw_uid, AGENT.pw_gid)
        held = []
        failed: dict[str, int] = {}
        log = -1
        if writer:
            log = os.open("agent/log", os.O_WRONLY | os.O_APPEND, dir_fd=root)
        for i in range(first, first + count):
            try:
                held.append(os.open(name(i), os.O_RDONLY, dir_fd=root))
            except OSError as e:
                key = os.strerror(e.errno or 0)
                failed[key] = failed.get(key, 0) + 1
        os.write(self.res_w, repr((len(held), failed)).encode() + b"\n")
        while True:
            cmd = os.read(self.cmd_r, 64)
            if cmd == b"write":
                try:
                    os.write(log, b"written through a handle opened long ago\n")
                    answer = b"ok"
                except OSError as e:
                    answer = os.strerror(e.errno or 0).encode()
                # (and what the first and last files held still read)
                for fd, i in ((held[0], first), (held[-1], first + len(held) - 1)):
                    if os.pread(fd, 100, 0) != content(i):
                        answer += b" wrong content of " + name(i).encode()
                os.write(self.res_w, answer + b"\n")
            else:  # (b"": the test let go of it; or "close")
                return

    def result(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        buf = b""
        while not buf.endswith(b"\n"):
            assert time.monotonic() < deadline, "a holder did not answer"
            chunk = os.read(self.res_r, 4096)
            assert chunk, "a holder died"
            buf += chunk
        return buf.decode().strip()

    def tell(self, cmd: bytes) -> None:
        os.write(self.cmd_w, cmd)

    def close(self) -> None:
        for fd in (self.cmd_w, self.res_r):
            if fd in Holder.ends:
                Holder.ends.remove(fd)
                os.close(fd)
        os.waitpid(self.pid, 0)


@pytest.fixture
def holders(big) -> Iterator[list[Holder]]:
    """The agent's processes, holding every file of the workspace open."""
    ws, _, _ = big
    made: list[Holder] = []
    try:
        root = os.open(ws.path, os.O_PATH | os.O_DIRECTORY)
        try:
            total = DIRS * PER_DIR
            for k, first in enumerate(range(0, total, PER_HOLDER)):
                made.append(Holder(root, first, min(PER_HOLDER, total - first), writer=k == 0))
        finally:
            os.close(root)  # (the holders have theirs; the mount is to be unmounted)
        yield made
    finally:
        for h in made:
            h.close()


def as_other(ws, argv: list[str]) -> subprocess.CompletedProcess:
    """*argv* run by another user in the workspace, within BOUND seconds."""
    root = os.open(ws.path, os.O_PATH | os.O_DIRECTORY)
    try:

        def run() -> tuple[int, bytes, bytes]:
            os.fchdir(root)
            r = subprocess.run(argv, capture_output=True, timeout=BOUND)
            return r.returncode, r.stdout, r.stderr

        code, out, err = users.run_as(OTHER, OTHER, run)
    finally:
        os.close(root)
    return subprocess.CompletedProcess(argv, code, out, err)


def cowfs_within(ws, *args: str) -> subprocess.CompletedProcess:
    """Root's `cowfs ARGS`, which must answer within BOUND seconds."""
    t0 = time.monotonic()
    r = subprocess.run(
        [*COWFS, "-C", str(ws.path), *args], capture_output=True, text=True, timeout=BOUND
    )
    assert r.returncode == 0, (args, r.stderr)
    assert time.monotonic() - t0 < BOUND
    return r


def daemon_fds(ws) -> tuple[int, int]:
    """(descriptors the daemon has open, its limit)."""
    pid = ws.daemon_pid()
    soft, _ = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    return len(os.listdir(f"/proc/{pid}/fd")), soft


def settled(ws) -> None:
    """Wait until the daemon has answered the requests the kernel queued:
    the agent's 100,000 closes queue as many releases, sent after close(2)
    returned (an unmount meanwhile would cut them off).  The daemon is
    done when it stops using CPU time."""
    pid = ws.daemon_pid()

    def cpu() -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return int(fields[11]) + int(fields[12])  # (utime, stime)

    deadline = time.monotonic() + BOUND
    last, still = cpu(), 0
    while still < 5:
        assert time.monotonic() < deadline, "the daemon did not settle"
        time.sleep(0.1)
        now = cpu()
        still = still + 1 if now == last else 0
        last = now


@pytest.mark.slow  # (about a minute, and as long again to remove the files)
def test_an_agent_holding_100k_files_open_starves_no_one(big, holders):
    ws, before, base = big
    for h in holders:
        held, failed = eval(h.result(timeout=600))  # (a repr of ints and a dict)
        assert failed == {}, f"the agent could not open its files: {failed}"
    n, limit = daemon_fds(ws)
    assert n < limit, (n, limit)
    # another user's requests are served meanwhile
    r = as_other(ws, ["cat", name(54_321)])
    assert (r.returncode, r.stdout, r.stderr) == (0, content(54_321), b"")
    r = as_other(ws, ["ls", "d07"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [f"f{i:03d}".encode() for i in range(PER_DIR)]
    # and root's commands on the control channel
    fds = json.loads(cowfs_within(ws, "--json", "status").stdout)["engine"]["descriptors"]
    assert fds["held"] <= fds["cap"] < fds["limit"] and fds["evicted"] > 0, fds
    cowfs_within(ws, "checkpoint", "-m", "while the agent holds 100k files")
    # the first file the agent opened is still written and read through its
    # handle (the daemon's descriptor for it went long ago)
    holders[0].tell(b"write")
    assert holders[0].result(timeout=BOUND) == "ok"
    assert (ws / "agent" / "log").read_bytes().endswith(b"long ago\n")
    for h in holders:
        h.tell(b"close")
    for h in holders:
        h.close()
    holders.clear()
    settled(ws)
    ws.rollback(to=base)
    ws.unmount()
    treesnap.assert_same(before, ws.snapshot())


# -- a daemon with few descriptors -------------------------------------------------

LIMIT = 600  # the daemon's (prlimit)
CACHED = 300  # backing fds it keeps (inodes.fd_cache_size: half, at this limit)


@contextlib.contextmanager
def limited(files: int) -> Iterator[Workspace]:
    """A workspace other users can reach, with *files* files in many/ and a
    directory of the agent's; mounted, once the caller has added what it
    needs, by a daemon limited to LIMIT descriptors (``mount``)."""
    base = Path(tempfile.mkdtemp(prefix="cowfs-fds-"))
    os.chmod(base, 0o755)
    try:
        with managed_workspace(base / "ws") as ws:
            os.chmod(ws.path, 0o755)
            (ws / "many").mkdir()
            for i in range(files):
                (ws / "many" / f"f{i}").write_bytes(content(i))
            (ws / "agent").mkdir()
            os.chown(ws / "agent", AGENT.pw_uid, AGENT.pw_gid)
            yield ws
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


def mount(ws: Workspace) -> None:
    subprocess.run(
        ["prlimit", f"--nofile={LIMIT}:{LIMIT}", *COWFS, "mount", str(ws.path)],
        check=True,
        capture_output=True,
    )
    ws.mounted = True


@pytest.fixture
def tight(engine) -> Iterator[Workspace]:
    """``limited`` with 1,000 files, mounted."""
    with limited(1000) as ws:
        mount(ws)
        yield ws


def test_an_unlinked_file_held_open_keeps_its_data_past_the_cache(tight):
    """A file made and unlinked while open has no name to reopen it by: its
    descriptor stays while 1,000 other files are held open and the cache
    turns over many times; it is written and read to the end."""
    ws = tight
    before = ws.snapshot()
    ws.checkpoint()
    held = os.open(ws / "gone", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(held, b"before the unlink\n")
    os.unlink(ws / "gone")
    others = [os.open(ws / "many" / f"f{i}", os.O_RDONLY) for i in range(1000)]
    try:
        assert daemon_fds(ws)[0] < LIMIT
        assert os.pwrite(held, b"after\n", 18) == 6
        assert os.pread(held, 100, 0) == b"before the unlink\nafter\n"
        assert os.fstat(held).st_nlink == 0
        for i in (0, 500, 999):  # (evicted long ago: opened again)
            assert os.pread(others[i], 100, 0) == content(i)
    finally:
        for fd in others:
            os.close(fd)
        os.close(held)
    ws.rollback()
    treesnap.assert_same(before, ws.snapshot())


def test_a_file_held_open_outlives_the_commit_that_frees_its_grave_entry(tight):
    """An unlinked file of an earlier layer goes to the grave, where a base
    commit removes it for good: held open meanwhile, its descriptor stays
    through the cache's turnover and the commit, as a native file would."""
    ws = tight
    held = os.open(ws / "many" / "f5", os.O_RDWR)
    os.unlink(ws / "many" / "f5")
    others = [os.open(ws / "many" / f"f{i}", os.O_RDONLY) for i in range(6, 1000)]
    try:
        ws.commit()  # (the base layer: its grave entries go)
        assert os.pwrite(held, b"more\n", len(content(5))) == 5
        assert os.pread(held, 100, 0) == content(5) + b"more\n"
        assert os.fstat(held).st_nlink == 0
    finally:
        for fd in others:
            os.close(fd)
        os.close(held)


def hog(root: int, count: int, report: int, wait: int) -> None:  # pragma: no cover
    """(In a child, as the agent.)  Make, open and unlink *count* files in
    its directory, holding them open; write what became of them to
    *report*, and hold them until *wait* ends."""
    users.become(AGENT.pw_uid, AGENT.pw_gid)
    held, refused = [], []
    for i in range(count):
        fd = os.open(f"agent/t{i}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=root)
        os.write(fd, b"t%d\n" % i)
        held.append(fd)
        try:
            os.unlink(f"agent/t{i}", dir_fd=root)
        except OSError as e:
            refused.append((i, e.errno))
    wrong = [i for i, fd in enumerate(held) if os.pread(fd, 100, 0) != b"t%d\n" % i]
    left = sorted(os.listdir(os.open("agent", os.O_RDONLY | os.O_DIRECTORY, dir_fd=root)))
    os.write(report, repr({"refused": refused, "wrong": wrong, "left": left}).encode())
    os.close(report)
    os.read(wait, 1)


def test_an_agent_holding_its_share_of_nameless_files_is_refused_alone(tight):
    """Unlinked open files pin a descriptor each; one user may pin a
    quarter of the cache: past it, its unlink of a file it holds open is
    refused (EMFILE) before anything changes -- and another user's
    requests, and root's commands, are served all the while."""
    ws = tight
    before = ws.snapshot()
    share = CACHED // 4
    root = os.open(ws.path, os.O_PATH | os.O_DIRECTORY)
    report_r, report_w = os.pipe()
    wait_r, wait_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the agent
        try:
            os.close(report_r)
            os.close(wait_w)
            hog(root, share + 10, report_w, wait_r)
        finally:
            os._exit(0)
    os.close(root)
    os.close(report_w)
    os.close(wait_r)
    try:
        with os.fdopen(report_r, "rb") as f:
            got = eval(f.read())  # (a repr of ints and lists)
        # while the agent holds them: another user reads, root asks
        r = as_other(ws, ["cat", "many/f7"])
        assert (r.returncode, r.stdout) == (0, content(7))
        cowfs_within(ws, "status")
        cowfs_within(ws, "checkpoint")
    finally:
        os.close(wait_w)
        os.waitpid(pid, 0)
    assert got["refused"] == [(i, errno.EMFILE) for i in range(share, share + 10)]
    assert got["wrong"] == []
    assert got["left"] == [f"t{i}" for i in range(share, share + 10)]
    settled(ws)
    ws.rollback(to=ws.log()[0]["id"])
    treesnap.assert_same(before, ws.snapshot())


def test_passthrough_files_held_open_take_no_descriptor_each(tight):
    """Files the kernel serves by passthrough (read-only opens of 256 KiB
    and more, on the kernel engine): the kernel holds its own reference to
    the backing file, so 1,000 held open cost the daemon none each."""
    ws = tight
    for i in range(1000):  # (sparse: 4 KiB of data each)
        with open(ws / "many" / f"f{i}", "r+b") as f:
            f.truncate(256 << 10)
    held = [os.open(ws / "many" / f"f{i}", os.O_RDONLY) for i in range(1000)]
    try:
        assert daemon_fds(ws)[0] < LIMIT
        for i in (0, 500, 999):
            assert os.pread(held[i], 100, 0).rstrip(b"\0") == content(i)
            assert os.fstat(held[i]).st_size == 256 << 10
    finally:
        for fd in held:
            os.close(fd)


def test_a_handle_whose_object_went_never_reaches_the_object_given_its_number(engine):
    """The agent holds a file open (read-only first, so the kernel does not
    serve it by passthrough) inside a directory the layer made, where it
    is ignored; other opens evict the daemon's descriptors on it; the
    rollback removes the directory with the file, whose inode number the
    filesystem then gives a file root makes, mode 0600.  The agent's old
    handle must fail (ESTALE), never read or write root's file: the
    daemon tells an object from a later one of the same number by its file
    handle (inode number and generation)."""
    with limited(800) as ws:
        (ws / "shared").mkdir()
        os.chmod(ws / "shared", 0o1777)
        (ws / ".cowfsignore").write_text("*.log\n")
        mount(ws)
        ws.checkpoint()
        go_r, go_w = os.pipe()
        res_r, res_w = os.pipe()
        root = os.open(ws / "shared", os.O_PATH | os.O_DIRECTORY)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the agent
            try:
                users.become(AGENT.pw_uid, AGENT.pw_gid)
                os.mkdir("d", dir_fd=root)
                fd = os.open("x.log", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=root)
                os.write(fd, b"agent data")
                os.close(fd)
                os.rename("x.log", "d/x.log", src_dir_fd=root, dst_dir_fd=root)
                ro = os.open("d/x.log", os.O_RDONLY, dir_fd=root)
                rw = os.open("d/x.log", os.O_RDWR, dir_fd=root)
                os.write(res_w, b"ready\n")
                os.read(go_r, 1)
                got = []
                for act in (lambda: os.pread(rw, 100, 0), lambda: os.pwrite(rw, b"AGENT", 0)):
                    try:
                        got.append(repr(act()))
                    except OSError as e:
                        got.append(errno.errorcode[e.errno or 0])
                os.write(res_w, " ".join(got).encode() + b"\n")
                os.close(ro)
            finally:
                os._exit(0)
        os.close(root)
        try:
            assert os.read(res_r, 100) == b"ready\n"
            held = [os.open(ws / "many" / f"f{i}", os.O_RDONLY) for i in range(700)]
            for fd in held:  # (the cache turns over: the agent's fds go)
                os.close(fd)
            ws.cowfs("rollback", "--no-redo")
            victims = []
            for i in range(40):  # (one of them is given the freed number)
                p = ws / "shared" / f"secret{i}"
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                os.write(fd, b"root only %d\n" % i)
                os.close(fd)
                victims.append(p)
            os.write(go_w, b"g")
            answer = os.read(res_r, 1000).decode().split()
        finally:
            os.close(go_w)
            os.waitpid(pid, 0)
        assert answer == ["ESTALE", "ESTALE"]
        for i, p in enumerate(victims):
            assert p.read_bytes() == b"root only %d\n" % i
