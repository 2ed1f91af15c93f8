"""One pipeline stage of a GPT-2 language model, with its tensor-parallel split.

GPT-2 differs from the Llama family in three ways that matter here:

- its projections are ``Conv1D`` (a linear layer with the weight stored ``[in, out]``), which
  torch's tensor-parallel styles do not split: the stage turns each into an ``nn.Linear``
  (weight transposed);
- ``c_attn`` packs q, k and v in one matrix, so a column split would give a rank parts of q
  and k: it becomes :class:`PackedQKV` (three linears, each split by columns, concatenated), and
  each attention's ``split_size`` becomes its local width;
- ``lm_head`` is tied to ``wte``: on one stage they stay one parameter; over several stages the
  first and the last stage each hold a copy, and the strategy sums their gradients between
  those two ranks before each step (as Megatron-LM does with its word embeddings).

:meth:`GPT2Stage.export_state` turns the stage's tensors back into GPT-2's own names and
layouts (``c_attn.weight`` ``[in, 3 x out]``...), so the gathered state dict loads into
``GPT2LMHeadModel``. Sequence parallelism is not offered for GPT-2 (its learned position
embedding is added after the token embedding, before any split).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from nbaccel.training.strategies.megatron.decoder_stages import (
    WholeModelSaving,
    layer_ranges,
)

__all__ = ["GPT2Stage", "PackedQKV", "gpt2_tp_plan", "is_gpt2"]


def is_gpt2(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers GPT-2 language model (``transformer.h`` blocks)."""
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) == "gpt2" and hasattr(model, "transformer")


def _linear(conv: nn.Module) -> nn.Linear:
    """A ``Conv1D`` as the equivalent ``nn.Linear`` (same values, weight transposed)."""
    weight = conv.weight.detach()
    linear = nn.Linear(weight.shape[0], weight.shape[1], device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        linear.bias.copy_(conv.bias.detach())
    return linear


class PackedQKV(nn.Module):
    """GPT-2's ``c_attn`` as three linears (q, k, v) whose outputs are concatenated: split by
    columns, each rank's output is its own heads' ``[q, k, v]``."""

    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        width = conv.weight.shape[1] // 3
        weight, bias = conv.weight.detach(), conv.bias.detach()
        for i, name in enumerate(("q", "k", "v")):
            part = nn.Linear(weight.shape[0], width, device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                part.weight.copy_(weight[:, i * width : (i + 1) * width].t())
                part.bias.copy_(bias[i * width : (i + 1) * width])
            self.add_module(name, part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


class GPT2Stage(WholeModelSaving, nn.Module):
    """Stage ``index`` of ``stages`` of a GPT-2 LM: token ids (first stage) or hidden states in,
    hidden states or logits (last stage) out; parameter names are the model's, with
    ``transformer.h.<i>`` kept for block ``i``. Takes the model's modules."""

    prefix = "transformer"

    def __init__(
        self, model: nn.Module, index: int, stages: int, last_stage_layers: int | None = None
    ) -> None:
        super().__init__()
        base = model.transformer
        first, last = layer_ranges(len(base.h), stages, last_stage_layers)[index]
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.sequence_shards = 1
        self.layer_range = (first, last)
        self.tied = model.lm_head.weight is base.wte.weight
        self.model_class, self.config = type(model), model.config
        base.h = nn.ModuleDict({str(i): base.h[i] for i in range(first, last)})
        if not self.is_first:
            base.wte = base.wpe = base.drop = None
        if not self.is_last:
            base.ln_f = None
        self.add_module("transformer", base)
        self.lm_head = model.lm_head if self.is_last else None
        self._linear_names: list[str] = []

    def blocks(self) -> nn.ModuleDict:
        """This stage's blocks, by their index in the model."""
        return self.transformer.h

    def to_linears(self) -> None:
        """Every ``Conv1D`` as ``nn.Linear`` (``c_attn`` as :class:`PackedQKV`), so that
        torch's tensor-parallel styles can split them."""
        for key, block in self.blocks().items():
            attn, mlp = block.attn, block.mlp
            attn.c_attn = PackedQKV(attn.c_attn)
            for owner, name in ((attn, "c_proj"), (mlp, "c_fc"), (mlp, "c_proj")):
                setattr(owner, name, _linear(getattr(owner, name)))
                where = "attn" if owner is attn else "mlp"
                self._linear_names.append(f"transformer.h.{key}.{where}.{name}.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.transformer
        if self.is_first:
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            hidden = base.drop(base.wte(x) + base.wpe(positions))
        else:
            hidden = x
        for block in base.h.values():
            hidden = block(hidden, attention_mask=None)  # causal attention, no padding
        if not self.is_last:
            return hidden
        return self.lm_head(base.ln_f(hidden))

    def export_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """GPT-2's names and ``Conv1D`` layouts for the stage's (gathered) tensors."""
        out = {}
        for key, value in state.items():
            key = key.replace("._checkpoint_wrapped_module", "")
            packed = _PACKED.match(key)
            if packed:
                head, part, kind = packed.groups()
                out.setdefault(f"{head}.{kind}", {})[part] = value
                continue
            out[key] = value.t().contiguous() if key in self._linear_names else value
        for key in [k for k, v in out.items() if isinstance(v, dict)]:
            parts = out[key]
            joined = [parts[p] for p in ("q", "k", "v")]
            if key.endswith("weight"):
                out[key] = torch.cat([w.t() for w in joined], dim=1).contiguous()
            else:
                out[key] = torch.cat(joined)
        return out


_PACKED = re.compile(r"^(.*\.attn\.c_attn)\.([qkv])\.(weight|bias)$")


def gpt2_tp_plan(stage: GPT2Stage, tp: int) -> dict[str, Any]:
    """The stage's tensor-parallel plan (after checking that ``tp`` divides the heads, the
    vocabulary and the MLP width); turns the stage's ``Conv1D`` into linears and sets each
    attention's local ``split_size``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config = stage.config
    inner = config.n_inner or 4 * config.n_embd
    for name, size in (("n_head", config.n_head), ("vocab_size", config.vocab_size),
                       ("n_inner", inner)):  # fmt: skip
        if size % tp:
            raise ValueError(
                f"tp_degree={tp} does not divide GPT-2's {name}={size}: choose a tp_degree that "
                f"divides it (each tensor-parallel rank holds whole heads and equal slices)."
            )
    stage.to_linears()
    plan: dict[str, Any] = {}
    for key, block in stage.blocks().items():
        prefix = f"transformer.h.{key}"
        for part in ("q", "k", "v"):
            plan[f"{prefix}.attn.c_attn.{part}"] = ColwiseParallel()
        plan[f"{prefix}.attn.c_proj"] = RowwiseParallel()
        plan[f"{prefix}.mlp.c_fc"] = ColwiseParallel()
        plan[f"{prefix}.mlp.c_proj"] = RowwiseParallel()
        block.attn.split_size = config.n_embd // tp
    if stage.is_first:
        plan["transformer.wte"] = RowwiseParallel(input_layouts=Replicate())
    if stage.is_last:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan
