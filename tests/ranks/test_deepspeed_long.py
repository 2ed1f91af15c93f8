"""The long DeepSpeed checks (``scripts/test-deepspeed``; skipped unless NBACCEL_DEEPSPEED_FULL=1):
on 2 CPU ranks, ZeRO-3 with the optimizer state and parameters offloaded to the CPU and stepped by
``DeepSpeedCPUAdam`` (JIT-built once, about 4 minutes) equal to one process; and DeepSpeed run
exactly as it ships, its shared-memory op built (NBACCEL_DEEPSPEED_SHM=1, about 140 s once),
giving the same losses as nbaccel's default, which leaves that inference-only op out."""

import os

import pytest
import torch
from _deepspeed_cases import ENV, config, reference
from torch import nn

from nbaccel.testing import run_on_ranks

pytestmark = pytest.mark.skipif(
    os.environ.get("NBACCEL_DEEPSPEED_FULL") != "1",
    reason="long: JIT builds of DeepSpeed ops (run scripts/test-deepspeed)",
)
pytest.importorskip("deepspeed")
STEPS = 4


def _train(plugin_config):
    from _deepspeed_cases import Net, dataset
    from torch.utils.data import DataLoader

    from nbaccel import Accelerator, DeepSpeedPlugin

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=plugin_config))
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset(), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for i, (x, y) in enumerate(loader):
        if i == STEPS:
            break
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    from deepspeed.comm import comm as ds_comm

    shm = getattr(ds_comm.cdb, "shm_comm_op", None) is not None
    inner = type(getattr(optimizer.optimizer, "optimizer", None)).__name__
    return losses, inner, shm


@pytest.mark.timeout(1500)
def test_cpu_offload_with_deepspeed_cpu_adam_matches_one_process():
    offload = config(3)
    offload["zero_optimization"].update(
        offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}
    )
    losses, inner, _ = run_on_ranks(_train, 2, args=(offload,), timeout=1400, env=ENV)[0]
    assert inner == "DeepSpeedCPUAdam"
    assert losses == pytest.approx(reference(STEPS)[0], abs=1e-5)


@pytest.mark.timeout(900)
def test_with_deepspeed_shm_op_built_the_losses_are_the_same():
    built = run_on_ranks(
        _train, 2, args=(config(2),), timeout=800, env={**ENV, "NBACCEL_DEEPSPEED_SHM": "1"}
    )[0]
    default = run_on_ranks(_train, 2, args=(config(2),), timeout=300, env=ENV)[0]
    assert (
        built[2] and not default[2]
    )  # the op was built and used in one run, left out in the other
    assert built[0] == default[0] == pytest.approx(reference(STEPS)[0], abs=1e-5)
