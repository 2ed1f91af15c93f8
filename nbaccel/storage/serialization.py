"""Saving and loading one object the way a distributed script wants: written by one process
only, safetensors when asked, and ``torch.load`` with ``weights_only`` (numpy arrays and dtypes
allowed) by default so loading a checkpoint does not run arbitrary pickled code."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from nbaccel.distributed.state import PartialState
from nbaccel.storage.weights import drop_tied_aliases

__all__ = [
    "TORCH_SAFE_GLOBALS",
    "clean_state_dict_for_safetensors",
    "id_tensor_storage",
    "load",
    "save",
]


def _safe_globals() -> list[Any]:
    try:
        import numpy as np
    except ImportError:
        return []
    found: list[Any] = [np.ndarray, np.dtype]
    for owner, name in ((np, "_core"), (np, "core")):
        core = getattr(owner, name, None)
        reconstruct = getattr(getattr(core, "multiarray", None), "_reconstruct", None)
        if reconstruct is not None:
            found.append(reconstruct)
            break
    from numpy.dtypes import UInt32DType  # numpy >= 1.25: what RNG states pickle to

    found.append(UInt32DType)
    import codecs

    found.append(codecs.encode)  # numpy pickles bytes through codecs.encode
    return found


TORCH_SAFE_GLOBALS: list[Any] = _safe_globals()


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """``(device, storage pointer, storage size)``: equal for tensors sharing memory."""
    storage = tensor.untyped_storage()
    return tensor.device, storage.data_ptr(), storage.nbytes()


def clean_state_dict_for_safetensors(state_dict: dict) -> dict:
    """A state dict safetensors accepts: one entry per shared tensor (tied aliases dropped, with
    one logged warning naming them) and every tensor contiguous."""
    kept, aliases = drop_tied_aliases(state_dict)
    if aliases:
        logging.getLogger(__name__).warning(
            f"Removed shared tensors {sorted(aliases)} while saving (they share memory with "
            f"{sorted(set(aliases.values()))}); re-tie them after loading, e.g. with "
            "model.tie_weights().",
        )
    return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kept.items()}


def save(
    obj: Any,
    f: str | os.PathLike,
    save_on_each_node: bool = False,
    safe_serialization: bool = False,
) -> None:
    """Write ``obj`` to ``f`` from the main process (of each node with ``save_on_each_node``).
    ``safe_serialization`` writes a safetensors file (``obj`` must be a dict of tensors)."""
    state = PartialState()
    writer = state.is_local_main_process if save_on_each_node else state.is_main_process
    if not writer:
        return
    if safe_serialization:
        from safetensors.torch import save_file

        save_file(clean_state_dict_for_safetensors(obj), f, metadata={"format": "pt"})
    else:
        torch.save(obj, f)


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only=True`` unless told otherwise; numpy arrays, dtypes and
    RNG states are allowed through. The global safe list is restored afterwards."""
    kwargs.setdefault("weights_only", True)
    previous = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(TORCH_SAFE_GLOBALS)
    try:
        return torch.load(f, map_location=map_location, **kwargs)
    finally:
        torch.serialization.clear_safe_globals()
        if previous:
            torch.serialization.add_safe_globals(previous)
