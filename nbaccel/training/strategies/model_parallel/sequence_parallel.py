"""Megatron-style sequence parallelism for a decoder stage, on torch's tensor-parallel styles.

With plain tensor parallelism every rank of a ``tp`` group holds the whole sequence between the
attention and MLP blocks (norms, residuals, dropout run replicated). Sequence parallelism keeps
those activations split along the sequence (``Shard(1)``) and gathers the sequence only inside
attention and the MLP, where the heads / hidden units are split instead:

- token embedding: row-wise, its output scattered along the sequence;
- each norm: ``SequenceParallel`` (runs on the local part of the sequence);
- attention and MLP inputs: gathered (``PrepareModuleInput``: ``Shard(1)`` -> ``Replicate``);
  ``q/k/v``, ``gate/up`` column-wise as in the model's plan; ``o_proj`` and ``down_proj``
  row-wise with their outputs reduce-scattered back to ``Shard(1)``;
- LM head: column-wise over the gathered sequence, full logits out.

Activation memory outside attention/MLP drops by ``tp``; the results are those of plain TP.
Layers of the Llama family are supported (``self_attn``, ``mlp``, ``input_layernorm``,
``post_attention_layernorm``; ``o_proj`` / ``down_proj`` as the row-wise projections).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["sequence_parallel_plan"]

_ROW_OUT = {"o_proj", "down_proj"}


def sequence_parallel_plan(stage: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` (stage-relative names -> styles, the model's TP plan) turned into the sequence-
    parallel plan for ``stage``'s modules."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    out = dict(plan)
    names = {n for n, _ in stage.named_modules() if n}
    for name in names:
        leaf = name.rsplit(".", 1)[-1]
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if leaf in ("input_layernorm", "post_attention_layernorm") or name.endswith("model.norm"):
            out[name] = SequenceParallel()
        elif leaf == "self_attn":
            out[name] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
        elif leaf == "mlp":
            out[name] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        elif leaf in _ROW_OUT and parent.rsplit(".", 1)[-1] in ("self_attn", "mlp"):
            out[name] = RowwiseParallel(output_layouts=Shard(1))
        elif leaf == "embed_tokens":
            out[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        elif name == "lm_head":
            out[name] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    blocks = [n for n in names if n.endswith((".self_attn", ".mlp"))]
    if not blocks:
        raise ValueError(
            "sequence_parallelism=True needs decoder layers with self_attn and mlp blocks "
            f"(Llama family); {type(stage).__name__} has none."
        )
    return out
