"""``Accelerator(fsdp_plugin=...)`` on 2 gloo ranks: prepare shards, training matches one process,
optimizers prepared before or after the model follow the shards, save_state/load_state in both
formats, save_model and merge_fsdp_weights give files a plain model loads, and an optimizer that
already stepped is a clear error. One multi-process function: start-up is paid once."""

import torch
from _fsdp_models import Net, max_diff
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nbaccel.testing import run_on_ranks


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))


def reference_weights(steps: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(DataLoader(dataset(), batch_size=16)):
        if i == steps:
            break
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def run_steps(accelerator, model, optimizer, loader, steps):
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


def _accelerator_checks(root: str):
    import os

    from safetensors.torch import load_file

    from nbaccel.distributed.state import DistributedType
    from nbaccel.training.accelerator.core import Accelerator
    from nbaccel.training.strategies.fsdp.strategy import (
        FullyShardedDataParallelPlugin,
        merge_fsdp_weights,
        sharded_fraction,
    )

    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["Block"], state_dict_type="SHARDED_STATE_DICT"
    )
    accelerator = Accelerator(fsdp_plugin=plugin)
    out = {"type": accelerator.distributed_type == DistributedType.FSDP}

    # 1. optimizer created before prepare, all prepared together
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset(), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    out["fraction"] = sharded_fraction(model)
    run_steps(accelerator, model, optimizer, loader, 3)
    full = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        out["diff_together"] = max_diff(full, reference_weights(3))

    # 2. optimizer built before the model's prepare, prepared in a later call
    torch.manual_seed(0)
    model2 = Net()
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    model2 = accelerator.prepare(model2)
    optimizer2 = accelerator.prepare(optimizer2)
    loader2 = accelerator.prepare(DataLoader(dataset(), batch_size=8))
    run_steps(accelerator, model2, optimizer2, loader2, 3)
    full2 = accelerator.get_state_dict(model2)
    if accelerator.is_main_process:
        out["diff_later"] = max_diff(full2, reference_weights(3))

    # 3. save_state / load_state, sharded then full; training resumes identically
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        plugin.state_dict_type = kind
        ckpt = os.path.join(root, kind)
        accelerator.save_state(ckpt)
        saved = accelerator.get_state_dict(model)
        first = run_steps(accelerator, model, optimizer, loader, 2)
        accelerator.load_state(ckpt)
        restored = accelerator.get_state_dict(model)
        second = run_steps(accelerator, model, optimizer, loader, 2)
        out[kind] = {"files": sorted(os.listdir(ckpt)), "resumed": first == second}
        if accelerator.is_main_process:
            out[kind]["restored_diff"] = max_diff(saved, restored)

    # 4. save_model and merge_fsdp_weights: files a plain nn.Module loads
    accelerator.save_model(model, os.path.join(root, "saved_model"))
    merged = merge_fsdp_weights(
        os.path.join(root, "SHARDED_STATE_DICT", "pytorch_model_fsdp_0"),
        os.path.join(root, "merged"),
    )
    final = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        plain = Net()
        plain.load_state_dict(load_file(os.path.join(root, "saved_model", "model.safetensors")))
        out["save_model_diff"] = max_diff(plain.state_dict(), final)
        plain = Net()
        plain.load_state_dict(load_file(merged))
        out["merged_loads"] = True

    # 5. cpu_ram_efficient_loading: rank 1 builds on the meta device, prepare gives it rank 0's
    plugin.cpu_ram_efficient_loading = True
    torch.manual_seed(0)
    if accelerator.is_main_process:
        model4 = Net()
    else:
        with torch.device("meta"):
            model4 = Net()
    model4 = accelerator.prepare(model4)
    plugin.cpu_ram_efficient_loading = False
    full4 = accelerator.get_state_dict(model4)
    if accelerator.is_main_process:
        torch.manual_seed(0)
        out["meta_diff"] = max_diff(full4, Net().state_dict())

    # 6. an optimizer that already stepped cannot follow its model into the shards: clear error
    model3 = Net()
    optimizer3 = torch.optim.Adam(model3.parameters())
    model3(torch.randn(2, 8)).sum().backward()
    optimizer3.step()
    try:
        accelerator.prepare(model3, optimizer3)
        out["stepped_error"] = None
    except RuntimeError as exc:
        out["stepped_error"] = str(exc)
    return out


def test_accelerator_fsdp_end_to_end(tmp_path):
    r0, r1 = run_on_ranks(_accelerator_checks, args=(str(tmp_path),), timeout=170)
    assert r0["type"] and r1["type"]
    assert 0.45 < r0["fraction"] < 0.55
    assert r0["diff_together"] < 1e-5
    assert r0["diff_later"] < 1e-5
    sharded, full = r0["SHARDED_STATE_DICT"], r0["FULL_STATE_DICT"]
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(sharded["files"])
    assert {"pytorch_model_fsdp_0.bin", "optimizer_0.bin"} <= set(full["files"])
    for part in (sharded, full, r1["SHARDED_STATE_DICT"], r1["FULL_STATE_DICT"]):
        assert part["resumed"]
    assert sharded["restored_diff"] == 0.0 and full["restored_diff"] == 0.0
    assert r0["save_model_diff"] == 0.0
    assert r0["merged_loads"]
    assert r0["meta_diff"] == 0.0
    for r in (r0, r1):
        assert r["stepped_error"] and "already has state" in r["stepped_error"]
