"""Bad parallel layouts are refused before any rank starts, naming the numbers and the fix:
a mesh whose product is not the world size (notebook_launcher, nbaccel launch, a config file's
parallelism_config keys), context parallel on CPU, a TP plan naming modules the model lacks, a
tp_size that does not divide the heads, Megatron degrees that do not divide the world."""

from __future__ import annotations

import pytest
import torch
from _llama import tiny_llama

from nbaccel.launch.request import LaunchRequest
from nbaccel.training.strategies.model_parallel.tensor_parallel import (
    check_tensor_parallel,
    resolve_plan,
)


def _never_called():
    raise AssertionError("a rank started")


def test_mesh_product_must_equal_the_world():
    with pytest.raises(ValueError, match=r"dp_shard_size=2 x tp_size=2 = 4 ranks, but the launch "
                       r"has 2: launch 4 processes"):  # fmt: skip
        LaunchRequest(num_processes=2, parallelism_config_tp_size=2,
                      parallelism_config_dp_shard_size=2)  # fmt: skip
    request = LaunchRequest(parallelism_config_tp_size=2, parallelism_config_dp_shard_size=2)
    assert request.num_processes == 4  # the mesh decides the count when none is given
    assert request.rank_environment() == {  # every axis, as accelerate launch writes them
        "ACCELERATE_MIXED_PRECISION": "no",
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
        "PARALLELISM_CONFIG_TP_SIZE": "2",
        "PARALLELISM_CONFIG_CP_SIZE": "1",
        "PARALLELISM_CONFIG_CP_BACKEND": "torch",
        "PARALLELISM_CONFIG_SP_SIZE": "1",
        "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed",
    }
    from nbaccel import notebook_launcher

    with pytest.raises(ValueError, match="= 4 ranks, but the launch has 2"):
        notebook_launcher(_never_called, num_processes=2, cpu=True,
                          parallelism_config_tp_size=4)  # fmt: skip


def test_context_parallel_is_refused_on_cpu_with_the_reason():
    with pytest.raises(ValueError, match="cp_size > 1 needs CUDA ranks: torch's context_parallel"):
        LaunchRequest(cpu=True, parallelism_config_cp_size=2, parallelism_config_dp_shard_size=2)


def test_nbaccel_launch_flags_and_config_keys(tmp_path, capsys):
    from nbaccel.commands.launch import _request, _validate_launch_command, run
    from nbaccel.commands.launch import launch_command_parser as parser

    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('a rank started')\n")
    argv = ["--num_processes", "2", "--cpu", "--parallelism_config_tp_size", "4", str(script)]
    assert run(parser().parse_args(argv)) == 2
    assert "tp_size=4 = 4 ranks, but the launch has 2" in capsys.readouterr().err
    config = tmp_path / "config.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 4\n"
        "mixed_precision: 'no'\nuse_cpu: true\nparallelism_config:\n"
        "  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 2\n"
    )
    args = parser().parse_args(["--config_file", str(config), "--cpu", str(script)])
    assert args.config_file  # the section turns use_parallelism_config on; no --use_fsdp needed
    args, _, _ = _validate_launch_command(args)
    request = _request(args, args.num_processes, None)
    assert request.rank_environment()["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "2"
    assert request.rank_environment()["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "2"


def test_tp_plan_and_heads_are_checked():
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"does not have: \['model.layers.\*.attn.c_attn'\]"):
        resolve_plan(model, {"model.layers.*.attn.c_attn": "colwise"})
    with pytest.raises(ValueError, match=r"tp_size=3 does not divide the model's "
                       r"num_attention_heads=4.*among \[1, 2, 4\]"):  # fmt: skip
        check_tensor_parallel(model, 3)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        check_tensor_parallel(model, 4)
    with pytest.raises(ValueError, match="style 'diagonal'"):
        resolve_plan(model, {"lm_head": "diagonal"})
    plan = resolve_plan(model)  # the model's own plan, expanded over the layers
    assert {"model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"} <= set(
        plan
    )
    bare = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        resolve_plan(bare)


def test_layouts_that_do_not_fit_one_process():
    from nbaccel import Accelerator
    from nbaccel.parallelism_config import ParallelismConfig
    from nbaccel.utils import MegatronLMPlugin

    with pytest.raises(ValueError, match=r"needs 2 ranks \(tp_size=2 = 2\) but the run has 1"):
        Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
    with pytest.raises(ValueError, match="tp_degree=2 x pp_degree=1 = 2 does not divide the 1"):
        Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2))
    with pytest.raises(
        NotImplementedError, match="custom_train_step_class=.*Megatron-LM's train step"
    ):
        MegatronLMPlugin(custom_train_step_class=object)
