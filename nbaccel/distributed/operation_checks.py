"""Collective helpers beyond the basic set: shape checks in debug mode, sending a tensor that
exists on one rank only, waiting for every rank.

``verify_operation`` wraps a collective so that, when ``PartialState().debug`` is on (or
``ACCELERATE_DEBUG_MODE``/``NBACCEL_DEBUG_MODE`` is set), ranks first compare the shapes they
hold and a mismatch raises :class:`DistributedOperationException` listing every rank's shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from nbaccel.distributed.collectives import (
    CannotPadNestedTensorWarning,
    DistributedOperationException,
    gather_object,
    recursively_apply,
    reduce,
)
from nbaccel.distributed.state import DistributedType, PartialState
from nbaccel.distributed.structures import (
    TENSOR_INT_TO_DTYPE,
    TENSOR_TYPE_TO_INT,
    get_shape,
)

__all__ = [
    "TORCH_DISTRIBUTED_OPERATION_TYPES",
    "CannotPadNestedTensorWarning",
    "DistributedOperationException",
    "chained_operation",
    "copy_tensor_to_devices",
    "gather_tensor_shape",
    "verify_operation",
    "wait_for_everyone",
]

# Distributed types whose collectives go through torch.distributed (XLA has its own path).
TORCH_DISTRIBUTED_OPERATION_TYPES = [
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.FSDP,
]
_MAX_DIMS = 64


def _debug_on(state: PartialState) -> bool:
    from nbaccel.distributed.environment_patch import parse_flag_from_env

    return bool(getattr(state, "debug", False)) or any(
        parse_flag_from_env(v) for v in ("NBACCEL_DEBUG_MODE", "ACCELERATE_DEBUG_MODE")
    )


def verify_operation(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a collective: in debug mode, check devices and shapes on every rank first."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        state = PartialState()
        if state.distributed_type == DistributedType.NO or not _debug_on(state):
            return function(*args, **kwargs)
        operation = f"{function.__module__}.{function.__name__}"
        tensor = kwargs["tensor"] if "tensor" in kwargs else args[0]
        devices: list[torch.device] = []
        recursively_apply(lambda t: devices.append(t.device), tensor)
        found = devices[0] if devices else None
        if found is not None and found.type != state.device.type:
            raise DistributedOperationException(
                f"A tensor passed to {operation} is on {found.type} but this run uses "
                f"{state.device.type}: move it with .to(accelerator.device) first."
            )
        shapes = gather_object([get_shape(tensor)])
        if shapes.count(shapes[0]) != len(shapes):
            listing = "\n  - ".join(f"Process {i}: {s}" for i, s in enumerate(shapes))
            raise DistributedOperationException(
                "Cannot apply the operation: the shapes differ across processes.\n\n"
                f"Operation: `{operation}`\nInput shapes:\n  - {listing}"
            )
        return function(*args, **kwargs)

    return wrapper


def chained_operation(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an operation built on a verified collective: re-raise a shape failure naming it."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except DistributedOperationException as exc:
            operation = f"{function.__module__}.{function.__name__}"
            raise DistributedOperationException(
                f"Error found while calling `{operation}`. Please see the earlier error for more "
                "details."
            ) from exc

    return wrapper


def gather_tensor_shape(tensor: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Shape and dtype code of a tensor that exists on exactly one rank (None elsewhere)."""
    state = PartialState()
    code = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=state.device)
    if tensor is not None:
        values = [*tensor.shape, TENSOR_TYPE_TO_INT[tensor.dtype]]
        code[: len(values)] = torch.tensor(values, dtype=torch.int64)
    code = reduce(code, reduction="sum")
    code = code[code.nonzero()].flatten()
    return code[:-1], int(code[-1])


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Send a tensor that only one rank has (the others pass None) to every rank; unlike
    ``broadcast``, the receivers need not know its shape."""
    state = PartialState()
    shape, dtype_code = gather_tensor_shape(tensor)
    if tensor is None:
        tensor = torch.zeros(shape.tolist(), dtype=TENSOR_INT_TO_DTYPE[dtype_code]).to(state.device)
    return reduce(tensor, reduction="sum")


def wait_for_everyone() -> None:
    """Barrier: every rank waits here until all have arrived (no-op on one process)."""
    PartialState().wait_for_everyone()
