"""Capture filters: `.cowfsignore` in the workspace root (gitignore syntax,
read with pathspec's GitIgnoreSpec) plus the mount's `--ignore PATTERN`s.

Changes under a matching path are not captured and cost nothing: status and
diff do not show them, and a rollback leaves them as they are.  What is
matched is the path an object has when it is first changed in a layer; an
object that a layer saw at a path that does not match stays captured
wherever it moves (the filter never hides a change of a path it does not
match).  `.cowfsignore` itself is always captured, and is honoured only
while it belongs to the user who mounted (or root) and nobody else may
write it: another user's would switch off the capture of everyone's
changes at the paths it names (and, read back through a view or `show`,
let uncaptured bytes pass for old ones).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable

import pathspec

from ..system import backing

NAME = b".cowfsignore"
MAX_SIZE = 1 << 20
RECHECK = 1.0  # seconds between looks at .cowfsignore outside of requests


class IgnoreRules:
    """The patterns in force.  `.cowfsignore` is looked at (one lstat) at the
    first match of every request of the mount (``stale``, set by each
    request), so an edit made through the mount applies to the very next
    request; otherwise at most every RECHECK seconds."""

    def __init__(self, rootfd: int, extra: list[str]):
        self.rootfd = rootfd
        self.extra = list(extra)
        self.spec: pathspec.GitIgnoreSpec | None = None
        self._seen: tuple | None = None
        self._checked = 0.0
        self.stale = False
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and not self.stale and now - self._checked < RECHECK:
            return
        self._checked = now
        self.stale = False
        st = backing.lstat_at(self.rootfd, NAME)
        seen = None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if seen == self._seen and not force:
            return
        self._seen = seen
        lines = list(self.extra)
        if (
            st is not None
            and stat.S_ISREG(st.st_mode)
            and st.st_size <= MAX_SIZE
            and st.st_uid in (0, os.geteuid())
            and not st.st_mode & 0o022
        ):
            try:
                fd = os.open(
                    NAME,
                    os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                    dir_fd=self.rootfd,
                )
                try:
                    mine = os.fstat(fd)  # (the file read is the file checked)
                    if (mine.st_ino, mine.st_uid) == (st.st_ino, st.st_uid):
                        lines += os.read(fd, MAX_SIZE).decode("utf-8", "replace").splitlines()
                finally:
                    os.close(fd)
            except OSError:
                pass
        self.spec = (
            pathspec.GitIgnoreSpec.from_lines(lines)
            if any(line.strip() and not line.lstrip().startswith("#") for line in lines)
            else None
        )

    def matches(self, path: bytes | Callable[[], bytes], is_dir: bool) -> bool:
        """Whether changes of the object at *path* (workspace-relative; or
        a function giving it, called only when there are patterns) go
        uncaptured."""
        self.refresh()
        if self.spec is None:
            return False
        if callable(path):
            path = path()
        if not path or path == NAME or path.startswith(b"\0"):
            return False
        return self.spec.match_file(os.fsdecode(path) + ("/" if is_dir else ""))
