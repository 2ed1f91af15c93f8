"""FSDP2 checkpoints on 2 gloo ranks: sharded and full round trips, plain-model loading, merging,
plus rank-0-only weights (cpu_ram_efficient_loading), bf16 mixed precision and CPU offload."""

import copy

import torch
from _fsdp_models import Net, make_data, max_diff, train

from nbaccel.testing import run_on_ranks


def _roundtrip(root: str, state_dict_type: str):
    from nbaccel.distributed.state import PartialState
    from nbaccel.training.strategies.fsdp.strategy import (
        FullyShardedDataParallelPlugin,
        get_fsdp_state_dict,
        load_fsdp_model,
        load_fsdp_optimizer,
        save_fsdp_model,
        save_fsdp_optimizer,
        shard_model,
    )

    state = PartialState()
    rank, world = state.process_index, state.num_processes
    data = make_data(steps=6)
    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["Block"], state_dict_type=state_dict_type
    )
    torch.manual_seed(0)
    model = shard_model(Net(), plugin, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, data[:2], rank, world)
    save_fsdp_model(plugin, model, root)
    save_fsdp_optimizer(plugin, optimizer, model, root)
    saved = get_fsdp_state_dict(model)
    first = train(model, optimizer, data[2:], rank, world)
    after_first = get_fsdp_state_dict(model)
    # a fresh model and optimizer (different init) resume from the checkpoint
    torch.manual_seed(1)
    model2 = shard_model(Net(), plugin, "cpu")
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    load_fsdp_model(plugin, model2, root)
    load_fsdp_optimizer(plugin, optimizer2, model2, root)
    restored = get_fsdp_state_dict(model2)
    second = train(model2, optimizer2, data[2:], rank, world)
    after_second = get_fsdp_state_dict(model2)
    out = {"losses_equal": first == second}
    if rank == 0:
        out["restored_diff"] = max_diff(saved, restored)
        out["resumed_diff"] = max_diff(after_first, after_second)
        out["saved"] = {k: v.clone() for k, v in saved.items()}
    return out


def _checkpoint_checks(root: str):
    import os

    import torch.distributed as dist
    from safetensors.torch import load_file

    from nbaccel.training.strategies.fsdp.strategy import merge_fsdp_weights

    sharded = _roundtrip(os.path.join(root, "sharded"), "SHARDED_STATE_DICT")
    full = _roundtrip(os.path.join(root, "full"), "FULL_STATE_DICT")
    out = {"sharded": sharded, "full": full, "files": sorted(os.listdir(root + "/sharded"))}
    out["distcp"] = sorted(os.listdir(os.path.join(root, "sharded", "pytorch_model_fsdp_0")))
    merged = merge_fsdp_weights(
        os.path.join(root, "sharded", "pytorch_model_fsdp_0"), os.path.join(root, "merged")
    )
    if dist.get_rank() == 0:
        # a plain nn.Module loads the merged safetensors file and the full checkpoint as they are
        plain = Net()
        plain.load_state_dict(load_file(merged))
        out["merged_diff"] = max_diff(plain.state_dict(), sharded["saved"])
        plain = Net()
        full_file = os.path.join(root, "full", "pytorch_model_fsdp_0.bin")
        plain.load_state_dict(torch.load(full_file, weights_only=True))
        out["full_file_diff"] = max_diff(plain.state_dict(), full["saved"])
        out["merged_name"] = os.path.basename(merged)
        for part in (sharded, full):
            part.pop("saved")
    return out


def test_sharded_and_full_checkpoints_round_trip(tmp_path):
    r0, r1 = run_on_ranks(_checkpoint_checks, num_processes=2, args=(str(tmp_path),), timeout=150)
    for kind in ("sharded", "full"):
        assert r0[kind]["restored_diff"] == 0.0, kind
        assert r0[kind]["resumed_diff"] < 1e-6, kind
        assert r0[kind]["losses_equal"] and r1[kind]["losses_equal"], kind
    assert r0["files"] == ["optimizer_0", "pytorch_model_fsdp_0"]
    assert r0["distcp"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert sorted((tmp_path / "full").iterdir()) == [
        tmp_path / "full" / "optimizer_0.bin",
        tmp_path / "full" / "pytorch_model_fsdp_0.bin",
    ]
    assert r0["merged_name"] == "model.safetensors"
    assert r0["merged_diff"] == 0.0
    assert r0["full_file_diff"] == 0.0


def _loading_and_precision_checks():

    from nbaccel.distributed.state import PartialState
    from nbaccel.training.strategies.fsdp.strategy import (
        FullyShardedDataParallelPlugin,
        get_fsdp_state_dict,
        shard_model,
    )

    rank = PartialState().process_index
    out = {}
    # cpu_ram_efficient_loading: only rank 0 has weights; rank 1 builds on the meta device.
    torch.manual_seed(0)
    reference = Net()
    if rank == 0:
        model = copy.deepcopy(reference)
    else:
        with torch.device("meta"):
            model = Net()
    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["Block"], cpu_ram_efficient_loading=True
    )
    shard_model(model, plugin, "cpu")
    full = get_fsdp_state_dict(model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    out["output_diff"] = (model(x) - reference(x)).abs().max().item()
    if rank == 0:
        out["weights_diff"] = max_diff(full, reference.state_dict())

    # bf16 mixed precision policy with CPU offload still trains and keeps fp32 shards.
    torch.manual_seed(0)
    model = Net()
    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["Block"], mixed_precision_policy="bf16", cpu_offload=True
    )
    shard_model(model, plugin, "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = train(model, optimizer, make_data(steps=3), rank, 2)
    out["bf16_losses"] = losses
    out["dtype"] = str(next(model.parameters()).dtype)
    return out


def test_rank0_loading_mixed_precision_and_offload():
    r0, r1 = run_on_ranks(_loading_and_precision_checks, num_processes=2, timeout=120)
    assert r0["weights_diff"] == 0.0
    assert r0["output_diff"] < 1e-6 and r1["output_diff"] < 1e-6
    assert r0["dtype"] == "torch.float32"
    assert all(torch.isfinite(torch.tensor(r["bf16_losses"])).all() for r in (r0, r1))
    # training moves the loss (bf16 compute, fp32 master shards)
    assert r0["bf16_losses"][-1] != r0["bf16_losses"][0]


def test_merge_rejects_non_dcp_directory(tmp_path):
    import pytest

    from nbaccel.training.strategies.fsdp.strategy import merge_fsdp_weights

    with pytest.raises(FileNotFoundError, match="not a torch.distributed.checkpoint"):
        merge_fsdp_weights(tmp_path, tmp_path / "out")
