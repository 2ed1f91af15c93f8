"""ParallelismConfig as Accelerate documents it: sizes (arguments, else PARALLELISM_CONFIG_*
variables, else 1), the enabled mesh axes in the order dp_replicate, dp_shard, cp, sp, tp, a
real DeviceMesh on 2 gloo ranks with its joint axes, and what the Accelerator accepts."""

import pytest
import torch

from nbaccel.distributed.environment_patch import patch_environment
from nbaccel.testing import run_on_ranks
from nbaccel.training.config.parallelism_config import (
    ParallelismConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)


def test_sizes_default_to_one_and_come_from_the_environment():
    config = ParallelismConfig()
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.cp_size) == (
        1,
        1,
        1,
        1,
    )
    assert config.total_size == 1 and config._get_mesh() == ()
    env = {"PARALLELISM_CONFIG_DP_SHARD_SIZE": 4, "PARALLELISM_CONFIG_TP_SIZE": 2}
    with patch_environment(**env):
        config = ParallelismConfig()
    assert (config.dp_shard_size, config.tp_size, config.total_size) == (4, 2, 8)
    assert ParallelismConfig(dp_shard_size=3).dp_shard_size == 3  # the argument wins


@pytest.mark.parametrize(
    ("sizes", "names", "shape"),
    [
        ({"dp_replicate_size": 8}, ("dp_replicate",), (8,)),
        ({"dp_replicate_size": 2, "dp_shard_size": 4}, ("dp_replicate", "dp_shard"), (2, 4)),
        ({"dp_shard_size": 2, "tp_size": 2, "cp_size": 2}, ("dp_shard", "cp", "tp"), (2, 2, 2)),
        ({"tp_size": 8}, ("tp",), (8,)),
    ],
)
def test_mesh_axes_in_canonical_order(sizes, names, shape):
    config = ParallelismConfig(**sizes)
    assert config._get_mesh() == (names, shape)
    assert config.active_mesh_dims == [n for n in names if n.startswith("dp")] + [
        n for n in ("tp", "cp") if n in names
    ]


def test_joint_axis_names_and_handlers():
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, cp_size=2)
    assert config.dp_dim_names == ["dp_replicate", "dp_shard"]
    assert config.dp_shard_cp_dim_names == ["dp_shard", "cp"]
    assert config.dp_cp_dim_names == ["dp_replicate", "dp_shard", "cp"]
    assert config.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert (config.data_parallel_size, config.non_data_parallel_size) == (4, 2)
    assert isinstance(config.cp_handler, TorchContextParallelConfig)
    assert config.cp_handler.cp_comm_strategy == "allgather"
    assert isinstance(
        ParallelismConfig(dp_shard_size=2, tp_size=2).tp_handler, TorchTensorParallelConfig
    )


def test_invalid_layouts_are_refused():
    with pytest.raises(ValueError, match="tp_size must be at least 1"):
        ParallelismConfig(tp_size=0)
    with pytest.raises(ValueError, match="dp_shard_size > 1"):
        ParallelismConfig(dp_replicate_size=2, tp_size=2)  # TP over pure replication
    with pytest.raises(ValueError, match="Invalid cp_comm_strategy: ring"):
        TorchContextParallelConfig(cp_comm_strategy="ring")
    with patch_environment(PARALLELISM_CONFIG_CP_COMM_STRATEGY="alltoall"):
        assert (
            ParallelismConfig(dp_shard_size=2, cp_size=2).cp_handler.cp_comm_strategy == "alltoall"
        )
    with pytest.raises(NotImplementedError, match="DeepSpeed"):
        ParallelismConfig(sp_size=2)  # sequence parallelism is DeepSpeed's


def _mesh_on_ranks():
    import torch.distributed as dist

    from nbaccel import Accelerator

    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
    mesh = accelerator.parallelism_config.build_device_mesh("cpu")
    flattened = [mesh[name].size() for name in ("dp", "dp_shard_cp", "dp_cp")]
    # The 1-rank default layout becomes plain replication over the whole run.
    implicit = ParallelismConfig()
    implicit._validate_accelerator(accelerator)
    total = torch.ones(1)
    dist.all_reduce(total)
    return (
        mesh.mesh_dim_names,
        tuple(mesh.shape),
        flattened,
        implicit.dp_replicate_size,
        total.item(),
    )


def test_device_mesh_on_2_gloo_ranks():
    for names, shape, flattened, implicit, total in run_on_ranks(_mesh_on_ranks, 2):
        assert names == ("dp_shard",) and shape == (2,)
        assert flattened == [2, 2, 2] and implicit == 2 and total == 2.0


def test_accelerator_refuses_layouts_that_do_not_fit_the_run():
    from nbaccel import Accelerator

    with pytest.raises(ValueError, match=r"needs 4 ranks \(dp_shard_size=2 x tp_size=2 = 4\)"):
        Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    with pytest.raises(ValueError, match="needs 4 ranks"):
        Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=4))
    with pytest.raises(TypeError, match="ParallelismConfig"):
        Accelerator(parallelism_config={"dp_shard_size": 2})
