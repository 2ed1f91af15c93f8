"""bitsandbytes layers: which linears to quantize, swapping them for ``Linear8bitLt`` /
``Linear4bit``, and turning one float weight into the quantized parameter of such a layer.

The swap happens on the ``meta`` device (no memory), the quantization tensor by tensor while the
checkpoint is read. A weight is quantized exactly as bitsandbytes does when a float parameter
reaches a device (``Int8Params`` / ``Params4bit`` ``.to(device)``), which is also what
transformers' ``BitsAndBytesConfig`` path does, so both give the same bits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nbaccel.bigmodel.ties import find_tied_parameters

__all__ = [
    "get_keys_to_not_convert",
    "is_quantized_layer",
    "matches_module",
    "quantize_weight",
    "replace_with_bnb_layers",
]


def matches_module(name: str, keys: list[str]) -> bool:
    """Whether module ``name`` is one of ``keys`` or lies under one (``"lm_head"`` matches
    ``lm_head`` and ``model.lm_head``; ``"layers.0"`` matches ``model.layers.0.mlp``)."""
    dotted = f".{name}."
    return any(name == k or name.startswith(k + ".") or f".{k}." in dotted for k in keys)


def get_keys_to_not_convert(model: nn.Module) -> list[str]:
    """Modules to leave unquantized: those whose weights are tied (an input embedding shared with
    the output head stays one float tensor) and the output head (the last module holding
    parameters), which carries most of the accuracy. A base model without a head keeps
    only its tied modules."""
    tied = sorted({n for group in find_tied_parameters(model) for n in group})
    prefix = getattr(model, "base_model_prefix", None)
    is_base_model = bool(prefix) and not hasattr(model, prefix)
    keys = list(tied)
    if not is_base_model:
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        if names and names[-1] not in keys:
            keys.append(names[-1])
    modules = []
    for key in keys:
        owner = key.rpartition(".")[0] if key.endswith((".weight", ".bias")) else key
        if owner and owner not in modules:
            modules.append(owner)
    return modules


def _bnb() -> Any:
    import bitsandbytes as bnb

    from nbaccel.bigmodel.quantization.shipping import register_quantized_pickling

    register_quantized_pickling(bnb)  # quantized weights travel to ranks as they are
    return bnb


def replace_with_bnb_layers(
    model: nn.Module,
    bnb_quantization_config: Any,
    modules_to_not_convert: list[str] | None = None,
    current_key_name: list[str] | None = None,
) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (except ``modules_to_not_convert``) for a
    bitsandbytes layer built on ``meta``: ``Linear8bitLt`` (8-bit) or ``Linear4bit`` (4-bit).
    Returns ``model``; its swapped layers hold no data until their weights are loaded."""
    bnb = _bnb()
    config = bnb_quantization_config
    skip = list(modules_to_not_convert or [])
    prefix = ".".join(current_key_name or [])
    replaced = 0
    for name, module in list(model.named_modules()):
        full = f"{prefix}.{name}" if prefix and name else (name or prefix)
        if not isinstance(module, nn.Linear) or is_quantized_layer(module) or not name:
            continue
        if matches_module(full, skip):
            continue
        with torch.device("meta"):
            if config.load_in_8bit:
                new = bnb.nn.Linear8bitLt(
                    module.in_features,
                    module.out_features,
                    module.bias is not None,
                    has_fp16_weights=False,
                    threshold=float(config.llm_int8_threshold),
                )
            else:
                new = bnb.nn.Linear4bit(
                    module.in_features,
                    module.out_features,
                    module.bias is not None,
                    config.bnb_4bit_compute_dtype,
                    compress_statistics=config.bnb_4bit_use_double_quant,
                    quant_type=config.bnb_4bit_quant_type,
                    quant_storage=torch.uint8,
                )
        new.requires_grad_(False)
        new.train(module.training)  # bitsandbytes picks its matmul by training mode
        new.source_cls = type(module)
        model.set_submodule(name, new)
        replaced += 1
    if replaced == 0:
        import warnings

        warnings.warn(
            f"No nn.Linear of {type(model).__name__} was quantized (skipped: {skip}); the model "
            "keeps its float weights.",
            stacklevel=2,
        )
    return model


def is_quantized_layer(module: nn.Module) -> bool:
    """True for bitsandbytes' 8-bit and 4-bit linear layers."""
    return type(module).__name__ in ("Linear8bitLt", "Linear4bit") and type(
        module
    ).__module__.startswith("bitsandbytes")


def quantize_weight(module: nn.Module, value: torch.Tensor, device: torch.device) -> nn.Parameter:
    """The quantized weight of the bitsandbytes layer ``module`` from the float tensor ``value``,
    on ``device`` (quantized there, as bitsandbytes does when a float weight reaches a device)."""
    bnb = _bnb()
    if type(module).__name__ == "Linear8bitLt":
        if value.device != device:
            value = value.to("cpu")  # bitsandbytes quantizes what comes from the CPU
        param = bnb.nn.Int8Params(value, requires_grad=False, has_fp16_weights=False)
        # on its device already (streamed to a GPU, or the CPU): ``.to`` would not quantize a
        # tensor already on a GPU, so quantize it where it is, as ``.to`` does from the CPU
        return param._quantize(device) if value.device == device else param.to(device)
    old = module.weight
    param = bnb.nn.Params4bit(
        value,
        requires_grad=False,
        blocksize=old.blocksize,
        compress_statistics=old.compress_statistics,
        quant_type=old.quant_type,
        quant_storage=old.quant_storage,
        module=module,
    )
    return param.to(device)
