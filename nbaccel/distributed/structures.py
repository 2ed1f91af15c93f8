"""Nested structures of tensors (lists, tuples, namedtuples, dicts): describe, rebuild, slice,
pad and convert them. The collectives in :mod:`nbaccel.distributed.collectives` walk the same
structures with ``recursively_apply``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from nbaccel.distributed.collectives import find_batch_size, recursively_apply

__all__ = [
    "TENSOR_INT_TO_DTYPE",
    "TENSOR_TYPE_TO_INT",
    "TensorInformation",
    "get_data_structure",
    "get_shape",
    "honor_type",
    "ignorant_find_batch_size",
    "initialize_tensors",
    "is_namedtuple",
    "is_tensor_information",
    "is_torch_tensor",
    "is_torch_xpu_tensor",
    "listify",
    "pad_input_tensors",
    "slice_tensors",
]

# dtype <-> small int, to send a dtype through an integer tensor.
TENSOR_TYPE_TO_INT: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
}
TENSOR_INT_TO_DTYPE: dict[int, torch.dtype] = {v: k for k, v in TENSOR_TYPE_TO_INT.items()}


@dataclass
class TensorInformation:
    """Shape and dtype of a tensor, enough to allocate its twin elsewhere."""

    shape: torch.Size
    dtype: torch.dtype


def is_torch_tensor(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor)


def is_torch_xpu_tensor(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "xpu"


def is_tensor_information(tensor_info: Any) -> bool:
    return isinstance(tensor_info, TensorInformation)


def is_namedtuple(data: Any) -> bool:
    """True for instances of ``collections.namedtuple`` / ``typing.NamedTuple`` classes."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Iterable[Any]) -> Any:
    """Build an object of ``obj``'s type (list, tuple, namedtuple) from ``generator``."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def get_data_structure(data: Any) -> Any:
    """``data`` with every tensor replaced by its :class:`TensorInformation`."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def get_shape(data: Any) -> Any:
    """``data`` with every tensor replaced by its shape as a list."""
    return recursively_apply(lambda t: list(t.shape), data)


def initialize_tensors(data_structure: Any) -> Any:
    """Allocate (uninitialised) tensors for a structure of :class:`TensorInformation`."""
    return recursively_apply(
        lambda info: torch.empty(*info.shape, dtype=info.dtype),
        data_structure,
        test_type=is_tensor_information,
    )


def ignorant_find_batch_size(data: Any) -> int | None:
    """``find_batch_size``, or None when ``data`` holds no batch."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def listify(data: Any) -> Any:
    """``data`` with every tensor converted to (nested) Python numbers (bf16 via float32)."""

    def to_list(tensor: torch.Tensor) -> Any:
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.to(torch.float32)
        return tensor.tolist()

    return recursively_apply(to_list, data)


def slice_tensors(
    data: Any, tensor_slice: Any, process_index: int | None = None, num_processes: int | None = None
) -> Any:
    """``data`` with ``tensor[tensor_slice]`` taken from every tensor."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Pad every tensor of ``tensor`` along dimension 0 with zero rows so that the batch
    (``batch_size`` rows) splits evenly over ``num_processes`` (the next multiple, and at least
    one row per process)."""
    target = max(num_processes, -(-batch_size // num_processes) * num_processes)

    def pad(t: torch.Tensor) -> torch.Tensor:
        shape = list(t.shape)
        shape[0] = target
        out = t.new_zeros(tuple(shape))
        index = tuple(slice(0, t.shape[dim]) if i == dim else slice(None) for i in range(t.ndim))
        out[index] = t
        return out

    return recursively_apply(pad, tensor, error_on_other_type=True)
