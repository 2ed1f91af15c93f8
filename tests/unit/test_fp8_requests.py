"""FP8 asked for in any of Accelerate's ways is applied or refused, never dropped: a recipe handler
alone turns FP8 on under FSDP and is refused elsewhere (naming mixed_precision='fp8') and under
DeepSpeed; an FSDP plugin set to "fp8" gathers in bf16 and asks for FP8; a TorchDynamoPlugin's
backend and regional compilation are read, not left aside."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nbaccel.training.precision.select import select_precision
from nbaccel.training.step.compilation import Compilation
from nbaccel.utils import AORecipeKwargs, FullyShardedDataParallelPlugin, TorchDynamoPlugin

pytest.importorskip("torchao")


def test_a_recipe_handler_alone_turns_fp8_on_under_fsdp_with_the_runs_own_autocast():
    policy = select_precision("no", "cpu", {AORecipeKwargs: AORecipeKwargs(emulate=True)}, "FSDP")
    assert policy.name == "fp8" and policy.backend == "AO" and policy.mode == "no"


def test_a_recipe_handler_without_fp8_is_refused_outside_fsdp_naming_the_fix():
    handlers = {AORecipeKwargs: AORecipeKwargs(emulate=True)}
    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        select_precision("no", "cpu", handlers)
    with pytest.raises(ValueError, match="does not run FP8 under DeepSpeed"):
        select_precision("bf16", "cpu", handlers, "DEEPSPEED")


def test_an_fsdp_plugin_set_to_fp8_gathers_in_bf16_and_asks_for_fp8():
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("fp8")
    assert plugin.fp8_requested
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    policy = select_precision("no", "cpu", {}, "FSDP", plugin_fp8=True)
    assert policy.name == "fp8"


def test_mixed_precision_fp8_converts_every_linear_but_the_first_and_last(monkeypatch):
    monkeypatch.setenv("NBACCEL_FP8_EMULATE", "1")
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))
    policy = select_precision("fp8", "cpu", {})
    policy.convert(model)
    assert policy.fp8_layer_count(model) == 2


def test_fp8_with_no_layer_it_can_convert_is_refused(monkeypatch):
    monkeypatch.setenv("NBACCEL_FP8_EMULATE", "1")
    policy = select_precision("fp8", "cpu", {})
    with pytest.raises(ValueError, match="no linear layer of this model can run in FP8"):
        policy.convert(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)))


def test_a_dynamo_plugins_backend_and_regional_compilation_are_applied():
    compilation = Compilation(
        None, TorchDynamoPlugin(backend="eager", use_regional_compilation=True)
    )
    assert compilation.enabled and compilation.regional
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    compiled = compilation.apply(model)
    assert compilation.describe() == "eager, regional (3 regions)"  # each block, the leaf
    assert compiled._orig_mod is model
    assert Compilation(None, None).describe() == "no"
    assert Compilation("eager", None).describe() == "eager, whole model"
