"""From a real kernel, GPU ranks on a one-node Ray cluster: each rank holds ``GPU=1`` of its
placement group and all-reduces over NCCL on ``cuda:LOCAL_RANK`` (the devices Ray assigned the
node's ranks, in local-rank order). Runs in the GPU lane, on a CUDA machine with Ray."""

from __future__ import annotations

import ast

import pytest
import torch
from kernel import cell_errors, cell_text, run_notebook
from ray_cluster import RayCluster

pytestmark = pytest.mark.gpu

CELL = """
import os
from nbaccel import notebook_launcher

def nccl_sum():
    import os
    import torch
    import torch.distributed as dist
    from nbaccel import PartialState
    state = PartialState()
    t = torch.ones(4, device=state.device) * (state.process_index + 1)
    dist.all_reduce(t)
    return (dist.get_backend(), str(state.device), os.environ["CUDA_VISIBLE_DEVICES"],
            float(t[0].item()))

values = notebook_launcher(nccl_sum, num_processes={n}, launcher="ray", ray_address={address!r},
                           ray_resources={{"GPU": 1, "CPU": 1}}, ray_keep_warm=0)
print("VALUES", values)
"""


def test_nccl_all_reduce_on_ray_gpus():
    pytest.importorskip("ray", reason="Ray is not installed: pip install nbaccel[ray]")
    gpus = torch.cuda.device_count()
    n = min(2, gpus)
    with RayCluster(cpus=(max(2, n),), gpus=gpus) as cluster:
        nb = run_notebook([CELL.format(n=n, address=cluster.address)], timeout=300, shutdown=True)
    text = cell_text(nb.cells[0])
    assert not cell_errors(nb.cells[0]), text
    line = next(line for line in text.splitlines() if line.startswith("VALUES"))
    values = ast.literal_eval(line[len("VALUES") :].strip())
    total = float(sum(range(1, n + 1)))
    assert [(v[0], v[1], v[3]) for v in values] == [("nccl", f"cuda:{r}", total) for r in range(n)]
    visible = values[0][2].split(",")
    assert len(visible) == n and all(v[2] == values[0][2] for v in values)
