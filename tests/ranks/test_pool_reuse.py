"""Whether the running pool is kept is decided once (``Pool.serves``), for the magic and the API.

What a cell does not ask for is the running pool's: a pool started with ``--backend gloo`` is
kept by a later ``start_pool(num_processes=2)``, and a default CPU pool (whose ranks run gloo)
is kept by a cell asking for ``gloo`` by name. Only a real difference restarts it.
"""

from __future__ import annotations

import pytest

from nbaccel.launch.request import LaunchRequest
from nbaccel.notebook.kernel.pool import get_pool, shutdown_pool, start_pool


@pytest.fixture
def no_pool():
    shutdown_pool()
    yield
    shutdown_pool()


def test_unnamed_settings_keep_the_running_pool(no_pool):
    request = LaunchRequest(num_processes=2, backend="gloo")
    pool = start_pool(request)
    assert pool.request is request  # taken whole, as the magic passes it
    pids = dict(pool.pids)
    assert start_pool(num_processes=2) is pool  # backend not named: the pool's
    assert start_pool() is pool  # nothing named: the pool as it is
    assert get_pool() is pool and pool.pids == pids


def test_naming_the_backend_the_ranks_run_keeps_the_pool(no_pool):
    pool = start_pool(num_processes=2)  # CPU: the ranks chose gloo
    assert pool.effective_backend == "gloo"
    assert pool.serves(LaunchRequest(backend="gloo")) and not pool.serves(
        LaunchRequest(backend="mpi")
    )
    assert start_pool(num_processes=2, backend="gloo") is pool
    assert not pool.serves(LaunchRequest(num_processes=1))


def test_bad_settings_leave_the_running_pool_alone(no_pool):
    pool = start_pool(num_processes=2)
    with pytest.raises(ValueError, match="start_method"):
        start_pool(num_processes=1, start_method="thread")
    assert get_pool() is pool and pool.running


def test_status_says_why_the_ranks_did_not_report(no_pool):
    from nbaccel.notebook.kernel.cell_renderer import status_bundle

    pool = start_pool(num_processes=2)
    pool.run_cell("globals()[0] = 'a name that is not a string'")  # breaks the names listing
    rows = pool.status()
    assert [row["state"] for row in rows] == ["idle", "idle"]
    assert "AttributeError" in rows[0]["problem"]
    text = status_bundle(rows, "Pool")["text/plain"]
    assert "did not report their details: AttributeError" in text
