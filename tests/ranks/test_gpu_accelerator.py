"""GPU lane: the Accelerator on CUDA. fp16 with the grad scaler (an overflowing step skipped, the
scheduler held), bf16 close to fp32, gradient accumulation, ``gather_for_metrics`` and DDP on
NCCL ranks, ``save_state``/``load_state`` resuming identically, and FSDP2 on NCCL with the
``MixedPrecisionPolicy`` that ``mixed_precision="bf16"`` asks for (1 rank; 2 with 2 GPUs).
Single-device checks run in the test process (cuda:0); multi-rank ones on real NCCL ranks.
"""

from __future__ import annotations

import pytest
import torch
from _gpu import ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator
from nbaccel.testing import run_on_ranks

pytestmark = pytest.mark.gpu


def _data(n: int = 64, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))


def _train(accelerator, model, optimizer, loader, steps: int) -> list[float]:
    losses = []
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_fp16_grad_scaler_skips_an_overflowing_step_and_holds_the_scheduler():
    acc = Accelerator(mixed_precision="fp16")
    assert acc.device.type == "cuda" and acc.scaler is not None
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    assert model.weight.device.type == "cuda"
    x = torch.randn(8, 16, device=acc.device)
    with acc.autocast():  # autocast reaches the CUDA kernels
        assert nn.functional.linear(x, model.weight).dtype == torch.float16
    assert model(x).dtype == torch.float32  # the prepared forward returns float32
    before = model.weight.detach().clone()
    scale = acc.scaler.get_scale()
    acc.backward(model(x).sum() * float("inf"))
    opt.step()
    sched.step()
    opt.zero_grad()
    assert acc.optimizer_step_was_skipped
    assert torch.equal(model.weight, before)
    assert acc.scaler.get_scale() == scale / 2
    assert sched.get_last_lr() == [0.1]  # held
    acc.backward(model(x).pow(2).mean())
    opt.step()
    sched.step()
    assert not acc.optimizer_step_was_skipped
    assert not torch.equal(model.weight, before)
    assert sched.get_last_lr() == [0.05]


def _losses(mixed_precision: str, steps: int = 8) -> tuple[list[float], dict]:
    from nbaccel.distributed.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(mixed_precision=mixed_precision)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # updates follow the gradients' size
    loader = DataLoader(_data(), batch_size=8)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses = _train(acc, model, opt, loader, steps)
    weights = {k: v.float().cpu() for k, v in acc.unwrap_model(model).state_dict().items()}
    return losses, weights


def test_bf16_training_matches_fp32_within_tolerance():
    if not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name()} has no bf16 support")
    fp32, w32 = _losses("no")
    bf16, w16 = _losses("bf16")
    assert fp32 != bf16  # bf16 really ran (rounded differently)
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=3e-2, atol=3e-3)
    for name, value in w32.items():
        torch.testing.assert_close(w16[name], value, rtol=3e-2, atol=3e-3)


def test_gradient_accumulation_equals_the_big_batch():
    from nbaccel.distributed.state import AcceleratorState, GradientState

    acc = Accelerator(gradient_accumulation_steps=2)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(_data(32), batch_size=8))
    steps = 0
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            steps += acc.sync_gradients
    assert steps == 2
    accumulated = {k: v.cpu() for k, v in acc.unwrap_model(model).state_dict().items()}

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    reference = _net().cuda()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in DataLoader(_data(32), batch_size=16):
        nn.functional.mse_loss(reference(x.cuda()), y.cuda()).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(accumulated[name], value.cpu(), rtol=1e-5, atol=1e-6)


def test_save_state_and_load_state_resume_identically(tmp_path):
    acc = Accelerator(mixed_precision="fp16")
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    loader = DataLoader(_data(), batch_size=8)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    _train(acc, model, opt, loader, len(loader))  # a whole epoch
    acc.save_state(tmp_path / "ckpt")

    def resume() -> tuple[list[float], list[float], float]:
        losses = []
        for x, y in loader:
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(round(float(torch.randn(1, device=acc.device)), 6))  # RNG restored too
        return losses, sched.get_last_lr(), acc.scaler.get_scale()

    first = resume()
    weights = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    acc.load_state(tmp_path / "ckpt")
    second = resume()
    assert first == second
    for name, value in acc.unwrap_model(model).state_dict().items():
        assert value.device.type == "cuda"
        torch.testing.assert_close(value, weights[name])


def _ddp_and_metrics():
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator

    acc = Accelerator()
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.arange(10).float().unsqueeze(1), torch.randn(10, 1, generator=g))
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=4))
    seen = []
    for x, y in loader:
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        seen.append(acc.gather_for_metrics(x))
    gathered = torch.cat(seen)
    return {
        "device": str(acc.device),
        "type": acc.distributed_type.value,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "on": gathered.device.type,
        "gathered": sorted(gathered.squeeze(1).tolist()),
        "weight": acc.unwrap_model(model).weight.item(),
    }


def test_ddp_on_nccl_and_gather_for_metrics_drops_the_padding():
    n = ranks()
    results = run_on_ranks(_ddp_and_metrics, num_processes=n, cpu=False, timeout=180)
    for rank, r in enumerate(results):
        assert r["device"] == f"cuda:{rank}" and r["on"] == "cuda"
        assert r["gathered"] == [float(i) for i in range(10)]  # every sample once, no padding
        if n > 1:
            assert r["type"] == "MULTI_GPU" and r["backend"] == "nccl"
    assert len({r["weight"] for r in results}) == 1  # DDP kept the replicas equal


def _fsdp_bf16():
    import torch
    from _fsdp_models import Net, make_data
    from torch import nn

    from nbaccel import Accelerator
    from nbaccel.training.strategies.fsdp.strategy import (
        FullyShardedDataParallelPlugin,
        sharded_fraction,
    )

    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"])
    acc = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    policy = plugin.mixed_precision_policy
    if policy is None:
        return {"policy": None}
    seen = []
    hook = model.inp.register_forward_pre_hook(
        lambda module, args: seen.append((module.weight.dtype, args[0].dtype))
    )
    losses = []
    x, y = (t.to(acc.device) for t in make_data(1)[0])
    for _ in range(6):  # one batch, six steps: the loss must fall
        loss = nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    hook.remove()
    return {
        "policy": [str(policy.param_dtype), str(policy.reduce_dtype)],
        "type": type(policy).__name__,
        "forward_weight_dtype": str(seen[0][0]),
        "master_dtype": str(next(model.parameters()).dtype),
        "device": str(next(model.parameters()).device),
        "fraction": sharded_fraction(model),
        "backend": torch.distributed.get_backend(),
        "first": losses[0],
        "last": losses[-1],
    }


def test_fsdp2_on_nccl_with_the_bf16_mixed_precision_policy():
    if not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name()} has no bf16 support")
    n = ranks()
    results = run_on_ranks(_fsdp_bf16, num_processes=n, cpu=False, timeout=240)
    for rank, r in enumerate(results):
        assert r["policy"] is not None, (
            "Accelerator(mixed_precision='bf16') left fsdp_plugin.mixed_precision_policy unset"
        )
        assert r["type"] == "MixedPrecisionPolicy"
        assert r["policy"] == ["torch.bfloat16", "torch.float32"]
        assert r["forward_weight_dtype"] == "torch.bfloat16"  # the forward ran on bf16 weights
        assert r["master_dtype"] == "torch.float32"  # sharded master weights stay fp32
        assert r["device"] == f"cuda:{rank}" and r["backend"] == "nccl"
        assert r["fraction"] == pytest.approx(1 / n, abs=0.05)
        assert r["last"] < r["first"]
