"""Quantized big-model loading: bitsandbytes 8-bit / 4-bit and torchao weight-only int8 / int4,
on the CPU and GPUs, with 8-bit cpu/disk offload (Accelerate's ``load_and_quantize_model`` API).

Importing this package imports neither bitsandbytes nor torchao: they are imported when a model
is quantized.
"""

from nbaccel.bigmodel.quantization.bnb_layers import (
    get_keys_to_not_convert,
    replace_with_bnb_layers,
)
from nbaccel.bigmodel.quantization.config import BnbQuantizationConfig, TorchAoConfig
from nbaccel.bigmodel.quantization.load_quantized import load_and_quantize_model
from nbaccel.bigmodel.quantization.quantized_device_map import get_quantized_model_device_map
from nbaccel.bigmodel.quantization.quantized_offload import quantize_and_offload_8bit

__all__ = [
    "BnbQuantizationConfig",
    "TorchAoConfig",
    "get_keys_to_not_convert",
    "get_quantized_model_device_map",
    "load_and_quantize_model",
    "quantize_and_offload_8bit",
    "replace_with_bnb_layers",
]
