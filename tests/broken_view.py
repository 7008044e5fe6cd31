"""A view process (``python -m tests.broken_view``, args as cowfs.view's)
that mounts a real view but does not report it the way `cowfs view`
expects: BROKEN_VIEW=garbage sends an unreadable report once its mount is
live, BROKEN_VIEW=silent sends none and goes on serving.  What a failed
`cowfs view` must clean up (tests/test_mounting.py)."""

from __future__ import annotations

import os
import sys

import cowfs.launch
from cowfs import view


def main() -> int:
    mode = os.environ.get("BROKEN_VIEW", "garbage")
    detach = cowfs.launch.detach

    def broken_detach(ready_fd: int):
        report = detach(ready_fd)

        def broken(msg: dict) -> None:
            if not msg.get("ok"):
                report(msg)
            elif mode == "garbage":
                os.write(ready_fd, b"garbage\n")
        return broken

    cowfs.launch.detach = broken_detach     # view.main takes it from there when called
    return view.main()


if __name__ == "__main__":
    sys.exit(main())
