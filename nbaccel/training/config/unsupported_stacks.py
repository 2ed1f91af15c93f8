"""Names of the stacks nbaccel does not drive, so code that mentions them still imports.

DeepSpeed Ulysses sequence parallelism and Megatron-LM: their classes exist (user code lists
them in ``isinstance`` checks and conditions), their probes say "not available", and
constructing or calling one raises ``NotImplementedError`` naming what nbaccel offers instead.
(FP8 training lives in :mod:`nbaccel.training.precision.fp8`, quantized loading in
:mod:`nbaccel.bigmodel.quantization`.)
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NoReturn

from torch import nn

__all__ = [
    "MODEL_CONFIGS_TO_MEGATRON_PARSERS",
    "FP8BackendType",
    "has_4bit_bnb_layers",
    "has_transformer_engine_layers",
]

_INSTEAD = {
    "DeepSpeed Ulysses": "train with DeepSpeed ZeRO (DeepSpeedPlugin) without sequence "
    "parallelism (sp_size=1): nbaccel does not shard the sequence",
    "Megatron-LM": "nbaccel trains with Accelerator(megatron_lm_plugin=MegatronLMPlugin("
    "tp_degree=..., pp_degree=..., num_micro_batches=...)) on torch's engines, with a torch "
    "optimizer and scheduler and the model's causal LM loss (no Megatron-LM install)",
    "FP8": "pass mixed_precision='fp8' (and AORecipeKwargs or TERecipeKwargs) to Accelerator",
    "torch-xla setup": "install torch-xla yourself; nbaccel detects it",
}


def _message(name: str, stack: str) -> str:
    if stack == "Megatron-LM":
        return f"{name} belongs to Megatron-LM's own engine, which nbaccel does not run: " + (
            _INSTEAD[stack] + "."
        )
    return f"{name} belongs to {stack}, which nbaccel does not support: {_INSTEAD[stack]}."


class UnsupportedStack:
    """Base of the placeholder classes: importable, usable in ``isinstance``, never built."""

    stack = "DeepSpeed Ulysses"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_message(type(self).__name__, self.stack))


def _placeholder_class(
    name: str, stack: str, bases: tuple[type, ...] = (UnsupportedStack,)
) -> type:
    cls = type(
        name, bases, {"stack": stack, "__doc__": _message(name, stack), "__module__": __name__}
    )
    __all__.append(name)
    return cls


def _placeholder_function(name: str, stack: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(_message(name, stack))

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = _message(name, stack)
    __all__.append(name)
    return refuse


_CLASSES = {
    "DeepSpeed Ulysses": "DeepSpeedSequenceParallelConfig",
    "Megatron-LM": "MegatronLMDummyDataLoader "
    "AbstractTrainStep "
    "BertTrainStep GPTTrainStep T5TrainStep MegatronEngine MegatronLMOptimizerWrapper "
    "MegatronLMSchedulerWrapper",
}
_FUNCTIONS = {
    "Megatron-LM": "add_model_config_to_megatron_parser avg_losses_across_data_parallel_group "
    "gather_across_data_parallel_groups finish_mpu_init initialize model_provider_func "
    "prepare_model_optimizer_scheduler prepare_optimizer prepare_scheduler prepare_data_loader "
    "parse_bert_config parse_gpt2_config parse_t5_config parse_llama_config parse_glm4_moe_config",
    "FP8": "setup_fp8_env",
    "torch-xla setup": "install_xla",
}

for _stack, _names in _CLASSES.items():
    for _name in _names.split():
        globals()[_name] = _placeholder_class(_name, _stack)
for _stack, _names in _FUNCTIONS.items():
    for _name in _names.split():
        # Megatron's prepare_data_loader would shadow nbaccel's real one: keep it namespaced.
        key = f"megatron_{_name}" if _name == "prepare_data_loader" else _name
        globals()[key] = _placeholder_function(_name, _stack)
        if key != _name:
            __all__[-1] = key

MODEL_CONFIGS_TO_MEGATRON_PARSERS: dict[str, Any] = {}


class FP8BackendType(str, Enum):
    """FP8 backends Accelerate knows (nbaccel trains with AO and TE; MS-AMP is refused)."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


def _has_layers_from(model: nn.Module, package: str) -> bool:
    return any(type(m).__module__.split(".")[0] == package for m in model.modules())


def has_transformer_engine_layers(model: nn.Module) -> bool:
    """True when a Transformer Engine layer is in ``model``."""
    return _has_layers_from(model, "transformer_engine")


def has_4bit_bnb_layers(model: nn.Module) -> bool:
    """True when a bitsandbytes 4-bit linear layer is in ``model``."""
    return any(type(m).__name__ == "Linear4bit" for m in model.modules())


def _refuse_recurrent_layers_under_sequence_parallelism(model: Any) -> None:
    """Sequence parallelism (DeepSpeed Ulysses) shards the sequence; a model whose config lists
    ``*linear_attention*`` layer types carries a recurrent state along it, so sharding would give
    silently wrong gradients: raise ValueError naming those layer types."""
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or []
    recurrent = sorted({t for t in layer_types if "linear_attention" in t})
    if recurrent:
        raise ValueError(
            f"Sequence parallelism cannot shard layers of type {recurrent} (model "
            f"{type(model).__name__}): they carry a recurrent state along the sequence. Use a "
            "full-attention model, or turn sequence parallelism off."
        )
