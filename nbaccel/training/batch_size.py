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


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[int], int] | None = None,
) -> Callable[..., Any]:
    """Decorator: call ``function(batch_size, ...)``, halving ``batch_size`` on out-of-memory.

    The decorated function takes the batch size as its first parameter, but callers do not
    pass it. Build models, optimizers and dataloaders inside the function, so that a retry
    starts from fresh (freed) objects.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    reduce = reduce_batch_size_fn or (lambda size: size // 2)

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        batch_size = starting_batch_size
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            passed = ", ".join(f"{p}={a!r}" for p, a in zip(params[1:], args))
            raise TypeError(
                f"Batch size was passed into `{function.__name__}` as the first argument when "
                f"called. Remove it: call `{function.__name__}({passed})`."
            )
        while True:
            if batch_size <= 0:
                raise RuntimeError("No executable batch size found: reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not should_reduce_batch_size(exc):
                    raise
                _empty_device_caches()
                batch_size = reduce(batch_size)

    return decorator
