"""A pool that outlives its kernel, in real kernels: tensors defined on a detached pool survive
a SIGKILLed kernel; a new kernel attaches and all-reduces them; a third is refused naming the
holder, then takes over; ``%dist_shutdown`` leaves no rank process. A detached pool left with
no kernel ends after its idle time. Nothing is left (the fixture checks processes and shm)."""

from __future__ import annotations

import os
import re
import signal
import time

from detached import runs_fixture  # noqa: F401 (the fixture `runs`)
from kernel import cell_errors, cell_text, run_notebook

from nbaccel.launch.detached.pool_folder import list_pools
from nbaccel.launch.host.processes import pid_alive

_PID = "import os\nprint('PID', os.getpid())"


def _pid(cell) -> int:
    found = re.search(r"PID (\d+)", cell_text(cell))
    assert found, cell_text(cell)
    return int(found.group(1))


def _wait(condition, timeout=60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.2)
    return condition()


def test_a_detached_pool_outlives_a_killed_kernel_and_a_new_kernel_attaches(runs, monkeypatch):
    root, _, env = runs
    monkeypatch.setenv("NBACCEL_RUNS_DIR", str(root))
    define = (
        "%%distributed -n 2 --detach\nimport torch, torch.distributed as dist\n"
        "x = torch.tensor([dist.get_rank() + 1.0, 10.0])\nprint('defined', x.tolist())"
    )
    first = run_notebook(["%load_ext nbaccel", define, _PID], timeout=180, env=env)
    assert not cell_errors(first.cells[1]), cell_text(first.cells[1])
    assert "[rank 1] defined [2.0, 10.0]" in cell_text(first.cells[1])
    (pool,) = list_pools(root)
    ranks = list(pool.rank_pids.values())
    os.kill(_pid(first.cells[2]), signal.SIGKILL)  # the kernel dies; the pool does not
    assert _wait(lambda: list_pools(root)[0].attached is None), list_pools(root)
    assert all(pid_alive(p) for p in ranks)

    reduce = "%%distributed\ndist.all_reduce(x)\nprint('sum', x.tolist())"
    second = run_notebook(
        ["%load_ext nbaccel", "%dist_attach", reduce, "%dist_status", _PID], timeout=180, env=env
    )
    for cell in second.cells:
        assert not cell_errors(cell), cell_text(cell)
    assert f"Attached to the detached pool {pool.id}" in cell_text(second.cells[1])
    out = cell_text(second.cells[2])
    assert "[rank 0] sum [3.0, 20.0]" in out and "[rank 1] sum [3.0, 20.0]" in out, out
    status = cell_text(second.cells[3])
    assert "Detached pools of this user" in status and pool.id in status, status
    holder = _pid(second.cells[4])

    third = run_notebook(
        ["%load_ext nbaccel", f"%dist_attach {pool.id}", f"%dist_attach {pool.id} --takeover",
         "%%distributed\nprint('still', x.tolist())", "%dist_shutdown"],
        timeout=180, env=env, shutdown=True,
    )  # fmt: skip
    refused = cell_text(third.cells[1])
    assert f"attached to kernel pid {holder}" in refused and "--takeover" in refused, refused
    for cell in third.cells[2:]:
        assert not cell_errors(cell), cell_text(cell)
    assert "[rank 1] still [3.0, 20.0]" in cell_text(third.cells[3])
    assert "Pool shut down." in cell_text(third.cells[4])
    assert not any(pid_alive(p) for p in ranks)  # %dist_shutdown waited for their end
    assert list_pools(root) == []
    os.kill(holder, signal.SIGKILL)


def test_an_idle_detached_pool_with_no_kernel_ends_after_its_idle_time(runs, monkeypatch):
    root, _, env = runs
    monkeypatch.setenv("NBACCEL_RUNS_DIR", str(root))
    start = "%%distributed -n 2 --detach --detach_idle 3\nx = 1"
    nb = run_notebook(["%load_ext nbaccel", start], timeout=180, env=env, shutdown=True)
    assert not cell_errors(nb.cells[1]), cell_text(nb.cells[1])
    assert "ends after 3 s" in cell_text(nb.cells[1])
    pools = list_pools(root)
    assert len(pools) == 1 or pools == []  # it may have ended already
    pids = [p for info in pools for p in [info.host_pid, *info.rank_pids.values()]]
    assert _wait(lambda: list_pools(root) == [] and not any(pid_alive(p) for p in pids))
