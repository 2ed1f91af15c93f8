"""How much memory a model needs, per dtype, without allocating it.

``estimate_memory(model_or_factory)`` builds the model on the ``meta`` device when given a
factory (nothing is allocated, nothing downloaded) and returns a :class:`MemoryEstimate`: for
each dtype the largest layer, the total size and the training footprint with Adam. It displays
as an HTML table in a notebook and prints as text (``nbaccel estimate-memory`` uses the same).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nbaccel.values.byte_text import human_bytes

__all__ = ["DTYPE_BYTES", "MemoryEstimate", "estimate_memory"]

DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "int8": 1.0, "int4": 0.5}
TRAINABLE = {"float32", "float16", "bfloat16"}
TRAINING_NOTE = (
    "training (Adam) = weights + gradients + Adam's two moments, all in that dtype (4x the "
    "model); activations not included. With autocast mixed precision the weights stay float32: "
    "read the float32 row."
)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.1f}{unit}"
    return str(n)


@dataclass
class EstimateRow:
    dtype: str
    largest_layer: int
    largest_layer_names: list[str]
    total: int
    training: int | None


@dataclass
class MemoryEstimate:
    """The estimate for one model; ``rows`` has one :class:`EstimateRow` per dtype."""

    model_name: str
    parameters: int
    rows: list[EstimateRow]

    def text(self) -> str:
        head = f"Memory estimate for {self.model_name} ({_count(self.parameters)} parameters)"
        table = [("dtype", "largest layer", "total size", "training (Adam)")]
        for r in self.rows:
            training = human_bytes(r.training) if r.training is not None else "n/a"
            table.append((r.dtype, human_bytes(r.largest_layer), human_bytes(r.total), training))
        widths = [max(len(row[i]) for row in table) for i in range(4)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        largest = self.rows[0].largest_layer_names if self.rows else []
        tail = [f"largest layer: {', '.join(largest[:3]) or '(whole model)'}", TRAINING_NOTE]
        return "\n".join([head, *lines, *tail])

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr><td>{r.dtype}</td><td>{human_bytes(r.largest_layer)}</td>"
            f"<td>{human_bytes(r.total)}</td>"
            f"<td>{human_bytes(r.training) if r.training is not None else 'n/a'}</td></tr>"
            for r in self.rows
        )
        largest = self.rows[0].largest_layer_names if self.rows else []
        return (
            '<div class="nbaccel-memory-estimate">'
            f"<b>Memory estimate</b> for <code>{html.escape(self.model_name)}</code> "
            f"({_count(self.parameters)} parameters)"
            "<table><thead><tr><th>dtype</th><th>largest layer</th><th>total size</th>"
            f"<th>training (Adam)</th></tr></thead><tbody>{body}</tbody></table>"
            f"<small>largest layer: <code>{html.escape(', '.join(largest[:3]))}</code>. "
            f"{html.escape(TRAINING_NOTE)}</small></div>"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "parameters": self.parameters,
            "rows": [vars(r) for r in self.rows],
        }


def _build(model_or_factory: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    if isinstance(model_or_factory, nn.Module):
        return model_or_factory
    if not callable(model_or_factory):
        raise TypeError(
            f"estimate_memory needs an nn.Module or a function that builds one, got "
            f"{type(model_or_factory).__name__}."
        )
    from nbaccel.bigmodel.empty import init_empty_weights

    with init_empty_weights():
        model = model_or_factory()
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"the factory {getattr(model_or_factory, '__name__', model_or_factory)!r} returned "
            f"{type(model).__name__}, not an nn.Module."
        )
    return model


def estimate_memory(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    dtypes: Iterable[str] = ("float32", "float16", "int8", "int4"),
    no_split_module_classes: list[str] | None = None,
) -> MemoryEstimate:
    """Largest layer, total size and training-with-Adam size of a model for each dtype.

    ``model_or_factory``: a module (real or ``meta``) or a zero-argument function returning one,
    which is then called under ``init_empty_weights()``. ``dtypes`` among float32, float16,
    bfloat16, int8, int4: floating-point tensors take that size, other tensors keep theirs.
    """
    from nbaccel.bigmodel.planning.module_sizes import compute_module_sizes, get_max_layer_size

    names = [str(d).replace("torch.", "") for d in dtypes]
    unknown = [d for d in names if d not in DTYPE_BYTES]
    if unknown:
        raise ValueError(f"Unknown dtype(s) {unknown}; choose among {', '.join(DTYPE_BYTES)}.")
    model = _build(model_or_factory)
    wide = compute_module_sizes(model, dtype=torch.float32)
    narrow = compute_module_sizes(model, dtype=torch.int8)
    # wide = 4F + N and narrow = F + N, with F floating-point elements and N other bytes
    floats = {k: (wide[k] - narrow[k]) // 3 for k in wide}
    other = {k: narrow[k] - floats[k] for k in wide}
    no_split = no_split_module_classes or getattr(model, "_no_split_modules", None) or []
    children = list(model.named_children())
    rows = []
    for dtype in names:
        per = DTYPE_BYTES[dtype]
        sizes = {k: int(floats[k] * per) + other[k] for k in wide}
        largest, largest_names = get_max_layer_size(children, sizes, no_split)
        total = sizes.get("", 0)
        if not children:
            largest, largest_names = total, [""]
        training = 4 * total if dtype in TRAINABLE else None
        rows.append(EstimateRow(dtype, largest, largest_names, total, training))
    parameters = sum(p.numel() for p in model.parameters())
    return MemoryEstimate(type(model).__name__, parameters, rows)
