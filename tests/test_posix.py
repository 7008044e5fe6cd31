"""POSIX behaviour of the mounted view, with native ext4 as the oracle.

Every case builds the same small tree twice, in a directory inside a cowfs
mount and in a sibling directory on the same ext4 filesystem, runs one
operation in both (as root, or as an unprivileged user), and compares the
outcomes (DESIGN invariant 5):

* the result: the errno, or the value the operation returns;
* the tree afterwards: names, types and file contents;
* for each watched name: mode, owner, link count, size, whether it is still
  the same object, and which of atime/mtime/ctime changed -- in the view,
  and underneath it in the backing directory too (the kernel's attribute
  cache can hide there what the daemon's own reads and writes did).

Each case runs on a tree made before the mount ("old": the open layer has to
capture what the operation changes) and on one made in the open layer
("new").  Before the operation every entry gets the same old atime and
mtime, so a change is visible, and the clock is let past one tick, so a
ctime change is too.  Expected errnos are not hard-coded where native can
answer; the few assertions made directly (a rename out of the mount is
cross-device, concurrent appends lose and tear nothing) are checked to hold
natively as well.  Last, one rollback must undo everything the cases did.

The whole module runs on both engines.  Cases marked ``known`` name what the
pyfuse3 engine cannot do like ext4 (operations pyfuse3 does not offer); on it
they are expected failures, on the kernel engine they pass.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import pickle
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cowfs.layers import treesnap
from cowfs.system import backing as B

from .helpers import Workspace, backing_dir, managed_workspace

pytestmark = pytest.mark.usefixtures("each_engine")

T0 = 1_600_000_000 * 10**9  # an old atime/mtime given to everything before an operation
USER = 1234  # an unprivileged uid (and gid)
GROUP = 555  # a group USER is not in
AT_FDCWD = -100


@dataclass
class Roots:
    ws: Workspace
    native: Path
    at_mount: treesnap.Snapshot
    backing: Path  # the workspace underneath the mount, as the daemon sees it


@pytest.fixture(scope="module")
def roots(tmp_path_factory, engine, fuse):
    """A mounted workspace and a native sibling directory on the same
    filesystem, both holding every case's starting tree under ``old/``
    (made before the mount: objects the open layer has to capture)."""
    base = tmp_path_factory.mktemp("posix")
    with managed_workspace(base / "ws") as ws:
        native = base / "native"
        for root in (ws.path, native):
            for layer in LAYERS:
                (root / layer).mkdir(parents=True)
            for case in CASES:
                in_dir(root / "old" / case.sub, lambda case=case: build(case.setup), create=True)
            for size, _ in APPENDS:
                (root / "old" / f"append-{size}").write_bytes(APPEND_HEAD)
        ws.mount()
        yield Roots(ws, native, ws.snapshot(), backing_dir(ws))


# -- building trees ------------------------------------------------------------------------


def build(spec: str) -> None:
    """Create entries in the current directory from a spec of space-separated
    items ``PATH[:MODE[:UID[:GID]]]``, where PATH is ``name/`` (directory),
    ``name=text`` (file), ``name->target`` (symlink), ``name=>other``
    (hard link) or ``name`` (a file holding ``data``)."""
    for item in spec.split():
        path, *attrs = item.split(":")
        if path.endswith("/"):
            path = path[:-1]
            os.mkdir(path)
        elif "->" in path:
            path, target = path.split("->")
            os.symlink(target, path)
        elif "=>" in path:
            path, other = path.split("=>")
            os.link(other, path)
        else:
            path, _, text = path.partition("=")
            with open(path, "wb") as f:
                f.write(text.encode() if "=" in item else b"data\n")
        if len(attrs) > 1:
            uid = int(attrs[1])
            os.chown(path, uid, int(attrs[2]) if len(attrs) > 2 else uid, follow_symlinks=False)
        if attrs and attrs[0]:
            os.chmod(path, int(attrs[0], 8))


def entries(top: str = ".") -> list[str]:
    out = [top]
    for dirpath, dirnames, filenames in os.walk(top):
        out += [os.path.join(dirpath, n) for n in dirnames + filenames]
    return out


def settle() -> None:
    """Old atimes and mtimes everywhere; then let the clock tick past the
    ctimes that this set."""
    for p in entries():
        os.utime(p, ns=(T0, T0), follow_symlinks=False)
    time.sleep(0.02)  # a clock tick (the thing waited for), not a condition


def tree() -> list[tuple]:
    """Names, types, file contents and symlink targets under '.'."""
    out = []
    for p in sorted(entries()):
        st = os.lstat(p)
        kind = stat.S_IFMT(st.st_mode)
        if stat.S_ISREG(st.st_mode):
            with open(p, "rb") as f:
                out.append((p, kind, f.read()))
        elif stat.S_ISLNK(st.st_mode):
            out.append((p, kind, os.readlink(p)))
        else:
            out.append((p, kind, None))
    return out


def lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def facts(before: os.stat_result | None, after: os.stat_result | None) -> dict | None:
    """What matters about one watched name after the operation."""
    if after is None:
        return None
    out = {
        "mode": oct(after.st_mode),
        "uid": after.st_uid,
        "gid": after.st_gid,
        "nlink": after.st_nlink,
    }
    out["size"] = after.st_size
    if before is not None:
        out["same object"] = before.st_ino == after.st_ino
        if before.st_ino == after.st_ino:
            out["changed"] = changed(before, after)
    return out


def changed(before: os.stat_result | None, after: os.stat_result | None) -> list[str] | None:
    if before is None or after is None or before.st_ino != after.st_ino:
        return None
    return [
        t
        for t in ("atime", "mtime", "ctime")
        if getattr(before, f"st_{t}_ns") != getattr(after, f"st_{t}_ns")
    ]


# -- running an operation ------------------------------------------------------------------


def touch(*args: str) -> int:
    """touch(1) with *args*; its exit status."""
    return subprocess.run(["touch", *args], check=False).returncode


def outcome(op: Callable[[], object]) -> tuple:
    try:
        return ("ok", op())
    except OSError as e:
        return ("error", errno.errorcode.get(e.errno, e.errno))


def in_child(fn: Callable[[], object], name: str = "child") -> int:
    """Fork a process that runs *fn* and exits: 0 if it returned, 1 (saying
    why on stderr) if it raised.  Its pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            fn()
            code = 0
        except BaseException as e:
            os.write(2, f"{name}: {e!r}\n".encode())
        finally:
            os._exit(code)
    return pid


def as_user(op: Callable[[], object], uid: int = USER, gid: int = USER) -> tuple:
    """The outcome of *op* run by an unprivileged user, in a forked child
    (in the current directory, whatever the modes of its ancestors)."""
    r, w = os.pipe()

    def child():
        os.close(r)
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        os.write(w, pickle.dumps(outcome(op)))

    pid = in_child(child)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return pickle.loads(data)


@dataclass
class Case:
    name: str
    setup: str
    op: Callable[[], object]
    watch: str = "."  # space-separated names whose facts are compared
    user: bool = False  # run the operation as USER
    known: str = ""  # why the pyfuse3 engine cannot behave natively here (xfail)
    extra: Callable[[], object] | None = field(default=None)  # observed after the operation

    @property
    def sub(self) -> str:
        return self.name.replace(" ", "-")


def in_dir(d: Path, fn: Callable[[], object], create: bool = False):
    """Run *fn* in directory *d* under umask 022."""
    if create:
        d.mkdir()
    old_cwd, old_umask = os.getcwd(), os.umask(0o022)
    os.chdir(d)
    try:
        return fn()
    finally:
        os.chdir(old_cwd)
        os.umask(old_umask)


def observe(case: Case, underneath: Path | None = None) -> dict:
    """Run the case's operation in the current directory (which holds its
    starting tree) and describe what came of it.  *underneath*: the same
    directory in the backing tree of a mount, whose timestamps must change
    as the view's do (natively: the directory itself)."""
    settle()
    watched = case.watch.split()
    under = underneath or Path(".")
    before = {p: (lstat(p), lstat(under / p)) for p in watched}
    result = as_user(case.op) if case.user else outcome(case.op)
    after = {p: (lstat(p), lstat(under / p)) for p in watched}
    return {
        "result": result,
        "facts": {p: facts(before[p][0], after[p][0]) for p in watched},
        "underneath": {p: changed(before[p][1], after[p][1]) for p in watched},
        "extra": case.extra() if case.extra else None,
        "tree": tree(),
    }


# -- operations ------------------------------------------------------------------------------


def opened(path, flags, mode=0o666, then: Callable[[int], object] | None = None):
    """open(), an optional action on the fd, close()."""

    def op():
        fd = os.open(path, flags, mode)
        try:
            return then(fd) if then else None
        finally:
            os.close(fd)

    return op


def held(path: str, change: Callable[[], object]):
    """*change* while *path* is open; the link count and size the open file
    reports afterwards."""

    def w(fd):
        change()
        st = os.fstat(fd)
        return st.st_nlink, st.st_size if stat.S_ISREG(st.st_mode) else None

    return opened(path, os.O_RDONLY, then=w)


def rename2(src: str, dst: str, flags: int):
    return lambda: B.renameat2(AT_FDCWD, src.encode(), AT_FDCWD, dst.encode(), flags)


def read(path: str):
    return opened(path, os.O_RDONLY, then=lambda fd: os.read(fd, 100))


def write(path: str, data: bytes = b"more", flags: int = os.O_WRONLY, offset: int | None = None):
    def w(fd):
        return os.write(fd, data) if offset is None else os.pwrite(fd, data, offset)

    return opened(path, flags, then=w)


FALLOC_KEEP_SIZE, FALLOC_PUNCH_HOLE = 1, 2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, mode, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def copy_case(
    name: str,
    setup: str,
    src: str,
    dst: str,
    count: int,
    off_in: int,
    off_out: int,
    src_flags: int = os.O_RDONLY,
    dst_flags: int = os.O_WRONLY,
    user: bool = False,
) -> Case:
    """A case of copy_file_range(2): *count* bytes of *src* at *off_in* to
    *dst* at *off_out*, within one file opened read-write when they are one
    name; both names watched."""

    def op():
        fd_in = os.open(src, RW if src == dst else src_flags)
        try:
            fd_out = fd_in if src == dst else os.open(dst, dst_flags)
            try:
                return os.copy_file_range(fd_in, fd_out, count, off_in, off_out)
            finally:
                if fd_out != fd_in:
                    os.close(fd_out)
        finally:
            os.close(fd_in)

    watch = " ".join([".", *dict.fromkeys([src, dst])])
    return Case(f"copy_file_range {name}".strip(), setup, op, watch, user=user)


def xattrs(path: str = "f"):
    return lambda: sorted(
        (n, os.getxattr(path, n, follow_symlinks=False))
        for n in os.listxattr(path, follow_symlinks=False)
    )


WHITEOUT = 4
LONG = "n" * 255
TOO_LONG = "n" * 256
RW, CREAT, EXCL, TRUNC = os.O_RDWR, os.O_CREAT, os.O_EXCL, os.O_TRUNC
APPEND = os.O_WRONLY | os.O_APPEND
OWN_SETUID = f"d/:0777 s=0123 d/t=abcdef:4755:{USER}"  # (USER's setuid file)

CASES = [
    # mkdir / rmdir
    Case("mkdir", "", lambda: os.mkdir("d"), ". d"),
    Case("mkdir sticky mode", "", lambda: os.mkdir("d", 0o1777), ". d"),
    Case("mkdir over dir", "d/", lambda: os.mkdir("d"), ". d"),
    Case("mkdir over file", "f", lambda: os.mkdir("f"), ". f"),
    Case("mkdir over dangling symlink", "l->nowhere", lambda: os.mkdir("l"), ". l"),
    Case("mkdir in missing parent", "", lambda: os.mkdir("no/d"), "."),
    Case("mkdir in a file", "f", lambda: os.mkdir("f/d"), ". f"),
    Case("rmdir", "d/ d/e/", lambda: os.rmdir("d/e"), ". d"),
    Case("rmdir non-empty", "d/ d/f", lambda: os.rmdir("d"), ". d"),
    Case("rmdir file", "f", lambda: os.rmdir("f"), ". f"),
    Case("rmdir dot", "d/", lambda: os.rmdir("d/."), ". d"),
    Case("rmdir dotdot", "d/", lambda: os.rmdir("d/.."), ". d"),
    Case("rmdir symlink to dir", "d/ l->d", lambda: os.rmdir("l"), ". d l"),
    # unlink
    Case("unlink", "f", lambda: os.unlink("f"), ". f"),
    Case("unlink one of two links", "f g=>f", lambda: os.unlink("f"), ". g"),
    Case("unlink dir", "d/", lambda: os.unlink("d"), ". d"),
    Case("unlink missing", "", lambda: os.unlink("f"), "."),
    Case("unlink symlink", "f l->f", lambda: os.unlink("l"), ". f"),
    Case("unlink while open", "f", held("f", lambda: os.unlink("f")), ". f"),
    Case("unlink one of two links while open", "f g=>f", held("f", lambda: os.unlink("f")), ". g"),
    Case("rmdir while open", "d/", held("d", lambda: os.rmdir("d")), "."),
    Case("rename over a file held open", "f g", held("g", lambda: os.rename("f", "g")), ". g"),
    Case("unlink through file", "f", lambda: os.unlink("f/x"), ". f"),
    # rename
    Case("rename file", "f", lambda: os.rename("f", "g"), ". g"),
    Case("rename file to another dir", "f d/", lambda: os.rename("f", "d/f"), ". d d/f"),
    Case("rename file over file", "f=one g=two h=>g", lambda: os.rename("f", "g"), ". g h"),
    Case("rename over own hard link", "f g=>f", lambda: os.rename("f", "g"), ". f g"),
    Case("rename onto itself", "f", lambda: os.rename("f", "f"), ". f"),
    Case("rename dir over empty dir", "a/ a/f b/", lambda: os.rename("a", "b"), ". b"),
    Case("rename dir over non-empty dir", "a/ b/ b/f", lambda: os.rename("a", "b"), ". a b"),
    Case("rename file over dir", "f d/", lambda: os.rename("f", "d"), ". f d"),
    Case("rename dir over file", "d/ f", lambda: os.rename("d", "f"), ". f d"),
    Case("rename dir into own subdir", "d/ d/e/", lambda: os.rename("d", "d/e/x"), ". d"),
    Case(
        "rename dir to another parent", "a/ a/d/ b/", lambda: os.rename("a/d", "b/d"), ". a b b/d"
    ),
    Case(
        "rename dir over empty dir in another parent",
        "a/ a/d/ a/d/f b/ b/e/",
        lambda: os.rename("a/d", "b/e"),
        ". a b b/e",
    ),
    Case(
        "rename exchange dirs across parents",
        "a/ a/d/ b/ b/e/ b/e/f",
        rename2("a/d", "b/e", B.RENAME_EXCHANGE),
        ". a b a/d b/e",
    ),
    Case("rename exchange hard links", "f g=>f", rename2("f", "g", B.RENAME_EXCHANGE), ". f g"),
    Case("rename missing", "", lambda: os.rename("f", "g"), "."),
    Case("rename file to trailing slash", "f", lambda: os.rename("f", "g/"), ". f"),
    Case("rename symlink", "f l->f", lambda: os.rename("l", "m"), ". f m"),
    Case("rename noreplace onto existing", "f g", rename2("f", "g", B.RENAME_NOREPLACE), ". f g"),
    Case("rename noreplace to new name", "f", rename2("f", "g", B.RENAME_NOREPLACE), ". g"),
    Case("rename exchange file and dir", "f d/ d/x", rename2("f", "d", B.RENAME_EXCHANGE), ". f d"),
    Case(
        "rename exchange across dirs",
        "a/ a/f=one b/ b/g/",
        rename2("a/f", "b/g", B.RENAME_EXCHANGE),
        ". a b a/f b/g",
    ),
    Case("rename exchange with missing", "f", rename2("f", "g", B.RENAME_EXCHANGE), ". f"),
    Case(
        "rename exchange and noreplace",
        "f g",
        rename2("f", "g", B.RENAME_EXCHANGE | B.RENAME_NOREPLACE),
        ". f g",
    ),
    Case("rename whiteout", "f", rename2("f", "g", WHITEOUT), ". f g"),
    # link / symlink / mknod
    Case("link", "f", lambda: os.link("f", "g"), ". f"),
    Case("link dir", "d/", lambda: os.link("d", "e"), ". d"),
    Case("link over existing", "f g", lambda: os.link("f", "g"), ". f g"),
    Case(
        "link symlink itself", "f l->f", lambda: os.link("l", "m", follow_symlinks=False), ". f l"
    ),
    Case("link through symlink", "f l->f", lambda: os.link("l", "m"), ". f l"),
    Case("symlink", "", lambda: os.symlink("target", "l"), ". l"),
    Case("symlink over existing", "f", lambda: os.symlink("t", "f"), ". f"),
    Case("symlink long target", "", lambda: os.symlink("t" * 4095, "l"), ". l"),
    Case("symlink too long target", "", lambda: os.symlink("t" * 4096, "l"), "."),
    Case("mkfifo", "", lambda: os.mkfifo("p", 0o640), ". p"),
    Case(
        "mknod char device",
        "",
        lambda: os.mknod("c", 0o600 | stat.S_IFCHR, os.makedev(1, 3)),
        ". c",
    ),
    # symlink loops
    Case("open self loop", "l->l", read("l"), ". l"),
    Case("open two-link loop", "a->b b->a", read("a"), ". a b"),
    Case("stat through loop", "a->b b->a", lambda: os.stat("a/x") and None, "."),
    Case("open nofollow symlink", "f l->f", opened("l", os.O_RDONLY | os.O_NOFOLLOW), ". l"),
    Case("open nofollow path symlink", "f l->f", opened("l", os.O_PATH | os.O_NOFOLLOW), ". l"),
    Case("create through dangling symlink", "l->new", opened("l", os.O_WRONLY | CREAT), ". l"),
    Case(
        "create excl on dangling symlink", "l->new", opened("l", os.O_WRONLY | CREAT | EXCL), ". l"
    ),
    Case("readlink", "l->target", lambda: os.readlink("l"), ". l"),
    # name lengths
    Case("create 255-byte name", "", opened(LONG, os.O_WRONLY | CREAT), "."),
    Case("create 256-byte name", "", opened(TOO_LONG, os.O_WRONLY | CREAT), "."),
    Case("mkdir 256-byte name", "", lambda: os.mkdir(TOO_LONG), "."),
    Case("stat 256-byte name", "", lambda: os.stat(TOO_LONG) and None, "."),
    Case("stat missing 255-byte name", "", lambda: os.stat(LONG) and None, "."),
    Case("rename to 256-byte name", "f", lambda: os.rename("f", TOO_LONG), ". f"),
    Case("symlink 256-byte name", "", lambda: os.symlink("t", TOO_LONG), "."),
    Case("link to 256-byte name", "f", lambda: os.link("f", TOO_LONG), ". f"),
    # open flags, reads and writes
    Case("create", "", opened("f", os.O_WRONLY | CREAT, 0o777), ". f"),
    Case("create excl on existing", "f", opened("f", os.O_WRONLY | CREAT | EXCL), ". f"),
    Case("create on existing", "f", opened("f", os.O_WRONLY | CREAT), ". f"),
    Case("create on dir", "d/", opened("d", os.O_RDONLY | CREAT), ". d"),
    Case("o_directory on file", "f", opened("f", os.O_RDONLY | os.O_DIRECTORY), ". f"),
    Case("open file with trailing slash", "f", opened("f/", os.O_RDONLY), ". f"),
    Case("o_trunc", "f=some-content", opened("f", os.O_WRONLY | TRUNC), ". f"),
    Case("o_trunc on empty file", "f=", opened("f", os.O_WRONLY | TRUNC), ". f"),
    Case("open dir for writing", "d/", opened("d", os.O_WRONLY), ". d"),
    Case("open dir read-write", "d/", opened("d", RW), ". d"),
    Case("write", "f=0123456789", write("f", offset=3), ". f"),
    Case("write nothing", "f=0123456789", write("f", b""), ". f"),
    Case("append", "f=0123456789", write("f", flags=os.O_WRONLY | os.O_APPEND), ". f"),
    Case(
        "pwrite on an append fd",
        "f=0123456789",
        write("f", flags=os.O_WRONLY | os.O_APPEND, offset=0),
        ". f",
    ),
    Case("write to read-only fd", "f", write("f", flags=os.O_RDONLY), ". f"),
    Case(
        "read from write-only fd",
        "f",
        opened("f", os.O_WRONLY, then=lambda fd: os.read(fd, 1)),
        ". f",
    ),
    Case("pwrite past the end", "f=0123", write("f", offset=10_000), ". f"),
    Case("read", "f=0123456789", read("f"), ". f"),
    Case("read dir", "d/", read("d"), ". d"),
    Case("open read-only", "f", opened("f", os.O_RDONLY), ". f"),
    Case("open dir without reading it", "d/ d/f", opened("d", os.O_RDONLY | os.O_DIRECTORY), ". d"),
    Case("read twice", "f=0123456789", lambda: (read("f")(), read("f")()), ". f"),
    Case("list dir", "d/ d/f", lambda: sorted(os.listdir("d")), ". d"),
    Case("fsync", "f", opened("f", os.O_WRONLY, then=os.fsync), ". f"),
    Case(
        "o_tmpfile",
        "d/",
        opened("d", os.O_WRONLY | os.O_TMPFILE),
        ". d",
        known="pyfuse3 has no tmpfile operation (EOPNOTSUPP)",
    ),
    Case(
        "seek hole",
        "f",
        opened("f", RW, then=lambda fd: (os.ftruncate(fd, 1 << 20), os.lseek(fd, 0, os.SEEK_HOLE))),
        ". f",
        known="pyfuse3 has no lseek operation: no holes are reported",
    ),
    Case(
        "punch hole",
        "f=0123456789",
        opened("f", RW, then=lambda fd: fallocate(fd, FALLOC_PUNCH_HOLE | FALLOC_KEEP_SIZE, 0, 4)),
        ". f",
        known="pyfuse3 has no fallocate operation (EOPNOTSUPP)",
    ),
    Case(
        "posix_fallocate",
        "f=0123",
        opened("f", RW, then=lambda fd: os.posix_fallocate(fd, 0, 10_000)),
        ". f",
    ),
    copy_case("", "s=0123456789 d=abcdefghij", "s", "d", 4, 2, 3),
    copy_case("past the source's end", "s=0123 d=abcd", "s", "d", 4, 10, 0),
    copy_case("of nothing", "s=0123 d=abcd", "s", "d", 0, 0, 0),
    copy_case("beyond the source's end", "s=0123456789 d=abcd", "s", "d", 100, 6, 1),
    copy_case("past the destination's end", "s=0123 d=ab", "s", "d", 4, 0, 10_000),
    copy_case("within a file", "f=0123456789", "f", "f", 3, 0, 6),
    copy_case("within a file overlapping", "f=0123456789", "f", "f", 6, 0, 2),
    copy_case("to an append fd", "s=0123 d=ab", "s", "d", 4, 0, 0, dst_flags=APPEND),
    copy_case("from a write-only fd", "s=0123 d=ab", "s", "d", 4, 0, 0, src_flags=os.O_WRONLY),
    copy_case("by user into own setuid file", OWN_SETUID, "s", "d/t", 4, 0, 1, user=True),
    # attributes
    Case("fchmod", "f", opened("f", os.O_RDONLY, then=lambda fd: os.fchmod(fd, 0o600)), ". f"),
    Case("fchown", "f", opened("f", os.O_RDONLY, then=lambda fd: os.fchown(fd, USER, -1)), ". f"),
    Case("futimens now", "f", opened("f", os.O_RDONLY, then=lambda fd: os.utime(fd)), ". f"),
    Case(
        "ftruncate longer",
        "f=0123",
        opened("f", os.O_WRONLY, then=lambda fd: os.ftruncate(fd, 9000)),
        ". f",
    ),
    Case("truncate shorter", "f=0123456789", lambda: os.truncate("f", 3), ". f"),
    Case("truncate longer", "f=0123", lambda: os.truncate("f", 100), ". f"),
    Case("truncate to same size", "f=0123", lambda: os.truncate("f", 4), ". f"),
    Case(
        "ftruncate to same size",
        "f=0123",
        opened("f", os.O_WRONLY, then=lambda fd: os.ftruncate(fd, 4)),
        ". f",
    ),
    Case("truncate dir", "d/", lambda: os.truncate("d", 0), ". d"),
    Case("truncate through symlink", "f=0123 l->f", lambda: os.truncate("l", 1), ". f l"),
    Case("chmod", "f", lambda: os.chmod("f", 0o600), ". f"),
    Case("chmod same mode", "f:0644", lambda: os.chmod("f", 0o644), ". f"),
    Case("chmod dir setgid", "d/", lambda: os.chmod("d", 0o2755), ". d"),
    Case("chmod through symlink", "f l->f", lambda: os.chmod("l", 0o640), ". f l"),
    Case("chown", "f", lambda: os.chown("f", USER, USER), ". f"),
    Case("chown to nobody-change", "f", lambda: os.chown("f", -1, -1), ". f"),
    Case("chown nothing of setuid file", "f:6775", lambda: os.chown("f", -1, -1), ". f"),
    Case("chown setuid file", "f:4755", lambda: os.chown("f", USER, USER), ". f"),
    Case("chown setgid dir", "d/:2775", lambda: os.chown("d", USER, USER), ". d"),
    Case(
        "lchown symlink",
        "f l->f",
        lambda: os.chown("l", USER, USER, follow_symlinks=False),
        ". f l",
    ),
    Case("utime explicit", "f", lambda: os.utime("f", ns=(5, 6)), ". f"),
    Case("utime now", "f", lambda: os.utime("f"), ". f"),
    Case(
        "utime symlink", "f l->f", lambda: os.utime("l", ns=(5, 6), follow_symlinks=False), ". f l"
    ),
    Case("utime dir", "d/", lambda: os.utime("d", ns=(5, 6)), ". d"),
    # (one time set, the other left as it is: UTIME_OMIT)
    Case("touch -m", "f", lambda: touch("-m", "-d", "@5", "f"), ". f"),
    Case("touch -a", "f", lambda: touch("-a", "-d", "@5", "f"), ". f"),
    Case("setxattr", "f", lambda: os.setxattr("f", "user.k", b"v"), ". f", extra=xattrs()),
    Case("setxattr dir", "d/", lambda: os.setxattr("d", "user.k", b"v"), ". d", extra=xattrs("d")),
    Case(
        "setxattr create existing",
        "f",
        lambda: (
            os.setxattr("f", "user.k", b"v"),
            os.setxattr("f", "user.k", b"w", os.XATTR_CREATE),
        ),
        ". f",
        extra=xattrs(),
    ),
    Case(
        "setxattr replace missing",
        "f",
        lambda: os.setxattr("f", "user.k", b"v", os.XATTR_REPLACE),
        ". f",
        extra=xattrs(),
    ),
    Case("removexattr missing", "f", lambda: os.removexattr("f", "user.k"), ". f"),
    Case("getxattr missing", "f", lambda: os.getxattr("f", "user.k"), ". f"),
    Case(
        "setxattr on symlink",
        "f l->f",
        lambda: os.setxattr("l", "user.k", b"v", follow_symlinks=False),
        ". f l",
    ),
    Case(
        "setxattr trusted", "f", lambda: os.setxattr("f", "trusted.k", b"v"), ". f", extra=xattrs()
    ),
    # cross-device
    Case(
        "rename to another filesystem",
        "f",
        lambda: os.rename("f", f"/dev/shm/cowfs-posix-{os.getpid()}"),
        ". f",
    ),
    Case(
        "link to another filesystem",
        "f",
        lambda: os.link("f", f"/dev/shm/cowfs-posix-{os.getpid()}"),
        ". f",
    ),
    # permissions, as an unprivileged user
    Case("user reads 0600 file of root", "f:0600", read("f"), ". f", user=True),
    Case("user reads 0644 file of root", "f:0644", read("f"), ". f", user=True),
    Case("user writes 0644 file of root", "f:0644", write("f"), ". f", user=True),
    Case(
        "user creates in 0755 dir of root",
        "d/:0755",
        opened("d/f", os.O_WRONLY | CREAT),
        ". d",
        user=True,
    ),
    Case("user mkdir in 0755 dir of root", "d/:0755", lambda: os.mkdir("d/e"), ". d", user=True),
    Case(
        "user creates in 0777 dir",
        "d/:0777",
        opened("d/f", os.O_WRONLY | CREAT, 0o666),
        ". d d/f",
        user=True,
    ),
    Case(
        "user creates in setgid dir",
        f"d/:2777:0:{GROUP}",
        opened("d/f", os.O_WRONLY | CREAT, 0o2777),
        ". d d/f",
        user=True,
    ),
    Case(
        "user mkdir in setgid dir",
        f"d/:2777:0:{GROUP}",
        lambda: os.mkdir("d/e", 0o777),
        ". d d/e",
        user=True,
    ),
    Case(
        "user creates a mode-0 file and writes it",
        "d/:0777",
        opened("d/f", RW | CREAT, 0, then=lambda fd: (os.write(fd, b"x"), os.pread(fd, 9, 0))),
        ". d d/f",
        user=True,
    ),
    Case("user opens own 0400 file for writing", f"f:0400:{USER}", write("f"), ". f", user=True),
    Case(
        "user renames out of 0755 dir of root",
        "a/:0755 a/f:0666 b/:0777",
        lambda: os.rename("a/f", "b/f"),
        ". a b",
        user=True,
    ),
    Case("user enters 0700 dir of root", "d/:0700 d/f", read("d/f"), ". d", user=True),
    Case(
        "user deletes root's file in sticky dir",
        "t/:1777 t/f:0666",
        lambda: os.unlink("t/f"),
        ". t t/f",
        user=True,
    ),
    Case(
        "user deletes own file in sticky dir",
        f"t/:1777 t/f::{USER}",
        lambda: os.unlink("t/f"),
        ". t",
        user=True,
    ),
    Case(
        "user renames root's file in sticky dir",
        "t/:1777 t/f:0666",
        lambda: os.rename("t/f", "t/g"),
        ". t t/f",
        user=True,
    ),
    Case(
        "user replaces root's file in sticky dir",
        f"t/:1777 t/f:0666 t/g::{USER}",
        lambda: os.rename("t/g", "t/f"),
        ". t t/f t/g",
        user=True,
    ),
    Case("user chmods root's file", "f:0666", lambda: os.chmod("f", 0o600), ". f", user=True),
    Case(
        "user chowns own file to root", f"f::{USER}", lambda: os.chown("f", 0, 0), ". f", user=True
    ),
    Case(
        "user chgrps own file to a foreign group",
        f"f::{USER}",
        lambda: os.chown("f", -1, GROUP),
        ". f",
        user=True,
    ),
    Case(
        "user sets setgid on own file of a foreign group",
        f"f::{USER}:{GROUP}",
        lambda: os.chmod("f", 0o2755),
        ". f",
        user=True,
    ),
    Case("user touches writable file of root", "f:0666", lambda: os.utime("f"), ". f", user=True),
    Case(
        "user sets times of writable file of root",
        "f:0666",
        lambda: os.utime("f", ns=(5, 6)),
        ". f",
        user=True,
    ),
    Case(
        "user truncates 0644 file of root", "f:0644", lambda: os.truncate("f", 0), ". f", user=True
    ),
    Case("user writes own setuid file", f"f:4755:{USER}", write("f"), ". f", user=True),
    Case(
        "user truncates own setgid file",
        f"f:2775:{USER}:{USER}",
        lambda: os.truncate("f", 1),
        ". f",
        user=True,
    ),
    Case("user writes 0666 setuid file of root", "f:4777", write("f"), ". f", user=True),
    Case(
        "user sets xattr on 0644 file of root",
        "f:0644",
        lambda: os.setxattr("f", "user.k", b"v"),
        ". f",
        user=True,
    ),
    Case(
        "user sets xattr on own file",
        f"f::{USER}",
        lambda: os.setxattr("f", "user.k", b"v"),
        ". f",
        user=True,
        extra=xattrs(),
    ),
    Case(
        "user hard-links 0600 file of root",
        "d/:0777 f:0600",
        lambda: os.link("f", "d/g"),
        ". f d",
        user=True,
    ),
    Case(
        "user opens root's file noatime",
        "f:0644",
        opened("f", os.O_RDONLY | os.O_NOATIME),
        ". f",
        user=True,
    ),
    Case(
        "user access",
        "f:0640",
        lambda: [os.access("f", m) for m in (os.R_OK, os.W_OK)],
        ". f",
        user=True,
    ),
]


LAYERS = ("old", "new")


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_like_native(roots, case, layer, engine, request):
    """*layer* "old": the starting tree predates the open layer; "new": it
    was made in it (nothing of it needs capturing)."""
    if case.known and engine == "pyfuse3":
        request.applymarker(pytest.mark.xfail(reason=case.known, strict=True))

    def run(underneath=None):
        if layer == "new":
            build(case.setup)
        return observe(case, underneath)

    new = layer == "new"
    want = in_dir(roots.native / layer / case.sub, run, create=new)
    got = in_dir(
        roots.ws.path / layer / case.sub, lambda: run(roots.backing / layer / case.sub), create=new
    )
    assert got == want, "\n".join(differences(want, got))


def differences(want: dict, got: dict) -> list[str]:
    out = ["cowfs differs from native:"]
    for key in want:
        if key in ("facts", "underneath"):
            for p, w in want[key].items():
                g = got[key][p]
                if w != g:
                    out.append(f"  {key} {p}: native {w}\n  {' ' * len(key + p)}   cowfs  {g}")
        elif want[key] != got[key]:
            out.append(f"  {key}: native {want[key]}\n  {' ' * len(key)}  cowfs  {got[key]}")
    return out


def test_link_count_of_the_root(roots):
    """The store lies hidden in the workspace root: the root's link count
    counts the subdirectories one can see, as natively."""
    assert sorted(os.listdir(roots.ws.path)) == sorted(os.listdir(roots.native))
    assert os.stat(roots.ws.path).st_nlink == os.stat(roots.native).st_nlink


# -- across mounts -----------------------------------------------------------------------------


@pytest.mark.parametrize("op", [os.rename, os.link])
def test_renames_and_links_out_of_the_mount_are_cross_device(roots, op):
    """Out of the mount into the native directory (the same filesystem
    underneath) is across mounts; natively, across filesystems fails alike."""
    name = f"leaving-by-{op.__name__}"
    src, native_src = roots.ws / "new" / name, roots.native / "new" / name
    for p in (src, native_src):
        p.write_text("x")
    for a, b in [(src, roots.native / name), (native_src, Path("/dev/shm") / name)]:
        with pytest.raises(OSError) as e:
            op(a, b)
        assert e.value.errno == errno.EXDEV
        assert a.exists() and not b.exists()


# -- O_APPEND with concurrent writers ---------------------------------------------------------

APPEND_HEAD = b"records follow\n"
APPEND_WRITERS = 4
APPENDS = [(3000, 150), (150_000, 8)]  # (record size, records per writer)


def record(writer: int, i: int, size: int) -> bytes:
    head = b"%d:%06d:" % (writer, i)
    return head + bytes([ord("a") + writer]) * (size - len(head) - 1) + b"\n"


def append_concurrently(path: Path, size: int, count: int) -> None:
    """APPEND_WRITERS processes, released together, each appending *count*
    records of *size* bytes with one write(2) each."""
    go_r, go_w = os.pipe()

    def append(writer: int) -> None:
        os.close(go_w)
        os.read(go_r, 1)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        for i in range(count):
            if os.write(fd, record(writer, i, size)) != size:
                raise OSError(errno.EIO, "short write")
        os.close(fd)

    pids = [in_child(functools.partial(append, w), f"writer {w}") for w in range(APPEND_WRITERS)]
    os.close(go_r)
    os.close(go_w)  # go
    for pid in pids:
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


@pytest.mark.parametrize("where", ["native", "cowfs"])
@pytest.mark.parametrize("size,count", APPENDS)
def test_concurrent_appends_lose_and_tear_nothing(roots, where, size, count):
    root = roots.native if where == "native" else roots.ws.path
    path = root / "old" / f"append-{size}"
    append_concurrently(path, size, count)
    data = path.read_bytes()
    assert data.startswith(APPEND_HEAD)
    body = data[len(APPEND_HEAD) :]
    assert len(body) == APPEND_WRITERS * count * size
    seen = {w: [] for w in range(APPEND_WRITERS)}
    for off in range(0, len(body), size):
        rec = body[off : off + size]
        writer, i = (int(x) for x in rec.split(b":", 2)[:2])
        assert rec == record(writer, i, size), f"torn record at {off}"
        seen[writer].append(i)
    assert all(seen[w] == list(range(count)) for w in seen)  # each writer's in order


# -- creation modes: the caller's umask, never the daemon's ------------------------

CALLER_UMASKS = (0o000, 0o002, 0o022, 0o077)


def _make_objects(prefix: str) -> None:
    """Create one object of each kind with the widest modes a program asks
    for, in the current directory."""
    import socket

    os.close(os.open(f"{prefix}file", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o666))
    os.close(os.open(f"{prefix}exe", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o777))
    os.mkdir(f"{prefix}dir", 0o777)
    os.mkdir(f"{prefix}sticky", 0o1777)
    os.mkfifo(f"{prefix}fifo", 0o666)
    os.mknod(f"{prefix}node", 0o644 | stat.S_IFREG)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(f"{prefix}sock")
    os.symlink("target", f"{prefix}link")


def _modes(d: Path) -> dict[str, int]:
    return {p.name: os.lstat(p).st_mode for p in sorted(d.iterdir())}


@pytest.mark.parametrize("daemon_umask", [0o022, 0o077], ids=["daemon022", "daemon077"])
def test_creation_modes_follow_the_callers_umask(tmp_path, daemon_umask, fuse):
    """Objects get exactly the mode asked for minus the caller's umask,
    whatever umask the daemon was started under; native ext4 agrees."""
    native = tmp_path / "native"
    native.mkdir()
    with managed_workspace(tmp_path / "ws") as ws:
        old = os.umask(daemon_umask)
        try:
            ws.mount()
        finally:
            os.umask(old)
        ws.checkpoint("modes")

        def make_all(d: Path) -> None:
            for mask in CALLER_UMASKS:

                def make(mask=mask):
                    os.umask(mask)
                    os.chdir(d)
                    _make_objects(f"u{mask:03o}-")

                pid = in_child(make, f"umask {mask:03o}")
                assert os.waitpid(pid, 0)[1] == 0

        make_all(native)
        make_all(ws.path)
        got = {n: m for n, m in _modes(ws.path).items() if n != ".cowfs"}
        assert got == _modes(native)
        # (and underneath, where the daemon made them)
        assert {n: m for n, m in _modes(backing_dir(ws)).items() if n != ".cowfs"} == got
        assert stat.S_IMODE(got["u000-file"]) == 0o666
        assert stat.S_IMODE(got["u002-dir"]) == 0o775
        ws.rollback()
        assert not [n for n in os.listdir(ws.path) if n.startswith("u")]


# -- last: undoing it all ------------------------------------------------------------------


def test_rollback_undoes_every_case(roots):
    """Runs last: everything the cases did, failed operations and other
    users' changes included, is undone exactly."""
    (roots.ws / "new" / "one-more").write_text("so that there is a change")
    roots.ws.rollback()
    treesnap.assert_same(roots.at_mount, roots.ws.snapshot())
