"""Single weights on disk and state dicts of (partly) offloaded models.

- :func:`offload_weight` / :func:`load_offloaded_weight`: one tensor as a raw ``{name}.dat``
  memory-mappable file plus its index entry (dtype, shape) -- the per-weight format Accelerate
  writes, which :class:`~nbaccel.bigmodel.offload.OffloadedWeightsLoader` reads as well.
- :func:`load_state_dict`: a safetensors or torch checkpoint file into a dict, each tensor on the
  device a ``device_map`` gives it.
- :func:`get_state_dict_offloaded_model`: the full CPU state dict of a model whose weights sit
  on meta behind offload hooks (each module's weights are loaded in turn, then released).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from nbaccel.bigmodel.hooks.align_devices import (
    align_module_device,
    get_state_dict_offloaded_model,
    has_offloaded_params,
)

__all__ = [
    "extract_submodules_state_dict",
    "get_state_dict_from_offload",
    "get_state_dict_offloaded_model",
    "load_offloaded_weight",
    "load_state_dict",
    "offload_weight",
]


# dtypes numpy cannot hold, stored as integer words of the same width.
_RAW_WORDS = {
    name: torch.int8 if "float8" in name else torch.int16
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
}


def offload_weight(
    weight: torch.Tensor,
    weight_name: str,
    offload_folder: str | os.PathLike,
    index: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``weight`` to ``{offload_folder}/{weight_name}.dat``; record dtype and shape in
    ``index`` (a new dict when None), which is returned."""
    dtype = None
    raw = _RAW_WORDS.get(str(weight.dtype).replace("torch.", ""))
    if raw is not None:  # numpy has no bfloat16/float8: store the raw words, keep the name
        dtype = str(weight.dtype).replace("torch.", "")
        weight = weight.detach().cpu().contiguous().view(raw)
    array = weight.detach().cpu().contiguous().numpy()
    os.makedirs(offload_folder, exist_ok=True)
    path = os.path.join(offload_folder, f"{weight_name}.dat")
    if index is not None:
        index[weight_name] = {"dtype": dtype or str(array.dtype), "shape": list(array.shape)}
    if array.ndim == 0:
        array = array[None]
    mapped = np.memmap(path, dtype=array.dtype, mode="w+", shape=array.shape)
    mapped[:] = array[:]
    mapped.flush()
    return index if index is not None else {}


def load_offloaded_weight(
    weight_file: str | os.PathLike, weight_info: Mapping[str, Any]
) -> torch.Tensor:
    """Read back a tensor written by :func:`offload_weight` (``weight_info`` = its index entry)."""
    shape = tuple(weight_info["shape"])
    dtype = weight_info["dtype"]
    raw = _RAW_WORDS.get(dtype)
    stored = str(raw).replace("torch.", "") if raw is not None else dtype
    array = np.memmap(weight_file, dtype=stored, shape=shape or (1,), mode="r")
    if not shape:
        array = array[0]
    tensor = torch.tensor(np.asarray(array))
    return tensor.view(getattr(torch, dtype)) if raw is not None else tensor


def extract_submodules_state_dict(
    state_dict: Mapping[str, torch.Tensor], submodule_names: list[str]
) -> dict[str, torch.Tensor]:
    """The entries of ``state_dict`` that belong to one of ``submodule_names`` (the name itself
    or anything under ``name.``)."""
    out = {}
    for name in submodule_names:
        out.update({k: v for k, v in state_dict.items() if k == name or k.startswith(name + ".")})
    return out


def load_state_dict(
    checkpoint_file: str | os.PathLike, device_map: Mapping[str, Any] | None = None
):
    """Read a ``.safetensors`` or torch checkpoint file. With a ``device_map`` (safetensors
    only), each tensor is loaded straight onto the device of its module; "disk" entries stay on
    CPU for the caller to offload."""
    path = str(checkpoint_file)
    if not path.endswith(".safetensors"):
        return torch.load(path, map_location="cpu", weights_only=True)
    from safetensors import safe_open
    from safetensors.torch import load_file

    if device_map is None:
        return load_file(path)
    from nbaccel.bigmodel.planning.device_map import _lookup

    out: dict[str, torch.Tensor] = {}
    with safe_open(path, framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
            try:
                device = _lookup(key, device_map)
            except KeyError:
                device = "cpu"
            device = "cpu" if device in (None, "disk") else device
            out[key] = f.get_tensor(key).to(
                device if not isinstance(device, int) else f"cuda:{device}"
            )
    return out


def get_state_dict_from_offload(
    module: nn.Module,
    module_name: str,
    state_dict: dict[str, Any],
    device_to_put_offload: int | str | torch.device = "cpu",
) -> dict[str, Any]:
    """Fill ``state_dict``'s entries for ``module`` (whose tensor ``module_name`` names, e.g.
    ``"layer.weight"``) with its real weights, loading them if it is offloaded."""
    root = module_name.rpartition(".")[0]
    device = device_to_put_offload if has_offloaded_params(module) else None
    with align_module_device(module, device):
        for key, value in module.state_dict().items():
            full = f"{root}.{key}" if root else key
            if full in state_dict:
                state_dict[full] = value
    return state_dict
