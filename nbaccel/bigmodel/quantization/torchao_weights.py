"""torchao weight-only quantization of one linear layer at a time (int8 per channel, int4 in
groups): the second backend of ``load_and_quantize_model``, for machines without bitsandbytes or
where torchao's kernels are the faster ones."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["linears_to_quantize", "quantize_linear_torchao"]


def linears_to_quantize(model: nn.Module, modules_to_not_convert: list[str]) -> set[str]:
    """Names of the ``nn.Linear`` layers torchao will quantize."""
    from nbaccel.bigmodel.quantization.bnb_layers import matches_module

    return {
        name
        for name, module in model.named_modules()
        if name
        and isinstance(module, nn.Linear)
        and not matches_module(name, modules_to_not_convert)
    }


def _torchao_config(config: Any) -> Any:
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    if config.bits == 8:
        return Int8WeightOnlyConfig()
    return Int4WeightOnlyConfig(group_size=config.group_size)


def quantize_linear_torchao(linear: nn.Linear, config: Any) -> None:
    """Quantize ``linear``'s weight in place with torchao (its weight must hold data)."""
    from torchao.quantization import quantize_

    wrapper = nn.Sequential(linear)  # quantize_ walks children: give it the layer as one
    quantize_(wrapper, _torchao_config(config))
    linear.weight.requires_grad_(False)
