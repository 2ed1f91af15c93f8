"""FSDP2 sharding on 2 gloo ranks: training equivalence, real sharding, optimizer rebinding.

Each multi-process function groups several checks so the process start-up is paid once.
"""

import copy

import pytest
import torch
from _fsdp_models import Net, make_data, max_diff, train
from torch import nn

from nbaccel.testing import run_on_ranks


def _training_checks():
    import torch.distributed as dist

    from nbaccel.distributed.state import PartialState
    from nbaccel.training.strategies.fsdp.strategy import (
        FullyShardedDataParallelPlugin,
        get_fsdp_state_dict,
        rebind_optimizer,
        shard_model,
        sharded_fraction,
    )

    state = PartialState()
    rank, world = state.process_index, state.num_processes
    data = make_data()
    out = {}

    # A: optimizer built BEFORE sharding (Adam), wrapped by transformer layer class name.
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap="Block")
    shard_model(model, plugin, torch.device("cpu"))
    out["rebound"] = rebind_optimizer(optimizer, model)
    out["fraction"] = sharded_fraction(model)
    out["local_numel"] = sum(p.to_local().numel() for p in model.parameters())
    out["total_numel"] = sum(p.numel() for p in reference.parameters())
    out["units"] = sum(type(m).__name__.startswith("FSDP") for m in model.modules())
    losses = train(model, optimizer, data, rank, world)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_losses = train(reference, ref_opt, data)
    full = get_fsdp_state_dict(model)
    if rank == 0:
        out["diff_a"] = max_diff(full, reference.state_dict())
    else:
        out["full_on_other_rank"] = len(full)
    out["mean_loss_a"] = sum(losses) / len(losses)
    out["ref_mean_loss"] = sum(ref_losses) / len(ref_losses)

    # B: optimizer built AFTER sharding (SGD momentum), size-based wrap + activation checkpointing.
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    plugin = FullyShardedDataParallelPlugin(min_num_params=500, activation_checkpointing=True)
    shard_model(model, plugin, "cpu")
    out["units_b"] = sum(type(m).__name__.startswith("FSDP") for m in model.modules())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out["rebound_after"] = rebind_optimizer(optimizer, model)
    train(model, optimizer, data, rank, world)
    train(reference, torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9), data)
    full = get_fsdp_state_dict(model)
    if rank == 0:
        out["diff_b"] = max_diff(full, reference.state_dict())
        out["keys_b"] = sorted(full) == sorted(reference.state_dict())

    # C: an optimizer that already stepped cannot follow the model into its shards.
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    shard_model(model, FullyShardedDataParallelPlugin(), "cpu")
    try:
        rebind_optimizer(optimizer, model)
        out["stale_error"] = None
    except RuntimeError as exc:
        out["stale_error"] = str(exc)
    dist.barrier()
    return out


def test_fsdp_training_matches_one_process_and_shards():
    results = run_on_ranks(_training_checks, num_processes=2, timeout=120)
    r0, r1 = results
    # A: optimizer before prepare, re-pointed at the shards; training equals one-process training.
    assert r0["rebound"] == len(list(Net().parameters()))
    assert r0["diff_a"] < 1e-5
    assert r1["full_on_other_rank"] == 0
    assert abs(r0["mean_loss_a"] + r1["mean_loss_a"] - 2 * r0["ref_mean_loss"]) < 1e-4
    # Parameters really sharded: each rank holds about half of the elements.
    for r in results:
        assert 0.45 < r["fraction"] < 0.55
        assert r["units"] == 4  # 3 blocks + root
    assert r0["local_numel"] + r1["local_numel"] == r0["total_numel"]
    # B: optimizer after prepare; size wrap and activation checkpointing keep the keys and math.
    assert r0["rebound_after"] == 0
    assert r0["units_b"] == 7  # size-based: ff.0 and ff.2 of 3 blocks, and the root
    assert r0["diff_b"] < 1e-5 and r0["keys_b"]
    # C: the clear error.
    for r in results:
        assert r["stale_error"] and "already has state" in r["stale_error"]


def test_plugin_validation():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from nbaccel.training.strategies.fsdp.strategy import (
        FullyShardedDataParallelPlugin,
        _blocks_to_wrap,
    )

    with pytest.raises(NotImplementedError, match="only FSDP2"):
        FullyShardedDataParallelPlugin(fsdp_version=1)
    with pytest.raises(ValueError, match="state_dict_type"):
        FullyShardedDataParallelPlugin(state_dict_type="WHOLE")
    with pytest.raises(NotImplementedError, match="SHARDED_STATE_DICT"):
        FullyShardedDataParallelPlugin(state_dict_type="LOCAL_STATE_DICT")
    with pytest.raises(ValueError, match="auto_wrap_policy"):
        FullyShardedDataParallelPlugin(auto_wrap_policy="EVERYTHING")
    with pytest.raises(TypeError, match="reshard_after_forward"):
        FullyShardedDataParallelPlugin(reshard_after_forward="yes")
    plugin = FullyShardedDataParallelPlugin(
        mixed_precision_policy={"param_dtype": "bf16", "reduce_dtype": "fp32"},
        transformer_cls_names_to_wrap="Block, Net",
        state_dict_type="sharded_state_dict",
    )
    assert isinstance(plugin.mixed_precision_policy, MixedPrecisionPolicy)
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    assert plugin.auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
    assert plugin.transformer_cls_names_to_wrap == ["Block", "Net"]
    assert plugin.is_sharded_state_dict
    assert FullyShardedDataParallelPlugin(auto_wrap_policy="SIZE_BASED_WRAP").min_num_params
    # wrap selection (no process group needed)
    net = Net()
    blocks = _blocks_to_wrap(
        net, FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"])
    )
    assert blocks == list(net.blocks)
    with pytest.raises(ValueError, match="not in the model: \\['GPTBlock'\\]"):
        _blocks_to_wrap(
            net, FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap="GPTBlock")
        )
    # size-based, bottom-up: a module is wrapped once its not-yet-wrapped parameters reach the bar.
    # Each block: norm 32, ff.0 544, ff.2 528 parameters (ff 1072); inp 144, head 68.
    size_blocks = _blocks_to_wrap(net, FullyShardedDataParallelPlugin(min_num_params=500))
    assert size_blocks == [net.blocks[i].ff[j] for i in range(3) for j in (0, 2)]
    size_blocks = _blocks_to_wrap(net, FullyShardedDataParallelPlugin(min_num_params=1000))
    assert size_blocks == [net.blocks[i].ff for i in range(3)]
    size_blocks = _blocks_to_wrap(net, FullyShardedDataParallelPlugin(min_num_params=100))
    assert size_blocks == [net.inp] + [net.blocks[i].ff[j] for i in range(3) for j in (0, 2)]
    assert _blocks_to_wrap(net, FullyShardedDataParallelPlugin(min_num_params=10**6)) == []
    custom = _blocks_to_wrap(
        net, FullyShardedDataParallelPlugin(auto_wrap_policy=lambda m: isinstance(m, nn.Linear))
    )
    assert len(custom) == 8
