"""``Accelerator(mixed_precision="fp8")`` with torchao on 2 gloo CPU ranks, under DDP and FSDP2,
with FP8 emulated and on torch's CPU FP8 matmul: the first and last linears stay in bf16, the
others become torchao ``Float8Linear``, and the loss at every step stays within 5% of the same
run in bf16 (the reference: the same script with ``mixed_precision="bf16"``). One multi-process
start for the whole file."""

import pytest

from nbaccel.testing import run_on_ranks

STEPS = 8


def _train(mixed_precision: str, emulate, fsdp: bool) -> dict:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator
    from nbaccel.distributed.state import AcceleratorState
    from nbaccel.training.precision.fp8.recipes import AORecipeKwargs
    from nbaccel.training.strategies.fsdp.plugin import FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(True)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
        nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 16),
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 64, generator=g)
    data = TensorDataset(x, torch.tanh(x @ torch.randn(64, 16, generator=g) / 8))  # learnable
    handlers = [AORecipeKwargs(emulate=emulate)] if mixed_precision == "fp8" else []
    plugin = FullyShardedDataParallelPlugin() if fsdp else None
    accelerator = Accelerator(
        mixed_precision=mixed_precision, kwargs_handlers=handlers, fsdp_plugin=plugin
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=32)
    )
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    inner = accelerator.unwrap_model(model)
    kinds = [type(m).__name__ for m in inner.modules() if "Linear" in type(m).__name__]
    return {
        "losses": losses,
        "kinds": kinds,
        "fp8": accelerator.fp8_enabled,
        "backend": str(getattr(accelerator.fp8_backend, "value", None)),
        "distributed": accelerator.distributed_type.value,
    }


def _all_runs() -> dict:
    runs = {}
    for fsdp in (False, True):
        runs[("bf16", None, fsdp)] = _train("bf16", None, fsdp)
        for emulate in (True, False):
            runs[("fp8", emulate, fsdp)] = _train("fp8", emulate, fsdp)
    return runs


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(_all_runs, timeout=240)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
@pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "cpu_fp8_matmul"])
def test_fp8_tracks_bf16_loss_at_every_step(ranks, emulate, fsdp) -> None:
    for runs in ranks:
        ref = runs[("bf16", None, fsdp)]["losses"]
        got = runs[("fp8", emulate, fsdp)]
        assert len(got["losses"]) == len(ref) == STEPS
        for step, (a, b) in enumerate(zip(got["losses"], ref, strict=True)):
            assert abs(a - b) <= 0.05 * abs(b), (step, a, b)
        assert got["losses"][-1] < got["losses"][0]  # it trains


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_first_and_last_linear_stay_high_precision(ranks, fsdp) -> None:
    run = ranks[0][("fp8", True, fsdp)]
    assert run["kinds"] == ["Linear", "Float8Linear", "Float8Linear", "Linear"]
    assert run["fp8"] and run["backend"] == "AO"
    assert run["distributed"] == ("FSDP" if fsdp else "MULTI_CPU")
    assert ranks[0][("bf16", None, fsdp)]["kinds"] == ["Linear"] * 4
