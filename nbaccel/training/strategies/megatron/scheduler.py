"""Megatron-LM's learning-rate and weight-decay schedule, on a torch optimizer.

``MegatronLMDummyScheduler(optimizer, total_num_steps, warmup_num_steps)`` stands for it (as in
Accelerate); ``accelerator.prepare`` turns it into :class:`MegatronLRScheduler` from the
plugin's schedule fields, as Megatron-LM's ``OptimizerParamScheduler`` computes them:

- the schedule counts samples: each ``step()`` advances by the global batch
  (``dp x micro_batch_size x num_micro_batches``);
- ``train_iters`` (else ``total_num_steps // dp``, Accelerate's rule) or ``train_samples`` sets
  the length; the decay runs over ``lr_decay_iters`` (x global batch) or ``lr_decay_samples``
  (default: the whole run); the warm-up over ``lr_warmup_fraction`` of the decay, else
  ``lr_warmup_iters`` (else ``warmup_num_steps // dp``) x global batch, or
  ``lr_warmup_samples``;
- warm-up is linear from 0 to each param group's lr; then ``lr_decay_style``: constant,
  linear, cosine or inverse-square-root, never below ``min_lr``;
- with ``start_weight_decay`` / ``end_weight_decay`` the weight decay moves between them over
  the run (``weight_decay_incr_style`` constant, linear or cosine); param groups created with
  ``weight_decay=0.0`` stay at 0 (Megatron-LM's no-decay groups).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MegatronLMDummyScheduler", "MegatronLRScheduler"]


class MegatronLMDummyScheduler:
    """Stands for Megatron-LM's scheduler until ``accelerator.prepare`` builds it.

    Args:
        optimizer: the optimizer it will drive.
        total_num_steps: training steps of the run (sets ``train_iters`` when the plugin's is
            unset).
        warmup_num_steps: warm-up steps (sets ``lr_warmup_iters`` when the plugin's is unset).
        **kwargs: kept, as Accelerate does.
    """

    #: what ``accelerator.prepare`` replaces with the strategy's scheduler
    stands_for_a_scheduler = True

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int | None = None,
        warmup_num_steps: int = 0,
        **kwargs: Any,
    ) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.kwargs = kwargs


class MegatronLRScheduler:
    """Megatron-LM's ``OptimizerParamScheduler`` for ``optimizer`` (see the module docstring)."""

    def __init__(self, optimizer: Any, plugin: Any, total_num_steps: Any, warmup_num_steps: Any):
        self.optimizer = optimizer
        gbs, dp = plugin.global_batch_size, plugin.data_parallel_size
        if gbs is None:
            raise ValueError(
                "MegatronLMDummyScheduler needs the global batch size: prepare the training "
                "DataLoader in the same accelerator.prepare call (or before the scheduler)."
            )
        train_iters = plugin.train_iters
        if train_iters is None and total_num_steps is not None:
            train_iters = int(total_num_steps) // dp
        warmup_iters = plugin.lr_warmup_iters
        if warmup_iters is None:
            warmup_iters = int(warmup_num_steps or 0) // dp
        if train_iters:
            decay = (plugin.lr_decay_iters or train_iters) * gbs
            self.wd_incr_steps = train_iters * gbs
            warmup = warmup_iters * gbs
        elif plugin.train_samples:
            decay = plugin.lr_decay_samples or plugin.train_samples
            self.wd_incr_steps = plugin.train_samples
            warmup = plugin.lr_warmup_samples or 0
        else:
            raise ValueError(
                "Megatron-LM's scheduler needs the run's length: MegatronLMDummyScheduler("
                "total_num_steps=...), or MegatronLMPlugin(train_iters=...) or (train_samples=...)."
            )
        if plugin.lr_warmup_fraction is not None:
            warmup = plugin.lr_warmup_fraction * decay
        self.lr_decay_steps, self.lr_warmup_steps = decay, warmup
        self.increment = gbs
        self.style, self.wd_style = plugin.lr_decay_style, plugin.weight_decay_incr_style
        self.min_lr = float(plugin.min_lr)
        base_wd = float(getattr(optimizer, "defaults", {}).get("weight_decay", 0.0) or 0.0)
        self.schedule_wd = (plugin.start_weight_decay, plugin.end_weight_decay) != (None, None)
        start = plugin.start_weight_decay
        end = plugin.end_weight_decay
        self.start_wd = base_wd if start is None else float(start)
        self.end_wd = base_wd if end is None else float(end)
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
            group.setdefault("_megatron_wd_mult", 0.0 if not group.get("weight_decay") else 1.0)
        self.num_steps = 0
        self._last_lr: list[float] = []
        self.step(0)

    def get_wd(self) -> float:
        """The weight decay at the current sample count."""
        if self.num_steps > self.wd_incr_steps or self.wd_style == "constant":
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        coeff = ratio if self.wd_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr_for(self, max_lr: float) -> float:
        """The learning rate of a group whose peak is ``max_lr``, at the current count."""
        n, warmup = self.num_steps, self.lr_warmup_steps
        if warmup > 0 and n <= warmup:
            return max_lr * n / warmup
        if self.style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return self.min_lr
        if self.style == "inverse-square-root":
            return max(self.min_lr, max_lr * max(warmup, 1) ** 0.5 / max(n, 1) ** 0.5)
        ratio = (n - warmup) / (self.lr_decay_steps - warmup)
        if self.style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (max_lr - self.min_lr)

    def step(self, increment: int | None = None) -> None:
        """Advance by one global batch (or ``increment`` samples) and set each group's lr
        (and weight decay, when scheduled)."""
        self.num_steps += self.increment if increment is None else increment
        wd = self.get_wd()
        self._last_lr = []
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr_for(group["initial_lr"])
            if self.schedule_wd:
                group["weight_decay"] = wd * group["_megatron_wd_mult"]
            self._last_lr.append(group["lr"])

    def get_last_lr(self) -> list[float]:
        """Each param group's current learning rate."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """The sample count (the rest comes from the plugin)."""
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved sample count."""
        self.num_steps = int(state_dict["num_steps"])
        self.step(0)
