"""Collectives on nested structures of tensors (lists, tuples, namedtuples, dicts).

Every collective first compares the shapes every rank holds (one small object gather) and raises
a :class:`ShapeMismatchError` naming each rank's shapes, instead of hanging or crashing inside the
backend. On a single process they return their input unchanged. The tensors travel through the
run's :class:`~nbaccel.distributed.comm.Communicator` (``PartialState().communicator``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from nbaccel.distributed.state import PartialState

__all__ = [
    "DistributedOperationException",
    "ShapeMismatchError",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "find_batch_size",
    "gather",
    "gather_object",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "send_to_device",
]


class DistributedOperationException(Exception):
    """A collective was called with inputs that cannot work across the ranks (shapes, device)."""


class ShapeMismatchError(DistributedOperationException, RuntimeError):
    """Ranks entered a collective with tensors of different shapes or structures (Accelerate's
    debug-mode ``DistributedOperationException``, and a ``RuntimeError`` as before)."""


def _is_namedtuple(data: Any) -> bool:
    return isinstance(data, tuple) and hasattr(data, "_fields")


def _is_torch_tensor(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor)


_is_torch_tensor.__name__ = "is_torch_tensor"  # as error messages name it


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = _is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Apply ``func`` to every leaf of ``data`` that passes ``test_type``, keeping the structure."""
    options = {"test_type": test_type, "error_on_other_type": error_on_other_type}
    if _is_namedtuple(data):
        return type(data)(*(recursively_apply(func, d, *args, **options, **kwargs) for d in data))
    if isinstance(data, list | tuple):
        return type(data)(recursively_apply(func, d, *args, **options, **kwargs) for d in data)
    if isinstance(data, Mapping):
        return type(data)(
            {k: recursively_apply(func, v, *args, **options, **kwargs) for k, v in data.items()}
        )
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        # Accelerate's wording, which code written for it matches
        raise TypeError(
            f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', func)}`. "
            "Only nested list/tuple/dicts of objects that are valid for "
            f"`{getattr(test_type, '__name__', test_type)}` should be passed."
        )
    return data


def _leaves(data: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    recursively_apply(found.append, data)
    return found


def _state() -> PartialState:
    return PartialState()


_Signature = list[tuple[str, tuple[int, ...] | None, str]]


def _flatten(data: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every leaf of a nested structure with its path, e.g. ``['labels']`` or ``.logits[0]``."""
    if _is_namedtuple(data):
        return [item for f, d in zip(data._fields, data) for item in _flatten(d, f"{path}.{f}")]
    if isinstance(data, list | tuple):
        return [item for i, d in enumerate(data) for item in _flatten(d, f"{path}[{i}]")]
    if isinstance(data, Mapping):
        return [item for k, v in data.items() for item in _flatten(v, f"{path}[{k!r}]")]
    return [(path, data)]


def _signature(data: Any) -> _Signature:
    """(path, shape, dtype) of every tensor leaf; (path, None, type name) of any other leaf."""
    return [
        (path, tuple(leaf.shape), str(leaf.dtype))
        if isinstance(leaf, torch.Tensor)
        else (path, None, type(leaf).__name__)
        for path, leaf in _flatten(data)
    ]


def _describe(signature: _Signature) -> str:
    if not signature:
        return "no tensors"
    return ", ".join(
        " ".join(p for p in (path, "" if shape is None else str(list(shape)), kind) if p)
        for path, shape, kind in signature
    )


def _exchange_signatures(data: Any, operation: str, same_shapes: bool, hint: str = "") -> list:
    """Gather every rank's signature (one small object gather) and validate it on every rank.

    Raises ShapeMismatchError when ranks disagree on the structure, dtypes or (``same_shapes``)
    shapes, or only on the number of dimensions otherwise; TypeError for non-tensor leaves. Every
    rank sees the same signatures, so every rank raises the same error and none is left waiting.
    """
    mine = _signature(data)
    every = _state().communicator.exchange_objects(mine, "nbaccel.signatures")

    def key(sig: _Signature) -> list:
        if same_shapes:
            return sig
        return [(path, None if shape is None else len(shape), kind) for path, shape, kind in sig]

    if any(key(sig) != key(every[0]) for sig in every):
        detail = "; ".join(f"rank {rank}: {_describe(sig)}" for rank, sig in enumerate(every))
        if any([p for p, _, _ in sig] != [p for p, _, _ in every[0]] for sig in every):
            need, hint = "structure (nested lists, tuples, dicts of tensors)", ""
        elif any([k for _, _, k in sig] != [k for _, _, k in every[0]] for sig in every):
            need, hint = "dtypes", ""
        else:
            need = "tensor shapes" if same_shapes else "number of dimensions"
        raise ShapeMismatchError(
            f"{operation} needs the same {need} on every rank; {detail}.{hint}"
        )
    others = [f"{path or '<input>'} ({kind})" for path, shape, kind in mine if shape is None]
    if others:
        raise TypeError(
            f"{operation} only supports tensors inside nested lists, tuples and dicts; found "
            f"{', '.join(others)}. Use gather_object / broadcast_object_list for other objects."
        )
    return every


def _check_same_shapes(data: Any, operation: str, dims_must_match: bool = True) -> None:
    """Raise ShapeMismatchError (on every rank) when ranks disagree on shapes or structure."""
    hint = (
        " Use pad_across_processes (or gather_for_metrics) first when the first dimension differs."
        if dims_must_match
        else ""
    )
    _exchange_signatures(data, operation, same_shapes=True, hint=hint)


def gather(tensor: Any) -> Any:
    """Gather tensors (nested) from every process and concatenate them on the first dimension."""
    state = _state()
    if state.num_processes <= 1:
        return tensor
    comm = state.communicator
    if comm.checks_shapes:
        _check_same_shapes(tensor, "gather")
    return recursively_apply(comm.all_gather, tensor, error_on_other_type=comm.checks_shapes)


def gather_object(obj: Any) -> list[Any]:
    """Gather picklable objects from every process into one flat list (lists are concatenated)."""
    state = _state()
    if state.num_processes <= 1:
        return list(obj) if isinstance(obj, list | tuple) else [obj]
    every = state.communicator.exchange_objects(obj, "nbaccel.gather_object")
    if all(isinstance(o, list | tuple) for o in every):
        return [item for o in every for item in o]
    return every


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """All-reduce (nested) tensors across processes: ``mean`` (default), ``sum``, ``max``,
    ``min`` or ``none``.

    ``none`` returns a (scaled) copy of this process's tensors without communicating.
    """
    if reduction not in ("sum", "mean", "max", "min", "none"):
        raise ValueError(
            f"reduction must be 'mean', 'sum', 'max', 'min' or 'none', not {reduction!r}."
        )
    state = _state()
    communicate = reduction != "none" and state.num_processes > 1

    def _reduce_one(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if not communicate:
            return out * scale if scale != 1.0 else out
        op = "sum" if reduction == "mean" else reduction
        out = state.communicator.all_reduce(out, op)
        if reduction == "mean":
            out = out / state.num_processes
        return out * scale if scale != 1.0 else out

    if communicate and state.communicator.checks_shapes:
        _check_same_shapes(tensor, "reduce", dims_must_match=False)
    return recursively_apply(_reduce_one, tensor, error_on_other_type=True)


def _check_source(from_process: int, num_processes: int) -> None:
    if not 0 <= from_process < num_processes:
        raise ValueError(
            f"from_process={from_process} is not a process index (0..{num_processes - 1})."
        )


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Broadcast (nested) tensors from ``from_process`` to every process, in place."""
    state = _state()
    if state.num_processes <= 1:
        return tensor
    _check_source(from_process, state.num_processes)
    comm = state.communicator
    if comm.checks_shapes:
        _check_same_shapes(tensor, "broadcast", dims_must_match=False)
    return recursively_apply(comm.broadcast_, tensor, from_process, error_on_other_type=True)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Broadcast a list of picklable objects from ``from_process``; the list is filled in place."""
    state = _state()
    if state.num_processes > 1:
        _check_source(from_process, state.num_processes)
        state.communicator.broadcast_objects(object_list, from_process)
    return object_list


class CannotPadNestedTensorWarning(UserWarning):
    """``pad_across_processes`` met a nested tensor: it cannot be padded, it is returned as is."""


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    """Pad (nested) tensors on ``dim`` to the largest size any process holds.

    A ``torch.nested`` tensor cannot be padded: it is returned as it is, with a
    :class:`CannotPadNestedTensorWarning`."""
    if isinstance(tensor, torch.Tensor) and tensor.is_nested:
        warnings.warn(
            "pad_across_processes got a nested tensor, which cannot be padded: it is returned "
            "unchanged. Pad its components yourself (or convert it with to_padded_tensor).",
            CannotPadNestedTensorWarning,
            stacklevel=2,
        )
        return tensor
    state = _state()
    if state.num_processes <= 1 or not state.communicator.checks_shapes:
        return tensor

    every = _exchange_signatures(tensor, "pad_across_processes", same_shapes=False)
    longest = {
        path: max(sig[i][1][dim] for sig in every)
        for i, (path, shape, _) in enumerate(every[0])
        if shape and -len(shape) <= dim < len(shape)
    }

    def _pad_one(path: str, t: torch.Tensor) -> torch.Tensor:
        if path not in longest or longest[path] == t.shape[dim]:
            return t
        size, new_shape = t.shape[dim], list(t.shape)
        new_shape[dim] = longest[path]
        out = t.new_full(new_shape, pad_index)
        index = [slice(None)] * t.ndim
        index[dim] = slice(longest[path] - size, None) if pad_first else slice(0, size)
        out[tuple(index)] = t
        return out

    # _flatten and recursively_apply walk a structure in the same order.
    padded = iter([_pad_one(path, t) for path, t in _flatten(tensor)])
    return recursively_apply(lambda _: next(padded), tensor, error_on_other_type=True)


def send_to_device(
    tensor: Any,
    device: torch.device | str | int,
    non_blocking: bool = False,
    skip_keys: list[str] | str | None = None,
) -> Any:
    """Move (nested) tensors, and objects with a ``.to`` method, to ``device``."""
    if isinstance(skip_keys, str):
        skip_keys = [skip_keys]
    skip = set(skip_keys or ())
    if isinstance(tensor, Mapping) and not _is_namedtuple(tensor):
        return type(tensor)(
            {
                k: v if k in skip else send_to_device(v, device, non_blocking, skip_keys)
                for k, v in tensor.items()
            }
        )
    if _is_namedtuple(tensor):
        return type(tensor)(*(send_to_device(t, device, non_blocking, skip_keys) for t in tensor))
    if isinstance(tensor, list | tuple):
        return type(tensor)(send_to_device(t, device, non_blocking, skip_keys) for t in tensor)
    if isinstance(tensor, torch.Tensor) or hasattr(tensor, "to"):
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:
            return tensor.to(device)
    return tensor


def find_batch_size(data: Any) -> int | None:
    """The first dimension of the first tensor found in ``data`` (None when there is none)."""
    leaves = _leaves(data)
    for t in leaves:
        if t.ndim > 0:
            return t.shape[0]
    return None


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """Concatenate a list of same-structured (nested) tensors along ``dim``."""
    first = data[0]
    if _is_namedtuple(first):
        return type(first)(*(concatenate([d[i] for d in data], dim) for i in range(len(first))))
    if isinstance(first, list | tuple):
        return type(first)(concatenate([d[i] for d in data], dim) for i in range(len(first)))
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim) for k in first})
    if isinstance(first, torch.Tensor):
        return torch.cat(data, dim=dim)
    if len(data) == 1:  # a single batch is returned as it is, tensor or not
        return first
    raise TypeError(f"Can only concatenate tensors, got {type(first).__name__}.")
