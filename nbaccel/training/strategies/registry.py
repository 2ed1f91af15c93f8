"""The strategy of a run, chosen once from its ``DistributedType``.

``select_strategy`` is called when an ``Accelerator`` is built; :data:`STRATEGIES` is the one
place that maps each kind of run to its strategy class (add a parallelism by adding a row).
"""

from __future__ import annotations

from typing import Any

from nbaccel.distributed.state import AcceleratorState, DistributedType
from nbaccel.training.config.kwargs_handlers import DistributedDataParallelKwargs
from nbaccel.training.precision.policy import PrecisionPolicy
from nbaccel.training.strategies.base import Strategy
from nbaccel.training.strategies.ddp import DDPStrategy
from nbaccel.training.strategies.deepspeed.strategy import DeepSpeedStrategy
from nbaccel.training.strategies.fsdp.strategy import FSDPStrategy
from nbaccel.training.strategies.model_parallel.mesh import MeshStrategy, needs_mesh_strategy
from nbaccel.training.strategies.xla import XLAStrategy

__all__ = ["STRATEGIES", "select_strategy"]

STRATEGIES: dict[DistributedType, type[Strategy]] = {
    DistributedType.NO: DDPStrategy,
    DistributedType.MULTI_CPU: DDPStrategy,
    DistributedType.MULTI_GPU: DDPStrategy,
    DistributedType.MULTI_XPU: DDPStrategy,
    DistributedType.FSDP: FSDPStrategy,
    DistributedType.DEEPSPEED: DeepSpeedStrategy,
    DistributedType.XLA: XLAStrategy,
}


def select_strategy(
    state: AcceleratorState,
    precision: PrecisionPolicy,
    ddp_kwargs: DistributedDataParallelKwargs | None = None,
    parallelism_config: Any = None,
    tp_plan: Any = None,
    megatron_lm_plugin: Any = None,
) -> Strategy:
    """The strategy for ``state.distributed_type``; a ``parallelism_config`` with tensor or
    context parallel or HSDP gets the mesh strategy, a ``megatron_lm_plugin`` the tensor +
    pipeline one."""
    if megatron_lm_plugin is None and state.distributed_type == DistributedType.MEGATRON_LM:
        megatron_lm_plugin = getattr(state, "megatron_lm_plugin", None)  # the run's (shared)
    if megatron_lm_plugin is not None:
        from nbaccel.training.strategies.megatron.strategy import MegatronStrategy

        if parallelism_config is not None and parallelism_config.total_size > 1:
            raise ValueError(
                "Pass megatron_lm_plugin or a parallelism_config with sizes above 1, not both."
            )
        return MegatronStrategy(state, precision, ddp_kwargs, plugin=megatron_lm_plugin)
    if needs_mesh_strategy(parallelism_config):
        return MeshStrategy(
            state, precision, ddp_kwargs, parallelism_config=parallelism_config, tp_plan=tp_plan
        )
    kind = state.distributed_type
    if kind == DistributedType.MEGATRON_LM:
        raise ValueError(
            "A MEGATRON_LM run trains with a MegatronLMPlugin: pass Accelerator("
            "megatron_lm_plugin=MegatronLMPlugin(...)), or launch with --use_megatron_lm."
        )
    if kind not in STRATEGIES:
        raise NotImplementedError(
            f"{kind.value} runs are not supported by nbaccel; supported: "
            f"{', '.join(k.value for k in STRATEGIES)}."
        )
    return STRATEGIES[kind](state, precision, ddp_kwargs)
