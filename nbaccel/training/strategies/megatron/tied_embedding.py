"""A tied input embedding and output head on two pipeline stages, kept in step.

GPT-2 ties ``lm_head.weight`` to ``wte.weight``. Cut into stages, the first stage holds the
embedding and the last the head: two copies of one parameter, equal at the start. Summing their
gradients between those two ranks before each step (as Megatron-LM does with its word
embeddings) keeps them equal, and the global gradient norm counts the parameter once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TiedEmbedding"]


class TiedEmbedding:
    """The copy of the tied parameter this rank holds and the group of the two ranks (first
    and last stage, same data- and tensor-parallel place) that share it.

    Args:
        stage: this rank's stage (``is_first``/``is_last``, ``transformer.wte``, ``lm_head``).
        pp, dp, tp: the mesh's sizes (ranks ordered ``(pp, dp, tp)``, tp fastest).
    """

    def __init__(self, stage: Any, pp: int, dp: int, tp: int) -> None:
        self.group: Any = None
        me = dist.get_rank()
        for d in range(dp):
            for t in range(tp):
                ranks = [d * tp + t, (pp - 1) * dp * tp + d * tp + t]
                group = dist.new_group(ranks)  # every rank creates every group, in order
                if me in ranks:
                    self.group = group
        self.param = None
        if stage.is_first:
            self.param = stage.transformer.wte.weight
        elif stage.is_last:
            self.param = stage.lm_head.weight
        #: the last stage's copy is left out of the global norm (the first counts it)
        self.counted = not stage.is_last

    def sync(self) -> None:
        """Sum the two copies' gradients (before clipping and the step)."""
        param = self.param
        if self.group is None or param is None:
            return
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        placements = getattr(param, "placements", None)
        if placements is not None and param.grad.placements != placements:
            # the embedding's backward gives a replicated gradient; the head's is sharded
            param.grad = param.grad.redistribute(param.device_mesh, placements)
        local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        dist.all_reduce(local, group=self.group)
