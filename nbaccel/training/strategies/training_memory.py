"""What training state each rank holds: parameter, gradient and optimizer-state bytes.

:func:`training_memory` counts the tensors one rank really holds for a prepared model and its
optimizer, each storage once (a parameter that is a view into a flat buffer, or an optimizer's
master copy that *is* the parameter, is not counted twice): under DDP every rank holds the whole
model and optimizer; under ZeRO a rank holds its partition (stage 1: optimizer state, 2: and
gradients, 3: and parameters), so the numbers show what each stage cuts. ``offload`` names where
ZeRO keeps the optimizer state / parameters when the config offloads them.
:func:`gather_training_memory` collects every rank's numbers; :class:`TrainingMemoryView` shows
them as a table (HTML in a notebook, text elsewhere).
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from nbaccel.values.byte_text import human_bytes

__all__ = ["RankTrainingMemory", "TrainingMemoryView", "gather_training_memory", "training_memory"]


@dataclass
class RankTrainingMemory:
    """Bytes of training state one rank holds (``stage``: the ZeRO stage, None without ZeRO)."""

    rank: int
    stage: int | None
    parameters: int
    gradients: int
    optimizer_states: int
    offload: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, depth + 1)
    elif depth < 4 and isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item, depth + 1)


class _Ledger:
    """Storages already counted, so each is counted once, in the first category that holds it."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def count(self, tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(key)
            total += storage.nbytes()
        return total


def _engine(model: Any) -> Any:
    inner = getattr(model, "_orig_mod", model)
    return inner if type(inner).__name__ == "DeepSpeedEngine" else None


def _torch_optimizer(optimizer: Any) -> Any:
    """The innermost torch optimizer (the one holding exp_avg & co.) under the wrappers."""
    seen = 0
    while hasattr(optimizer, "optimizer") and seen < 4:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


def training_memory(model: nn.Module, optimizer: Any = None, rank: int = 0) -> RankTrainingMemory:
    """The parameter, gradient and optimizer-state bytes this rank holds for a prepared
    ``model`` (a DeepSpeed engine, a DDP/FSDP model, a plain module) and its ``optimizer``."""
    engine = _engine(model)
    module = engine.module if engine is not None else model
    ledger = _Ledger()
    params = list(module.parameters())
    local = [getattr(p, "ds_tensor", None) for p in params]
    parameters = ledger.count([p.data for p in params] + [t for t in local if t is not None])
    zero = engine.optimizer if engine is not None else None
    inner = _torch_optimizer(optimizer if optimizer is not None else zero)
    optimizer_states = 0
    if inner is not None and hasattr(inner, "param_groups"):
        masters = [p for group in inner.param_groups for p in group["params"]]
        optimizer_states = ledger.count(masters) + ledger.count(_tensors(dict(inner.state)))
    grads = [p.grad for p in params if p.grad is not None]
    if inner is not None and hasattr(inner, "param_groups"):
        grads += [p.grad for g in inner.param_groups for p in g["params"] if p.grad is not None]
    if zero is not None:
        for name, value in vars(zero).items():
            if "grad" in name.lower():
                grads += list(_tensors(value))
    gradients = ledger.count(grads)
    stage, offload = None, {}
    if engine is not None:
        stage = int(engine.zero_optimization_stage())
        config = engine.config if isinstance(engine.config, dict) else {}
        zero_config = config.get("zero_optimization", {})
        for part, label in (("offload_optimizer", "optimizer_states"),
                            ("offload_param", "parameters")):  # fmt: skip
            device = str((zero_config.get(part) or {}).get("device", "none"))
            if device != "none":
                offload[label] = device
    return RankTrainingMemory(rank, stage, parameters, gradients, optimizer_states, offload)


def gather_training_memory(model: nn.Module, optimizer: Any = None) -> TrainingMemoryView:
    """Every rank's :func:`training_memory` (a collective: call it on every rank)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = training_memory(model, optimizer, rank)
    if not dist.is_initialized():
        return TrainingMemoryView([mine])
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, asdict(mine))
    return TrainingMemoryView([RankTrainingMemory(**row) for row in rows])


class TrainingMemoryView:
    """Per-rank training-state bytes as a table (``_repr_html_`` in a notebook)."""

    _COLUMNS = ("parameters", "gradients", "optimizer_states", "total")

    def __init__(self, rows: list[RankTrainingMemory]) -> None:
        self.rows = rows

    def __getitem__(self, rank: int) -> RankTrainingMemory:
        return self.rows[rank]

    def __len__(self) -> int:
        return len(self.rows)

    def _cells(self, row: RankTrainingMemory) -> list[str]:
        stage = "no ZeRO" if row.stage is None else f"ZeRO-{row.stage}"
        where = ", ".join(f"{k} on {v}" for k, v in row.offload.items()) or "-"
        sizes = [human_bytes(getattr(row, c)) for c in self._COLUMNS]
        return [str(row.rank), stage, *sizes, where]

    def _header(self) -> list[str]:
        return ["rank", "stage", "parameters", "gradients", "optimizer state", "total", "offload"]

    def __repr__(self) -> str:
        lines = [self._header(), *(self._cells(r) for r in self.rows)]
        widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines
        )

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self._header())
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in self._cells(r)) + "</tr>"
            for r in self.rows
        )
        return f"<table class='nbaccel-training-memory'><tr>{head}</tr>{body}</table>"
