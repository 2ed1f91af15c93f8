"""Out-of-memory handling: retry with smaller batches, release what a training run held."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["find_executable_batch_size", "release_memory", "should_reduce_batch_size"]

_OOM_MESSAGES = (
    "out of memory",
    "CUDA out of memory.",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "XPU out of memory.",
)


def _empty_device_caches() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.empty_cache()
    if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        torch.mps.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Drop references to ``objects`` and empty device caches: ``a, b = release_memory(a, b)``."""
    objects = list(objects)
    for i in range(len(objects)):
        objects[i] = None
    _empty_device_caches()
    return objects


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` is an out-of-memory error that a smaller batch may avoid."""
    if isinstance(exception, torch.OutOfMemoryError | MemoryError):
        return True
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        return any(msg in str(exception.args[0]) for msg in _OOM_MESSAGES)
    return False


def _reducer(custom: Callable[..., int] | None) -> Callable[[int], int]:
    """The shrinking rule: 90% of the size (Accelerate's), or the user's. Accelerate's custom
    rules take no argument (they keep their own state); one taking the size is accepted too."""
    if custom is None:
        return lambda size: int(size * 0.9)
    try:
        takes_size = bool(inspect.signature(custom).parameters)
    except (TypeError, ValueError):
        takes_size = True
    return custom if takes_size else (lambda _size: custom())


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[..., int] | None = None,
) -> Callable[..., Any]:
    """Decorator: call ``function(batch_size, ...)``, shrinking ``batch_size`` to 90% on
    out-of-memory (128, 115, 103, ...) until it runs, as Accelerate does.

    The decorated function takes the batch size as its first parameter, but callers do not
    pass it. Build models, optimizers and dataloaders inside the function, so that a retry
    starts from fresh (freed) objects. Later calls start from the last size tried.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    reduce = _reducer(reduce_batch_size_fn)
    batch_size = starting_batch_size

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            passed = ", ".join(f"{p}={a!r}" for p, a in zip(params[1:], args))
            raise TypeError(
                f"Batch size was passed into `{function.__name__}` as the first argument when "
                f"called. Remove it: call `{function.__name__}({passed})`."
            )
        _empty_device_caches()
        while True:
            if batch_size <= 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not should_reduce_batch_size(exc):
                    raise
                _empty_device_caches()
                batch_size = reduce(batch_size)

    return decorator
