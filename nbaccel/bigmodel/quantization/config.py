"""What to quantize to: ``BnbQuantizationConfig`` (bitsandbytes, Accelerate's fields and rules)
and ``TorchAoConfig`` (torchao weight-only int8/int4).

Plain dataclasses, checked when built, so a wrong option is refused before any weight is read;
neither imports its backend (that happens only when a model is quantized).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BnbQuantizationConfig", "TorchAoConfig", "QuantizedDtype"]

_FLOAT_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_FLOAT_NAMES.update({str(d).replace("torch.", ""): d for d in list(_FLOAT_NAMES.values())})


class QuantizedDtype:
    """The quantized formats a config targets: ``int8``, ``int4`` (half a byte a weight)."""

    INT8 = torch.int8
    INT4 = "int4"


def _float_dtype(value: Any, what: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.replace("torch.", "") in _FLOAT_NAMES:
        return _FLOAT_NAMES[value.replace("torch.", "")]
    raise ValueError(
        f"{what} must be a torch.dtype or one of 'fp32', 'fp16', 'bf16', not {value!r}."
    )


def _names(value: Any, what: str) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a list of module names (strings), not {value!r}.")
    return value


@dataclass
class BnbQuantizationConfig:
    """How ``load_and_quantize_model`` quantizes with bitsandbytes (Accelerate's options).

    Exactly one of ``load_in_8bit`` (LLM.int8, outliers above ``llm_int8_threshold`` kept in
    fp16) and ``load_in_4bit`` (``bnb_4bit_quant_type`` ``"nf4"`` or ``"fp4"``, computed in
    ``bnb_4bit_compute_dtype``, ``bnb_4bit_use_double_quant`` quantizing the scales too).
    ``torch_dtype`` is the dtype of the layers left unquantized (default: fp16 for 8-bit, the
    compute dtype for 4-bit); ``skip_modules`` are not quantized (kept in ``torch_dtype``;
    default: the output head and tied weights), ``keep_in_fp32_modules`` are kept in float32.
    """

    load_in_8bit: bool = False
    llm_int8_threshold: float = 6.0
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "fp4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_compute_dtype: Any = "fp16"
    torch_dtype: Any = None
    skip_modules: list[str] | None = None
    keep_in_fp32_modules: list[str] | None = None
    target_dtype: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("load_in_8bit", "load_in_4bit", "bnb_4bit_use_double_quant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, not {getattr(self, name)!r}.")
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError(
                "load_in_8bit and load_in_4bit are both True: choose one (8-bit keeps more "
                "accuracy, 4-bit uses half the memory)."
            )
        if not (self.load_in_8bit or self.load_in_4bit):
            raise ValueError(
                "Neither load_in_8bit nor load_in_4bit is True: set one of them "
                "(BnbQuantizationConfig(load_in_8bit=True) or load_in_4bit=True)."
            )
        if isinstance(self.llm_int8_threshold, bool) or not isinstance(
            self.llm_int8_threshold, int | float
        ):
            raise ValueError(
                f"llm_int8_threshold must be a number, not {self.llm_int8_threshold!r}."
            )
        if self.bnb_4bit_quant_type not in ("fp4", "nf4"):
            raise ValueError(
                f"Unknown bnb_4bit_quant_type {self.bnb_4bit_quant_type!r}: use 'nf4' (normal "
                "float, best for weights drawn from a normal distribution) or 'fp4'."
            )
        self.bnb_4bit_compute_dtype = _float_dtype(
            self.bnb_4bit_compute_dtype, "bnb_4bit_compute_dtype"
        )
        self.skip_modules = _names(self.skip_modules, "skip_modules")
        self.keep_in_fp32_modules = _names(self.keep_in_fp32_modules, "keep_in_fp32_modules")
        if self.load_in_4bit and self.llm_int8_threshold != 6.0:
            warnings.warn("llm_int8_threshold only applies to 8-bit loading.", stacklevel=3)
        if self.torch_dtype is None:
            self.torch_dtype = torch.float16 if self.load_in_8bit else self.bnb_4bit_compute_dtype
        self.torch_dtype = _float_dtype(self.torch_dtype, "torch_dtype")
        self.target_dtype = QuantizedDtype.INT8 if self.load_in_8bit else QuantizedDtype.INT4

    @property
    def backend(self) -> str:
        return "bitsandbytes"

    @property
    def bits(self) -> int:
        return 8 if self.load_in_8bit else 4


_AO_TYPES = ("int8_weight_only", "int4_weight_only")
_AO_ALIASES = {"int8": "int8_weight_only", "int4": "int4_weight_only"}


@dataclass
class TorchAoConfig:
    """Weight-only quantization with torchao, for ``load_and_quantize_model``.

    ``quant_type`` is ``"int8_weight_only"`` (per-channel int8) or ``"int4_weight_only"``
    (grouped int4, ``group_size`` weights per scale; torchao needs the ``mslk`` package for it on
    the CPU); ``"int8"`` / ``"int4"`` are accepted. ``torch_dtype``: the dtype of the layers
    left unquantized and of the compute; ``skip_modules`` / ``keep_in_fp32_modules`` as in
    :class:`BnbQuantizationConfig`.
    """

    quant_type: str = "int8_weight_only"
    group_size: int = 128
    torch_dtype: Any = torch.float32
    skip_modules: list[str] | None = None
    keep_in_fp32_modules: list[str] | None = None
    target_dtype: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.quant_type = _AO_ALIASES.get(self.quant_type, self.quant_type)
        if self.quant_type not in _AO_TYPES:
            raise ValueError(
                f"Unknown torchao quant_type {self.quant_type!r}: use one of "
                f"{', '.join(_AO_TYPES)}."
            )
        if not isinstance(self.group_size, int) or self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"group_size must be 32, 64, 128 or 256, not {self.group_size!r}.")
        self.torch_dtype = _float_dtype(self.torch_dtype, "torch_dtype")
        self.skip_modules = _names(self.skip_modules, "skip_modules")
        self.keep_in_fp32_modules = _names(self.keep_in_fp32_modules, "keep_in_fp32_modules")
        self.target_dtype = QuantizedDtype.INT8 if self.bits == 8 else QuantizedDtype.INT4

    @property
    def backend(self) -> str:
        return "torchao"

    @property
    def bits(self) -> int:
        return 8 if self.quant_type == "int8_weight_only" else 4
