"""GPU lane: DeepSpeed ZeRO on NCCL ranks (one per GPU, at most 2). bf16 and fp16 engines close to
a float32 one-process run, and ZeRO-3 with the optimizer state and parameters offloaded to the
CPU, stepped by ``DeepSpeedCPUAdam`` (what ``map_pytorch_optim_to_deepspeed`` picks for AdamW;
it JIT-builds once, a few minutes). Skipped with the reason where torch sees no CUDA device."""

from __future__ import annotations

import pytest
import torch
from _deepspeed_cases import config, reference
from _gpu import ranks
from torch import nn

from nbaccel.testing import run_on_ranks

pytestmark = pytest.mark.gpu
pytest.importorskip("deepspeed")
STEPS = 4


def _train(plugin_config, mixed_precision):
    from _deepspeed_cases import Net, dataset
    from torch.utils.data import DataLoader

    from nbaccel import Accelerator, DeepSpeedPlugin

    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=plugin_config),
    )
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    world = accelerator.num_processes
    loader = DataLoader(dataset(), batch_size=16 // world)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # the engine holds its weights in half precision; inputs are the caller's to cast
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)
    losses = []
    for i, (x, y) in enumerate(loader):
        if i == STEPS:
            break
        loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    return {
        "losses": losses,
        "device": str(next(accelerator.unwrap_model(model).parameters()).device),
        "optimizer": type(optimizer.optimizer).__name__,
        "inner": type(getattr(optimizer.optimizer, "optimizer", None)).__name__,
        "precision": accelerator.mixed_precision,
    }


@pytest.mark.parametrize(("stage", "precision"), [(2, "bf16"), (3, "bf16"), (2, "fp16")])
def test_zero_on_nccl_with_half_precision_is_close_to_float32(stage, precision):
    # a small first loss scale: the default (2**16) skips the first fp16 steps as overflows
    plugin_config = config(stage, fp16={"enabled": "auto", "initial_scale_power": 8})
    out = run_on_ranks(_train, ranks(), args=(plugin_config, precision), cpu=False, timeout=300)
    want, _ = reference(STEPS)
    result = out[0]
    assert result["device"].startswith("cuda") and result["precision"] == precision
    assert result["losses"] == pytest.approx(want, rel=5e-2, abs=5e-2)


@pytest.mark.timeout(1200)  # DeepSpeedCPUAdam JIT-builds the first time
def test_cpu_offload_with_deepspeed_cpu_adam():
    offload = config(3)
    offload["zero_optimization"].update(
        offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}
    )
    out = run_on_ranks(_train, ranks(), args=(offload, "no"), cpu=False, timeout=1100)
    want, _ = reference(STEPS)
    assert out[0]["inner"] == "DeepSpeedCPUAdam"
    assert out[0]["losses"] == pytest.approx(want, abs=1e-4)
