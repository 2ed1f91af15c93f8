"""Local SGD: each process trains on its own for a few steps, then the models are averaged.

Inside ``with LocalSGD(accelerator=..., model=..., local_sgd_steps=8) as local_sgd:`` the DDP
model skips its per-step gradient all-reduce (``no_sync``); every ``local_sgd_steps`` calls of
``local_sgd.step()`` (and once more when the block exits) the parameters are averaged over all
processes. Between syncs the processes' models drift apart; right after a sync they are equal.
This trades some convergence per step for far less communication (slow interconnects, many
nodes), as described in Accelerate's "Using Local SGD with Accelerate".
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from nbaccel.distributed.state import DistributedType

__all__ = ["LocalSGD"]

_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class LocalSGD:
    """Average ``model``'s parameters over processes every ``local_sgd_steps`` steps.

    Args:
        accelerator: the ``Accelerator`` that prepared ``model``.
        model: the prepared model.
        local_sgd_steps: optimizer steps between two averagings (>= 1).
        enabled: False makes this a no-op (so the same loop runs with or without Local SGD);
            it is also a no-op on a single process.
    """

    def __init__(
        self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True
    ) -> None:
        kind = accelerator.distributed_type
        if kind not in _SUPPORTED and not str(getattr(kind, "value", kind)).startswith("MULTI_"):
            raise NotImplementedError(
                f"LocalSGD averages plain data-parallel models; it does not support {kind} "
                "(FSDP, DeepSpeed, Megatron-LM or XLA). Use plain DDP (no FSDP plugin) or drop "
                "LocalSGD."
            )
        if enabled and (not isinstance(local_sgd_steps, int) or local_sgd_steps < 1):
            raise ValueError(
                f"local_sgd_steps must be an int >= 1 (steps between averagings), got "
                f"{local_sgd_steps!r}."
            )
        self.enabled = enabled and kind != DistributedType.NO
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._no_sync: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            no_sync = getattr(self.model, "no_sync", None)
            self._no_sync = no_sync() if no_sync is not None else contextlib.nullcontext()
            self._no_sync.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled or self._no_sync is None:
            return
        try:
            if exc_type is None:  # average a last time; after an error a peer may be gone
                self._average()
        finally:
            self._no_sync.__exit__(exc_type, exc, tb)
            self._no_sync = None

    def step(self) -> None:
        """Call after each ``optimizer.step()``: averages the model every ``local_sgd_steps``."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    @torch.no_grad()
    def _average(self) -> None:
        """Replace every parameter by its mean over the processes."""
        self.accelerator.wait_for_everyone()
        world = dist.get_world_size()
        for param in self.model.parameters():
            dist.all_reduce(param.data, op=dist.ReduceOp.SUM)
            param.data.div_(world)
