"""The descriptive attributes of Accelerate's ``Accelerator`` that scripts read: the kwargs
handlers by role, the FP8 recipe and backend, DeepSpeed's plugin and engine, the parallel ranks,
the device mesh. Each is read-only and derived from the Accelerator's public parts (``handlers``,
``state``, ``strategy``, ``precision``, ``parallelism_config``, ``dataloader_config``): the base
class :class:`AcceleratorAttributes` holds no state of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from nbaccel.distributed.state import DistributedType
from nbaccel.training.config.kwargs_handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
)
from nbaccel.training.precision.fp8.recipes import AORecipeKwargs, TERecipeKwargs

__all__ = ["AcceleratorAttributes"]


def _handler(kind: type) -> property:
    return property(lambda self: self.handlers.get(kind), doc=f"The {kind.__name__} passed.")


def _off(value: Any = None, doc: str = "") -> property:
    return property(lambda self: value, doc=doc)


def _mesh_rank(enabled: str, axis: str, what: str) -> property:
    def rank(self: Any) -> int:
        config = self.parallelism_config
        if config is None:
            raise RuntimeError(f"{what} is not configured. Set `parallelism_config` first.")
        if not getattr(config, enabled):
            return 0
        return self.torch_device_mesh.get_local_rank(axis)

    return property(rank, doc=f"This process's rank along the {axis!r} axis (0 when off).")


class AcceleratorAttributes:
    """Accelerate's descriptive ``Accelerator`` attributes, computed from the public parts the
    :class:`~nbaccel.Accelerator` builds in its constructor."""

    ddp_handler = _handler(DistributedDataParallelKwargs)
    scaler_handler = _handler(GradScalerKwargs)
    init_handler = _handler(InitProcessGroupKwargs)
    autocast_handler = _handler(AutocastKwargs)
    # FP8: the recipe the precision policy trains with; MS-AMP, LOMO and DeepSpeed are refused
    fp8_recipe_handler = property(
        lambda self: getattr(self.precision, "recipe", None), doc="The FP8 recipe in use."
    )
    te_recipe_handler = _handler(TERecipeKwargs)
    ao_recipe_handler = _handler(AORecipeKwargs)
    msamp_recipe_handler = _off(doc="MS-AMP recipe handler (MS-AMP is refused: always None).")
    has_fp8_handler = property(
        lambda self: any(k in self.handlers for k in (AORecipeKwargs, TERecipeKwargs)),
        doc="Whether an FP8 recipe handler was passed.",
    )
    fp8_enabled = property(
        lambda self: getattr(self.precision, "name", None) == "fp8",
        doc="Whether FP8 layers are on (from mixed_precision='fp8', a recipe or the FSDP plugin).",
    )
    delayed_fp8_autocast = _off(False, "Delayed FP8 autocast (not used: FP8 is set up in prepare).")

    @property
    def fp8_backend(self) -> Any:
        """The FP8 backend (``FP8BackendType.AO`` or ``.TE``; None without FP8)."""
        from nbaccel.training.config.unsupported_stacks import FP8BackendType

        backend = getattr(self.precision, "backend", None) if self.fp8_enabled else None
        return FP8BackendType(backend) if backend else None

    has_lomo_optimizer = _off(False, "Whether a LOMO optimizer was prepared (never).")
    deepspeed_plugin = property(
        lambda self: self.state.deepspeed_plugin,
        doc="The selected DeepSpeed plugin (None without DeepSpeed).",
    )
    deepspeed_config = property(
        lambda self: getattr(self.state.deepspeed_plugin, "deepspeed_config", None),
        doc="The selected DeepSpeed plugin's config, its 'auto' values filled by prepare.",
    )
    deepspeed_engine_wrapped = property(
        lambda self: getattr(self.strategy, "wrapped", None),
        doc="The DeepSpeed engine accelerator.backward drives (None without DeepSpeed).",
    )

    @property
    def pipeline_parallel_rank(self) -> int:
        """This process's pipeline stage (0 without pipeline parallelism)."""
        return int(getattr(self.strategy, "pipeline_parallel_rank", 0))

    tensor_parallel_rank = _mesh_rank("tp_enabled", "tp", "Tensor parallelism")
    context_parallel_rank = _mesh_rank("cp_enabled", "cp", "Context parallelism")
    data_parallel_rank = _mesh_rank("dp_replicate_enabled", "dp_replicate", "Data parallelism")
    data_parallel_shard_rank = _mesh_rank("dp_shard_enabled", "dp_shard", "Data parallelism")

    @property
    def native_amp(self) -> bool:
        """Whether torch.amp mixed precision (fp16/bf16) is on."""
        return str(self.state.mixed_precision) in ("fp16", "bf16")

    @property
    def multi_device(self) -> bool:
        """More than one accelerator device per run (multi-GPU and the like)."""
        return self.use_distributed and self.distributed_type in (
            DistributedType.MULTI_GPU,
            DistributedType.MULTI_XPU,
            DistributedType.MULTI_NPU,
            DistributedType.MULTI_MLU,
            DistributedType.MULTI_HPU,
        )

    @property
    def is_fsdp2(self) -> bool:
        """Whether models are sharded with FSDP2 (nbaccel's only FSDP)."""
        return self.distributed_type == DistributedType.FSDP

    is_composable_parallelism_enabled = is_fsdp2

    @property
    def use_stateful_dataloader(self) -> bool:
        """Whether prepared loaders are torchdata ``StatefulDataLoader``s."""
        return bool(getattr(self.dataloader_config, "use_stateful_dataloader", False))

    @property
    def torch_device_mesh(self) -> Any:
        """The device mesh of ``parallelism_config`` (None without one)."""
        config = self.parallelism_config
        if config is None:
            return None
        return config.get_device_mesh(self.device.type)  # one mesh, shared with the strategy

    @property
    def should_save_model(self) -> bool:
        """Whether this process takes part in saving the model (every process, as Accelerate)."""
        return True if self.parallelism_config is not None else self.is_local_main_process

    @contextlib.contextmanager
    def maybe_context_parallel(
        self, buffers: Any = None, buffer_seq_dims: Any = None, no_restore_buffers: Any = None
    ) -> Iterator[None]:
        """Split ``buffers`` (input ids, labels, positions...) along ``buffer_seq_dims`` over the
        ``cp`` axis for the block (torch's ``context_parallel``); a no-op when cp is off."""
        with self.strategy.context_parallel(buffers, buffer_seq_dims, no_restore_buffers):
            yield

    def lomo_backward(self, loss: Any, learning_rate: float) -> None:
        """LOMO optimizers are not supported: refused with the alternative."""
        raise NotImplementedError(
            "nbaccel does not train LOMO optimizers (lomo_optim); use accelerator.backward(loss) "
            "with a torch optimizer."
        )
