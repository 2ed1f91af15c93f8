"""A detached run on a real 2-node Ray cluster (the Ray lane): the kernel that started it is
SIGKILLed mid-run; a new kernel re-attaches, sees every line labelled with rank and node, and
gets the per-rank results; nothing of the run is left on this machine."""

from __future__ import annotations

import os
import re
import signal
import time

from detached import runs_fixture  # noqa: F401 (the fixture `runs`)
from kernel import cell_errors, run_notebook, stream_text
from ray_cluster import RayCluster

LINES = 60

START = """
import os
from nbaccel import notebook_launcher

def chatty(lines):
    import time
    for i in range(lines):
        print(f"line {{i}}", flush=True)
        time.sleep(0.1)
    return (int(os.environ["RANK"]), int(os.environ["NODE_RANK"]))

run = notebook_launcher(chatty, ({lines},), num_processes=2, launcher="ray",
                        ray_address={address!r}, ray_placement="strict_spread",
                        ray_keep_warm=0, detach=True)
print("RUN", run.id, "PID", os.getpid())
"""


def test_a_detached_ray_run_outlives_its_kernel(runs):
    _, _, env = runs
    env = {**env, "NBACCEL_RENDERER": "text"}
    with RayCluster(cpus=(2, 2)) as cluster:
        first = run_notebook(
            [START.format(lines=LINES, address=cluster.address)], timeout=120, env=env
        )
        found = re.search(r"RUN (\S+) PID (\d+)", stream_text(first.cells[0]))
        assert found, stream_text(first.cells[0])
        run_id, kernel_pid = found.group(1), int(found.group(2))
        time.sleep(1.0)
        os.kill(kernel_pid, signal.SIGKILL)
        attach = f"import nbaccel\nrun = nbaccel.attach({run_id!r})\nprint('RESULT', run.result())"
        second = run_notebook([attach], timeout=300, env=env, shutdown=True)
        cell = second.cells[0]
        assert not cell_errors(cell), stream_text(cell)
        out = stream_text(cell)
        for rank in (0, 1):
            seen = re.findall(rf"^\[rank {rank}[^\]]*\] line (\d+)$", out, re.M)
            assert seen == [str(i) for i in range(LINES)], (rank, len(seen), out[-800:])
        assert "RESULT [(0, 0), (1, 1)]" in out, out[-800:]
