"""kill -9 of the daemon while programs write, in the middle of a rollback
and of a commit; after mounting again, a rollback to the checkpoint gives
back the checkpoint's tree exactly (tests/crashsoak.py; tools/soak crash
runs many more trials)."""

from __future__ import annotations

import os

import pytest

from . import crashsoak

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fuse", "each_engine")]


@pytest.mark.parametrize("moment", crashsoak.MOMENTS)
def test_kill_9_then_rollback_is_exact(tmp_path, moment):
    seed = int(os.environ.get("COWFS_CRASH_SEED", "0")) or 1000 + crashsoak.MOMENTS.index(moment)
    trial = crashsoak.run_trial(0, tmp_path, seed, writers=4, moment=moment)
    assert trial.exact, trial.detail
