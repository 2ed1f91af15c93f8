"""A pool is made from the LaunchRequest it is given (``%%distributed`` passes its own whole);
a new request keeps what it leaves out from the running pool's. No rank is started: a pool's
plan is made when it is created, its ranks when it starts."""

from __future__ import annotations

import pytest

from nbaccel.launch.request import LaunchRequest
from nbaccel.notebook.kernel.pool import Pool


def test_the_pool_keeps_the_request_it_was_given():
    request = LaunchRequest(num_processes=3, backend="gloo", cpu=True, start_method="spawn")
    pool = Pool(request)
    assert pool.request is request
    assert (pool.num_processes, pool.backend, pool.cpu) == (3, "gloo", True)
    assert pool.plan.kind.value == "spawn" and not pool.running
    assert pool.plan.rank_env(0, 1234)["NBACCEL_LAUNCHER"] == "pool"  # Front.MAGIC's ranks


def test_a_cells_mixed_precision_is_not_the_pools():
    pool = Pool(LaunchRequest(num_processes=2, cpu=True, mixed_precision="bf16"))
    assert pool.plan.rank_env(0, 1234)["ACCELERATE_MIXED_PRECISION"] == "no"


def test_what_a_new_request_leaves_out_is_the_running_pools():
    pool = Pool(LaunchRequest(num_processes=3, backend="gloo", cpu=True))
    kept = pool.keeping(LaunchRequest(start_method="spawn"))
    assert (kept.num_processes, kept.backend, kept.cpu, kept.start_method) == (
        3, "gloo", True, "spawn",
    )  # fmt: skip
    named = pool.keeping(LaunchRequest(num_processes=1, backend="mpi"))
    assert (named.num_processes, named.backend) == (1, "mpi")
    assert not pool.serves(named)  # not running: nothing is served


def test_start_pool_takes_a_request_or_its_options_not_both():
    from nbaccel.notebook.kernel.pool import start_pool

    with pytest.raises(TypeError, match="either a LaunchRequest or its options"):
        start_pool(LaunchRequest(), num_processes=2)
    with pytest.raises(TypeError, match="unknown launch option"):
        start_pool(use_port=29500)  # not an option of the pool's front
