"""A model skeleton without allocated weights: ``init_empty_weights`` and ``init_on_device``.

Parameters created inside the context land directly on the target device (``meta`` for an empty
skeleton), so a 100B-parameter model can be described in a few megabytes and its sizes planned
before a single weight is read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from nbaccel.values.booleans import env_flag

__all__ = ["init_empty_weights", "init_on_device"]

_INCLUDE_BUFFERS_ENV = "NBACCEL_INIT_INCLUDE_BUFFERS"


def _default_include_buffers() -> bool:
    return bool(env_flag(_INCLUDE_BUFFERS_ENV, default=False))


@contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Create every parameter on the ``meta`` device (no memory, no initialisation cost).

    Buffers stay real by default, because non-persistent buffers (rotary tables, position ids) are
    not in checkpoints and would otherwise be lost; pass ``include_buffers=True`` to put them on
    ``meta`` too.
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextmanager
def init_on_device(
    device: torch.device | str | int, include_buffers: bool | None = None
) -> Iterator[None]:
    """Create every parameter (and, with ``include_buffers``, every buffer) on ``device``."""
    if include_buffers is None:
        include_buffers = _default_include_buffers()
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if include_buffers:
        # The device context also catches tensors built by factory functions inside __init__.
        with device, _skip_meta_init() if device.type == "meta" else nullcontext():
            yield
        return

    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is None or param.device == device:
            return
        cls = type(param)
        extra = dict(param.__dict__)
        moved = param.to(device)
        try:
            new = cls(moved, requires_grad=param.requires_grad)
        except TypeError:
            new = nn.Parameter(moved, requires_grad=param.requires_grad)
        new.__dict__.update(extra)
        module._parameters[name] = new

    nn.Module.register_parameter = register_parameter
    try:
        with _skip_meta_init() if device.type == "meta" else nullcontext():
            yield
    finally:
        nn.Module.register_parameter = original


_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


@contextmanager
def _skip_meta_init() -> Iterator[None]:
    """``torch.nn.init`` on meta tensors computes nothing, yet its first call imports
    ``torch._dynamo`` (seconds): return meta tensors untouched instead."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS if hasattr(nn.init, name)}

    def wrap(fn):
        def init(tensor, *args, **kwargs):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
                return tensor
            return fn(tensor, *args, **kwargs)

        return init

    for name, fn in saved.items():
        setattr(nn.init, name, wrap(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
