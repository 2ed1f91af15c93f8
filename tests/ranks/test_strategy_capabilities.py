"""Strategies answer by capability, on 2 gloo ranks: FSDP2 gets ``mixed_precision`` as its
``MixedPrecisionPolicy`` (exposed on the plugin, as Accelerate does), a second ``Accelerator`` in
the same process that asks for another strategy gets it (a re-run cell in a persistent pool), and
no_sync / unwrapping are the strategy's. One multi-process function: start-up is paid once."""

import pytest
import torch
from _fsdp_models import Net

from nbaccel.testing import run_on_ranks


def _checks():
    from nbaccel.distributed.state import DistributedType
    from nbaccel.training.accelerator.core import Accelerator
    from nbaccel.training.strategies.fsdp.strategy import (
        FullyShardedDataParallelPlugin,
        sharded_fraction,
    )

    out = {}
    # 1. the first Accelerator of the process: DDP over gloo
    first = Accelerator(cpu=True, mixed_precision="bf16")
    ddp_model = first.prepare(Net())
    out["first"] = (first.distributed_type.value, type(ddp_model).__name__)
    out["first_unwrapped"] = type(first.unwrap_model(ddp_model)).__name__
    out["first_policy"] = getattr(first.strategy, "mixed_precision_policy", "missing")

    # 2. a second one asks for FSDP: it takes effect, with bf16 as FSDP2's policy
    plugin = FullyShardedDataParallelPlugin()
    second = Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=plugin)
    out["second_type"] = second.distributed_type == DistributedType.FSDP
    policy = second.state.fsdp_plugin.mixed_precision_policy
    out["policy"] = (str(policy.param_dtype), str(policy.reduce_dtype))
    out["plugin_is_ours"] = second.state.fsdp_plugin is plugin
    model = second.prepare(Net())
    out["fraction"] = sharded_fraction(model)
    seen = []
    model.inp.register_forward_pre_hook(lambda m, args: seen.append(str(m.weight.dtype)))
    loss = model(torch.randn(4, 8)).float().pow(2).mean()
    second.backward(loss)
    out["forward_weight_dtype"] = seen
    # gradients reach the fp32 shards (reduced in float32)
    out["grad_dtype"] = str(next(model.parameters()).grad.dtype)
    with second.no_sync(model):
        out["sync_off"] = not model._get_fsdp_state()._fsdp_param_group.reduce_grads
    out["sync_back"] = model._get_fsdp_state()._fsdp_param_group.reduce_grads
    # the first accelerator keeps its own strategy
    out["first_after"] = (type(first.strategy).__name__, type(first.prepare(Net())).__name__)

    # 3. a third with another plugin: that plugin is used from now on
    third = Accelerator(
        cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(mixed_precision_policy="fp16")
    )
    out["third_policy"] = str(third.strategy.mixed_precision_policy.param_dtype)
    out["second_kept"] = str(second.strategy.mixed_precision_policy.param_dtype)

    # 4. another mixed precision than the process's: a clear error naming the fix
    try:
        Accelerator(cpu=True, mixed_precision="fp16")
        out["mp_error"] = None
    except ValueError as exc:
        out["mp_error"] = str(exc)
    return out


def test_second_accelerator_and_fsdp_mixed_precision_policy():
    for r in run_on_ranks(_checks, num_processes=2, timeout=150):
        assert r["first"] == ("MULTI_CPU", "DistributedDataParallel")
        assert r["first_unwrapped"] == "Net" and r["first_policy"] is None
        assert r["second_type"] and r["plugin_is_ours"]
        assert r["policy"] == ("torch.bfloat16", "torch.float32")
        assert 0.45 < r["fraction"] < 0.55
        assert r["forward_weight_dtype"] == ["torch.bfloat16"]  # gathered in bf16 by the policy
        assert r["grad_dtype"] == "torch.float32"
        assert r["sync_off"] and r["sync_back"]
        assert r["first_after"] == ("DDPStrategy", "DistributedDataParallel")
        assert r["third_policy"] == "torch.float16" and r["second_kept"] == "torch.bfloat16"
        assert "_reset_state()" in r["mp_error"]


def test_mixed_precision_no_sets_no_policy_and_a_given_policy_is_kept():
    from nbaccel.training.strategies.fsdp.plugin import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    plugin.set_mixed_precision("no")
    assert plugin.mixed_precision_policy is None
    plugin = FullyShardedDataParallelPlugin(mixed_precision_policy="fp16")
    plugin.set_mixed_precision("bf16")
    assert plugin.mixed_precision_policy.param_dtype == torch.float16
    plugin.set_mixed_precision("bf16", override=True)
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="mixed_precision='fp64' is not a dtype"):
        plugin.set_mixed_precision("fp64", override=True)


def _policy_under_launch():
    from nbaccel.training.accelerator.core import Accelerator
    from nbaccel.training.strategies.fsdp.strategy import FullyShardedDataParallelPlugin

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    policy = accelerator.state.fsdp_plugin.mixed_precision_policy
    model = accelerator.prepare(Net())
    seen = []
    model.inp.register_forward_pre_hook(lambda m, args: seen.append(str(m.weight.dtype)))
    model(torch.randn(2, 8))
    return accelerator.mixed_precision, str(policy.param_dtype), seen


def test_notebook_launcher_mixed_precision_reaches_the_fsdp_policy():
    # the walk: notebook_launcher(mixed_precision=) -> the ranks' environment -> AcceleratorState
    # -> FSDPStrategy -> plugin.mixed_precision_policy -> fully_shard(mp_policy=)
    from nbaccel import notebook_launcher
    from nbaccel.launch.driver.renderer import TextRenderer

    results = notebook_launcher(
        _policy_under_launch, num_processes=2, mixed_precision="bf16", renderer=TextRenderer()
    )
    assert results == [("bf16", "torch.bfloat16", ["torch.bfloat16"])] * 2
