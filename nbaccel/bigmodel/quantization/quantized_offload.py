"""8-bit weights offloaded to disk, quantized: the int8 weight and its row scales (``SCB``) are
written once, and the layer keeps a ``meta`` placeholder that turns whatever the offload hook
loads back into a ready ``Int8Params`` (int8 data + scales), so no forward re-quantizes.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from nbaccel.bigmodel.loading.weight_files import offload_weight
from nbaccel.bigmodel.quantization.bnb_layers import _bnb

__all__ = ["quantize_and_offload_8bit", "offloaded_int8_placeholder"]


def _scales_name(param_name: str) -> str:
    head, _, leaf = param_name.rpartition(".")
    return f"{head}.SCB" if head and leaf == "weight" else param_name + ".SCB"


def _rebind_int8(param: nn.Parameter) -> None:
    """Called on the Parameter the offload hook builds from the placeholder: the loaded int8
    data is the quantized weight, the placeholder's scales come along onto its device."""
    if param.dtype == torch.int8 and param.device.type != "meta":
        param.CB = param.data
        param.SCB = param.__dict__["_nbaccel_scb"].to(param.device)


def offloaded_int8_placeholder(shape: torch.Size, scales: torch.Tensor) -> nn.Parameter:
    """A ``meta`` ``Int8Params`` standing for an offloaded 8-bit weight with row ``scales``."""
    bnb = _bnb()
    placeholder = bnb.nn.Int8Params(
        torch.empty(shape, dtype=torch.int8, device="meta"),
        requires_grad=False,
        has_fp16_weights=False,
    )
    placeholder._nbaccel_scb = scales.detach().to("cpu")
    placeholder._nbaccel_rebind = _rebind_int8
    return placeholder


def quantize_and_offload_8bit(
    model: nn.Module,
    param: torch.Tensor,
    param_name: str,
    new_dtype: torch.dtype | None,
    offload_folder: str | os.PathLike,
    offload_index: dict[str, Any],
    fp16_statistics: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Write the 8-bit weight ``param_name`` of ``model`` to ``offload_folder`` and leave a
    ``meta`` placeholder in the model. ``param`` is the float weight (quantized here, on the
    CPU, cast to ``new_dtype`` first), or an int8 weight with its ``fp16_statistics`` (row
    scales). Both the weight and its ``.SCB`` scales are recorded in ``offload_index``, which is
    returned."""
    bnb = _bnb()
    if fp16_statistics is None:
        value = param.detach().to("cpu")
        if new_dtype is not None and value.is_floating_point():
            value = value.to(new_dtype)
        quantized = bnb.nn.Int8Params(value, requires_grad=False, has_fp16_weights=False)
        quantized = quantized.to("cpu")
        data, scales = quantized.data, quantized.SCB
    else:
        data, scales = param.detach().to("cpu"), fp16_statistics.detach().to("cpu")
    offload_weight(data, param_name, offload_folder, index=offload_index)
    offload_weight(scales, _scales_name(param_name), offload_folder, index=offload_index)
    owner_name, _, leaf = param_name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    owner._parameters[leaf] = offloaded_int8_placeholder(data.shape, scales)
    return offload_index
