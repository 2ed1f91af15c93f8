"""N-D parallelism over a ``DeviceMesh``: tensor parallel, HSDP and their compositions.

``MeshStrategy`` trains what a
:class:`~nbaccel.training.config.parallelism_config.ParallelismConfig`
describes, on torch's own engines:

1. tensor parallel (``tp_size > 1``): the model's plan (or the user's) applied with
   ``parallelize_module`` over the mesh's ``tp`` axis (:mod:`.tensor_parallel`);
2. the data-parallel axes: ``fully_shard`` over ``dp_shard_cp`` (FSDP2), or over
   ``(dp_replicate, dp_shard_cp)`` (HSDP); on top of TP this gives 2-D/3-D DTensors;
3. data: every rank of one tensor-parallel group reads the same batches; the loaders are
   sharded over the data-parallel ranks only (``data_parallel_size``/``data_parallel_rank``).

State dicts and checkpoints are those of :class:`~.fsdp.FSDPStrategy` (torch's
``get_model_state_dict`` gathers any DTensor, TP or FSDP, into full tensors; dcp saves shards).
Context parallel (``cp_size > 1``) runs where torch's ``context_parallel`` does: CUDA devices
(its attention dispatch has no CPU kernel); CPU runs are refused with that reason.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from nbaccel.training.strategies.fsdp.strategy import FSDPStrategy, _no_gradient_sync, is_fsdp_model
from nbaccel.training.strategies.model_parallel.tensor_parallel import apply_tensor_parallel
from nbaccel.training.strategies.repoint import remember_moves

__all__ = ["MeshStrategy", "clip_grad_norm_mixed", "needs_mesh_strategy"]

CP_ON_CPU = (
    "context parallel (cp_size > 1) needs CUDA ranks: torch's context_parallel swaps SDPA for "
    "ring attention, which has no CPU kernel (aten._scaled_dot_product_flash_attention_for_cpu "
    "has no sharding strategy). Run it on GPUs, or set cp_size=1 here."
)


def needs_mesh_strategy(config: Any) -> bool:
    """Whether ``config`` asks for more than plain DDP or plain FSDP (TP, CP, or HSDP)."""
    if config is None:
        return False
    hsdp = config.dp_replicate_enabled and config.dp_shard_enabled
    return bool(config.tp_enabled or config.cp_enabled or hsdp)


class MeshStrategy(FSDPStrategy):
    """TP / HSDP / TP + FSDP2 / TP + HSDP (and CP on CUDA) over the run's device mesh."""

    def __init__(self, *args: Any, parallelism_config: Any = None, tp_plan: Any = None, **kw):
        super().__init__(*args, **kw)
        self.config = parallelism_config
        self.tp_plan = tp_plan
        if self.config.cp_enabled and self.device.type == "cpu":
            raise NotImplementedError(CP_ON_CPU)

    def __repr__(self) -> str:
        names, shape = self.config._get_mesh()
        return f"MeshStrategy({dict(zip(names, shape, strict=True))}, {self.device})"

    @property
    def mesh(self) -> Any:
        """The run's ``DeviceMesh`` (built once, shared with ``accelerator.torch_device_mesh``)."""
        return self.config.get_device_mesh(self.device.type)

    # -- data ---------------------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        return self.config.data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        if not self.config.dp_dim_names:
            return 0
        return self.mesh["dp"].get_local_rank()

    # -- model --------------------------------------------------------------------------------
    def _dp_mesh(self) -> Any:
        """The mesh ``fully_shard`` spans, or None when no data-parallel axis shards."""
        if not (self.config.dp_shard_enabled or self.config.cp_enabled):
            return None
        return self.mesh[tuple(self.config.fsdp_dim_names)]

    def prepare_model(
        self, model: nn.Module, device_placement: bool, evaluation_mode: bool = False
    ) -> nn.Module:
        before = dict(model.named_parameters(remove_duplicate=False))
        if device_placement and not any(p.is_meta for p in model.parameters()):
            model = model.to(self.device)
        self.precision.wrap_forward(model)
        if self.config.tp_enabled:
            apply_tensor_parallel(model, self.mesh["tp"], self.tp_plan)
        dp_mesh = self._dp_mesh()
        if dp_mesh is not None and not evaluation_mode:
            from nbaccel.training.strategies.fsdp.strategy import shard_model

            shard_model(model, self.plugin, self.device, mesh=dp_mesh)
        remember_moves(model, before, dict(model.named_parameters(remove_duplicate=False)))
        return model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        inner = getattr(model, "_orig_mod", model)
        return _no_gradient_sync(inner) if is_fsdp_model(inner) else contextlib.nullcontext()

    # -- the training step --------------------------------------------------------------------
    def clip_grad_norm_(
        self, parameters: list[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        return clip_grad_norm_mixed(parameters, max_norm, norm_type)

    # -- context parallel ---------------------------------------------------------------------
    def context_parallel(self, buffers: Any, buffer_seq_dims: Any, no_restore_buffers: Any) -> Any:
        """torch's ``context_parallel`` over the ``cp`` axis (a null context when cp is off)."""
        if not self.config.cp_enabled or not buffers:
            return contextlib.nullcontext()
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(self.config.cp_handler.cp_comm_strategy)
        return context_parallel(
            self.mesh["cp"],
            buffers=list(buffers),
            buffer_seq_dims=list(buffer_seq_dims),
            no_restore_buffers=set(no_restore_buffers or ()),
        )


def _local_norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm of one gradient over every rank that holds part of it (a plain local value)."""
    norm = torch.linalg.vector_norm(grad, norm_type)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def clip_grad_norm_mixed(
    parameters: list[torch.Tensor], max_norm: float, norm_type: float = 2
) -> torch.Tensor:
    """``clip_grad_norm_`` for a model whose gradients mix DTensors on different meshes (TP and
    FSDP axes) and plain tensors; returns the total norm (a plain tensor, equal on every rank)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norms = torch.stack([_local_norm(g, norm_type).float() for g in grads])
    total = norms.max() if math.isinf(norm_type) else torch.linalg.vector_norm(norms, norm_type)
    scale = min(float(max_norm) / (float(total) + 1e-6), 1.0)
    for grad in grads:
        grad.mul_(scale)
    return total
