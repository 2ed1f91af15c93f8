"""A rank that ends between two cells: the next cell restarts the pool, says so and runs.

The rank is killed and the cell sent at once: its launcher may not have said yet that the rank
ended (its connection is closed already), and the cell must not fail on the closed connection.
When sending the cell still succeeds, the rank's end is seen during the cell and said as such
(the pool restarts, as for a rank that ends mid-cell); either way the pool goes on.
"""

from __future__ import annotations

import os
import signal
import time

import psutil

from nbaccel.launch.detached.recorder import RelayRenderer
from nbaccel.launch.request import Front, LaunchRequest
from nbaccel.launch.wire.errors import RankCrashed
from nbaccel.notebook.kernel.pool import Pool


def _ended(pid: int, timeout: float = 30.0) -> bool:
    """Whether the process ``pid`` has exited (a zombie counts: nobody needs to have noticed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.01)
    return False


def test_a_rank_killed_between_cells_restarts_the_pool_for_the_next_cell():
    pool = Pool(LaunchRequest.create(Front.MAGIC, num_processes=2, cpu=True))
    try:
        pool.start()
        for round_ in range(3):
            pool.run_cell(f"x = {round_}")
            victim = pool.pids[1]
            os.kill(victim, signal.SIGKILL)
            assert _ended(victim)
            records: list[tuple] = []
            try:  # never a BrokenPipeError or another error of the closed connection
                values = pool.run_cell("y = 7\ny", renderer=RelayRenderer(records.append))
            except RankCrashed as exc:  # the rank's end seen while the cell ran: it says so
                assert "rank 1 was killed by SIGKILL" in str(exc)
                values = pool.run_cell("y = 7\ny")
            else:
                notices = [r[1] for r in records if r[0] == "notice"]
                assert any("restarting the pool" in n for n in notices), records
            assert values[0]["data"]["text/plain"] == "7", records
            assert victim not in pool.pids.values()
            assert pool.pull("y") == {0: 7, 1: 7}
    finally:
        pool.shutdown()
