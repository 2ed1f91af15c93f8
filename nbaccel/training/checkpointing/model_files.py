"""A prepared model's weights, and any object, written to files atomically: what
``Accelerator.save_model`` and ``Accelerator.save`` do."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nbaccel.storage.weights import save_model_weights, write_safetensors

__all__ = ["save_model_files", "save_object"]


def save_model_files(
    model: torch.nn.Module,
    state_dict_of: Callable[[torch.nn.Module], dict[str, Any]],
    directory: str | os.PathLike,
    writer: bool,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> None:
    """Weights as shards + index, written by ``writer`` only (every process gathers:
    ``state_dict_of`` may be a collective). Weights a dispatched model keeps offloaded on
    cpu/disk are read back module by module."""
    from nbaccel.bigmodel.hooks.align_devices import (
        get_state_dict_offloaded_model,
        has_offloaded_params,
    )

    if any(has_offloaded_params(m) for m in model.modules()):
        state_dict = get_state_dict_offloaded_model(model)
    else:
        state_dict = state_dict_of(model)
    if writer:
        save_model_weights(state_dict, directory, max_shard_size, safe_serialization)


def save_object(obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
    """``torch.save`` (or safetensors) into a hidden sibling, then renamed into place."""
    f = Path(f)
    tmp = f.with_name(f".{f.name}.partial")
    if safe_serialization:
        write_safetensors(obj, tmp)
    else:
        torch.save(obj, tmp)
    os.replace(tmp, f)
