"""A view process (``python -m tests.broken_view``, args as cowfs.fuse.view's)
that mounts a real view but does not report it the way `cowfs view`
expects: BROKEN_VIEW=garbage sends an unreadable report once its mount is
live, BROKEN_VIEW=silent sends none and goes on serving.  What a failed
`cowfs view` must clean up (tests/test_mounting.py).

BROKEN_VIEW=failing reports as it should, but reading the past fails in two
handlers: a symlink's target with an OSError (EACCES), xattrs with an
unexpected exception (logged to $BROKEN_VIEW_LOG); what the view must
answer and survive."""

from __future__ import annotations

import errno
import logging
import os
import sys

import cowfs.service.launch
from cowfs.fuse import view
from cowfs.layers.past import History


def main() -> int:
    mode = os.environ.get("BROKEN_VIEW", "garbage")
    detach = cowfs.service.launch.detach
    if mode == "failing":

        def readlink(self, obj):
            raise PermissionError(errno.EACCES, "planted")

        def xattrs_of(self, obj):
            raise RuntimeError("planted")

        def logging_detach(ready_fd: int):
            report = detach(ready_fd)
            logging.basicConfig(filename=os.environ["BROKEN_VIEW_LOG"], level=logging.INFO)
            return report

        History.readlink, History.xattrs_of = readlink, xattrs_of
        cowfs.service.launch.detach = logging_detach
        return view.main()

    def broken_detach(ready_fd: int):
        report = detach(ready_fd)

        def broken(msg: dict) -> None:
            if not msg.get("ok"):
                report(msg)
            elif mode == "garbage":
                os.write(ready_fd, b"garbage\n")

        return broken

    cowfs.service.launch.detach = broken_detach  # view.main takes it from there when called
    return view.main()


if __name__ == "__main__":
    sys.exit(main())
