"""Tensor parallelism on torch's DTensor: a model's plan applied with ``parallelize_module``.

A plan maps module names (``*`` matches one name segment, as in transformers' plans) to how
each module's weights are split over the ``tp`` axis of the device mesh:

- the model's own plan: a transformers model carries one (``model._tp_plan``, built from its
  config's ``base_model_tp_plan``) in transformers' words (``"colwise"``, ``"rowwise"``,
  ``"embedding_rowwise"``, ``"colwise_gather_output"``...); :func:`resolve_plan` turns those into
  torch's ``ParallelStyle`` objects;
- a plan the user passes (``TorchTensorParallelPlugin(tp_plan=...)``): the same words, or torch's
  ``ColwiseParallel()`` / ``RowwiseParallel()`` objects as they are.

:func:`check_tensor_parallel` refuses, before anything is split, a plan that names modules the
model does not have and a ``tp_size`` that does not divide the attention heads or the split
dimensions; :func:`apply_tensor_parallel` splits the model in place.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = [
    "TorchTensorParallelPlugin",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "model_tp_plan",
    "resolve_plan",
    "tp_layout",
]

#: transformers' words for a module's split, understood here
STYLE_WORDS = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "colwise_gather_output",
    "rowwise_rep",
    "rowwise_split_input",
    "embedding_rowwise",
    "sequence_parallel",
)


@dataclass
class TorchTensorParallelPlugin:
    """Tensor parallelism with torch's DTensor (Accelerate's ``torch_tp_plugin``).

    Args:
        tp_size: ranks that split each tensor (the ``tp`` axis of the mesh).
        torch_device_mesh: a mesh to use (built from ``tp_size`` when None).
        tp_plan: ``{module name pattern: style}``; None uses the model's own plan.
    """

    tp_size: int = 1
    torch_device_mesh: Any = field(default=None, repr=False)
    tp_plan: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size!r}.")


def model_tp_plan(model: nn.Module) -> dict[str, Any]:
    """The model's own tensor-parallel plan (transformers' ``_tp_plan``, else the config's
    ``base_model_tp_plan`` under the base model's prefix); ``{}`` when it has none."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if plan:
        return plan
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    if base and prefix and hasattr(model, prefix) and getattr(model, prefix) is not model:
        base = {f"{prefix}.{k}": v for k, v in base.items()}
    return base


def _style(word: Any, name: str) -> Any:
    """torch's ParallelStyle for one of transformers' words (an object is kept as it is)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
    )

    if isinstance(word, ParallelStyle):
        return word
    styles = {
        "colwise": lambda: ColwiseParallel(),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise": lambda: RowwiseParallel(),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel(),
    }
    if word not in styles:
        raise ValueError(
            f"The tensor-parallel plan gives {name!r} the style {word!r}, which nbaccel does not "
            f"apply; use one of {', '.join(STYLE_WORDS)} or a torch ParallelStyle "
            "(ColwiseParallel(), RowwiseParallel(), ...). Shard(0)/Shard(1) come from "
            f"{Shard.__module__}."
        )
    return styles[word]()


def _pattern(key: str) -> re.Pattern[str]:
    """A plan key as a regex on module names: ``*`` is one name segment."""
    return re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$")


def resolve_plan(model: nn.Module, plan: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{module name: torch ParallelStyle}`` for every module of ``model`` the plan names.

    Raises ValueError naming the plan entries that match no module, with names the model has.
    """
    plan = dict(plan if plan is not None else model_tp_plan(model))
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan (no _tp_plan, no "
            "config.base_model_tp_plan): pass one, e.g. TorchTensorParallelPlugin(tp_plan="
            "{'layers.*.fc1': 'colwise', 'layers.*.fc2': 'rowwise'})."
        )
    names = [n for n, _ in model.named_modules() if n]
    resolved: dict[str, Any] = {}
    missing = []
    for key, word in plan.items():
        regex = _pattern(key)
        hits = [n for n in names if regex.match(n)]
        if not hits:
            missing.append(key)
        for hit in hits:
            resolved[hit] = _style(word, key)
    if missing:
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding)]
        shown = ", ".join(linear[:8]) + (" ..." if len(linear) > 8 else "")
        raise ValueError(
            f"The tensor-parallel plan names modules that {type(model).__name__} does not have: "
            f"{missing}. Fix the names (module names such as {shown}; '*' matches one part)."
        )
    return resolved


def _split_dim(style: Any, module: nn.Module) -> int | None:
    """The weight dimension a style splits (Linear: colwise 0, rowwise 1; Embedding: 0/1)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(module, nn.Embedding):
        return 1 if isinstance(style, ColwiseParallel) else 0
    if isinstance(style, ColwiseParallel):
        return 0
    if isinstance(style, RowwiseParallel):
        return 1
    return None


def check_tensor_parallel(
    model: nn.Module, tp_size: int, plan: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The resolved plan, after checking that ``tp_size`` divides the attention heads (key/value
    heads too) and every split dimension; errors name the numbers and the fix."""
    resolved = resolve_plan(model, plan)
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp_size:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ValueError(
                f"tp_size={tp_size} does not divide the model's {attr}={heads}: each tensor-"
                f"parallel rank must hold whole heads. Use a tp_size among {divisors}."
            )
    for name, style in resolved.items():
        module = model.get_submodule(name)
        weight = getattr(module, "weight", None)
        dim = _split_dim(style, module)
        if weight is None or dim is None:
            continue
        size = weight.shape[dim]
        if size % tp_size:
            raise ValueError(
                f"tp_size={tp_size} does not divide dimension {dim} ({size}) of {name}.weight "
                f"{tuple(weight.shape)}, which the plan splits: choose a tp_size that divides "
                f"{size}, or leave {name} out of the plan."
            )
    return resolved


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, plan: Mapping[str, Any] | None = None):
    """Split ``model`` in place over the 1-D ``tp_mesh`` (its parameters become DTensors);
    returns the model."""
    from torch.distributed.tensor.parallel import parallelize_module

    resolved = check_tensor_parallel(model, tp_mesh.size(), plan)
    parallelize_module(model, tp_mesh, resolved)
    model._nbaccel_tp_plan = {n: type(s).__name__ for n, s in resolved.items()}
    return model


def tp_layout(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], str]]:
    """``{parameter: (global shape, local shape, placements)}``: who holds which shard."""
    out = {}
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        placements = str(tuple(getattr(param, "placements", ()) or ()))
        out[name] = (tuple(param.shape), tuple(local.shape), placements)
    return out
