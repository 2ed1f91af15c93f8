"""Quantized parameters that travel to ranks as what they are: bitsandbytes' ``Params4bit`` /
``Int8Params`` are pickled as their class, their stored (already quantized) data and their
attributes (quantization state, row scales), so a rank rebuilds the same layer from the same
bytes instead of re-quantizing. torch pickles a ``Parameter`` subclass as a plain ``Parameter``;
these reducers, registered with ``copyreg`` when bitsandbytes layers are made, replace that for
the two classes. The data is a plain tensor inside: nbaccel's launch transport puts it in shared
memory, so every rank maps one copy."""

from __future__ import annotations

import copyreg
from typing import Any

import torch

__all__ = ["register_quantized_pickling"]


def _rebuild(cls: type, data: torch.Tensor, requires_grad: bool, state: dict) -> Any:
    param = torch.Tensor._make_subclass(cls, data, requires_grad)
    param.__dict__.update(state)
    return param


def _reduce(param: Any) -> tuple[Any, tuple]:
    state = dict(param.__dict__)
    return _rebuild, (type(param), param.data, param.requires_grad, state)


def register_quantized_pickling(bnb: Any) -> None:
    """Register the reducers for bitsandbytes' quantized parameter classes (once)."""
    for cls in (bnb.nn.Params4bit, bnb.nn.Int8Params):
        if copyreg.dispatch_table.get(cls) is not _reduce:
            copyreg.pickle(cls, _reduce)
