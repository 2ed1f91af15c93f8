"""The names scripts written for Accelerate reach for exist in nbaccel, with Accelerate's meaning.

The lists below are what nbaccel provides; with accelerate installed, ``dir(Accelerator)``, an
``Accelerator``'s attributes and ``accelerate.utils``'s names are diffed against nbaccel's, and
only the names in ``DELIBERATELY_ABSENT`` (stacks nbaccel does not run; see the README's
migration section) may be missing.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types

import pytest
import torch

import nbaccel
import nbaccel.utils

ACCELERATOR_NAMES = [
    "ddp_handler", "scaler_handler", "init_handler", "autocast_handler", "profile_handler",
    "fp8_recipe_handler", "te_recipe_handler", "ao_recipe_handler", "msamp_recipe_handler",
    "has_fp8_handler", "fp8_enabled", "fp8_backend", "delayed_fp8_autocast", "has_lomo_optimizer",
    "native_amp", "log_with", "multi_device", "is_fsdp2", "is_composable_parallelism_enabled",
    "use_stateful_dataloader", "parallelism_config", "torch_device_mesh", "should_save_model",
    "deepspeed_plugin", "pipeline_parallel_rank", "maybe_context_parallel", "lomo_backward",
]  # fmt: skip
UTILS_NAMES = [
    "ParallelismConfig", "PrepareForLaunch", "enable_fsdp_ram_efficient_loading",
    "disable_fsdp_ram_efficient_loading", "prepare_multi_gpu_env",
    "prepare_simple_launcher_cmd_env", "prepare_tpu", "FullyShardedDataParallelPlugin",
]  # fmt: skip
DELIBERATELY_ABSENT = {
    # DeepSpeed Ulysses sequence parallelism's loader adapter (sequence parallelism is refused)
    "deepspeed_ulysses_dl_adapter",
    # FSDP2 internals Accelerate's own prepare calls; nbaccel's FSDP strategy has its own
    "fsdp2_apply_ac", "fsdp2_canonicalize_names", "fsdp2_load_full_state_dict",
    "fsdp2_prepare_model", "fsdp2_switch_optimizer_parameters", "get_fsdp2_grad_scaler",
    "ensure_weights_retied",
    # SageMaker launches
    "prepare_sagemager_args_inputs",
}  # fmt: skip


def test_the_accelerator_has_accelerates_descriptive_names():
    from nbaccel.utils import DistributedDataParallelKwargs

    handler = DistributedDataParallelKwargs(find_unused_parameters=True)
    accelerator = nbaccel.Accelerator(kwargs_handlers=[handler])
    for name in ACCELERATOR_NAMES:
        assert hasattr(accelerator, name), name
    assert accelerator.ddp_handler is handler and accelerator.scaler_handler is None
    assert accelerator.fp8_recipe_handler is None and accelerator.has_fp8_handler is False
    assert accelerator.native_amp is False and accelerator.multi_device is False
    assert accelerator.torch_device_mesh is None and accelerator.should_save_model is True
    with accelerator.maybe_context_parallel():
        pass
    with pytest.raises(RuntimeError, match="Set `parallelism_config` first"):
        accelerator.tensor_parallel_rank  # noqa: B018 - Accelerate raises the same
    with pytest.raises(NotImplementedError, match="LOMO"):
        accelerator.lomo_backward(torch.tensor(1.0), 0.1)


def test_utils_has_the_names_scripts_import():
    for name in UTILS_NAMES:
        assert hasattr(nbaccel.utils, name), name
    from nbaccel.launchers import PrepareForLaunch as from_launchers
    from nbaccel.utils.launch import PrepareForLaunch as from_launch

    assert from_launch is from_launchers is nbaccel.utils.PrepareForLaunch
    assert nbaccel.utils.ParallelismConfig is nbaccel.ParallelismConfig


def test_prepare_for_launch_sets_the_rank_environment(monkeypatch):
    monkeypatch.setenv("NPROC", "2")
    monkeypatch.setenv("NODE_RANK", "1")
    seen = nbaccel.utils.PrepareForLaunch(
        lambda x: (x, dict(__import__("os").environ)), "MULTI_CPU"
    )(1, "arg")
    assert seen[0] == "arg"
    assert (seen[1]["LOCAL_RANK"], seen[1]["RANK"], seen[1]["FORK_LAUNCHED"]) == ("1", "3", "1")


def test_fsdp_plugin_takes_state_dict_configs():
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedStateDictConfig,
    )

    plugin = nbaccel.FullyShardedDataParallelPlugin(
        state_dict_config=FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    )
    assert plugin.state_dict_config.rank0_only and plugin.optim_state_dict_config.offload_to_cpu
    sharded = nbaccel.FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")
    assert isinstance(sharded.state_dict_config, ShardedStateDictConfig)
    with pytest.raises(TypeError, match="must be a torch.distributed.fsdp.FullStateDictConfig"):
        nbaccel.FullyShardedDataParallelPlugin(state_dict_config=ShardedStateDictConfig())


def test_nothing_else_of_accelerates_is_missing():
    accelerate = pytest.importorskip("accelerate", reason="the diff needs accelerate installed")
    importlib.import_module("accelerate.utils")

    theirs = {n for n in dir(accelerate.Accelerator) if not n.startswith("_")}
    init = inspect.getsource(accelerate.Accelerator.__init__)  # its attributes, set in __init__
    theirs |= set(re.findall(r"self\.([a-z]\w*)\s*=", init))
    ours = set(dir(nbaccel.Accelerator())) | {"parallelism_config"}
    utils = {
        n
        for n in getattr(accelerate.utils, "__all__", dir(accelerate.utils))
        if not n.startswith("_") and not isinstance(getattr(accelerate.utils, n), types.ModuleType)
    }
    missing = sorted((theirs - ours) | {n for n in utils if not hasattr(nbaccel.utils, n)})
    assert set(missing) <= DELIBERATELY_ABSENT, set(missing) - DELIBERATELY_ABSENT
