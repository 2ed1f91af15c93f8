"""A short day in one real kernel (``benchmarks/day_in_kernel.py``, 18 steps): every kind of
launch and pool cell, nothing wrong, misnamed or hung, nothing leaked. The long day (1,000
steps) is ``benchmarks/stress_launch.py --day 1000``; this keeps it from rotting. The kernel is
fresh: its first launch (ranks forked while the fork server imports) is checked for children."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from day_in_kernel import KINDS, run_day


def test_a_short_day_in_one_kernel(tmp_path):
    shm = tempfile.mkdtemp(prefix="nbaccel-test-", dir="/dev/shm")  # this day's own segments
    env = {"NBACCEL_LOG_DIR": str(tmp_path), "NBACCEL_SHM_DIR": shm}
    try:
        report = run_day(2 * len(KINDS), chunk=len(KINDS), timeout=300, env=env)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert report.get("error") is None, report
    # the fresh kernel's first launch: its ranks' children and setsid'd daemons all ended
    assert report["first_launch"] == {"returned": [True, True], "left": []}, report
    assert report["results"] == {"ok": 2 * len(KINDS)}, report["problems"]
    growth = report["growth"]
    for leak in ("procs", "fds", "shm", "tmp", "logs"):
        assert growth[leak] <= 0, f"{leak} grew: {growth}; new fds {report['new_fds']}"
    assert growth["widgets"] <= 3 * 60, report  # at most the few live views
