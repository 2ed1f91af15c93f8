"""Option types of a run that are plain values: compile (TorchDynamoPlugin, DynamoBackend), the
compute environment and SageMaker mode of a config file, custom dtypes. (Config files
themselves live in :mod:`nbaccel.commands.config`.)"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum, EnumMeta
from typing import Any

__all__ = [
    "BaseEnum",
    "get_pretty_name",
    "merge_dicts",
    "ComputeEnvironment",
    "CustomDtype",
    "DynamoBackend",
    "EnumWithContains",
    "SageMakerDistributedType",
    "TorchDynamoPlugin",
]


class EnumWithContains(EnumMeta):
    """``"x" in MyEnum`` tests the values."""

    def __contains__(cls, item: Any) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class BaseEnum(str, Enum, metaclass=EnumWithContains):
    """String enum whose ``str()`` is its value and that lists its values."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


class DynamoBackend(BaseEnum):
    """``torch.compile`` backends (``NO`` = do not compile)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class ComputeEnvironment(str, Enum):
    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class SageMakerDistributedType(str, Enum):
    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class CustomDtype(Enum):
    """Sizes below one byte per weight, for memory estimates."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


def _env(name: str) -> str | None:
    return os.environ.get(f"ACCELERATE_{name}")


@dataclass
class TorchDynamoPlugin:
    """How ``Accelerator.prepare`` compiles models with ``torch.compile``. Unset fields come
    from the launch's ``ACCELERATE_DYNAMO_*`` variables."""

    backend: DynamoBackend | str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        from nbaccel.values.booleans import parse_bool

        self.backend = DynamoBackend(str(self.backend or _env("DYNAMO_BACKEND") or "no").upper())
        self.mode = self.mode or _env("DYNAMO_MODE") or "default"
        flags = {
            "fullgraph": ("DYNAMO_USE_FULLGRAPH", False),
            "dynamic": ("DYNAMO_USE_DYNAMIC", None),
            "use_regional_compilation": ("DYNAMO_USE_REGIONAL_COMPILATION", False),
        }
        for field, (variable, default) in flags.items():
            if getattr(self, field) is None:
                raw = _env(variable)
                ours = f"NBACCEL_{variable}"
                named = ours if ours in os.environ else f"ACCELERATE_{variable}"
                flag = default if raw is None else parse_bool(raw, named)
                setattr(self, field, flag)

    def to_dict(self) -> dict[str, Any]:
        """The ``torch.compile`` keyword arguments (``backend`` lower-cased)."""
        out = {
            k: getattr(self, k)
            for k in ("backend", "mode", "fullgraph", "dynamic", "options", "disable")
        }
        out["backend"] = out["backend"].value.lower()
        return out

    def to_kwargs(self) -> dict[str, Any]:
        """Only the options that differ from a plugin built with no ``*_DYNAMO_*`` variables
        (what a ``KwargsHandler`` returns): the explicit choices of this run."""
        variables = [k for k in os.environ if k.startswith("ACCELERATE_DYNAMO_")]
        saved = {k: os.environ.pop(k) for k in variables}
        try:
            default = type(self)().to_dict()
        finally:
            os.environ.update(saved)
        return {k: v for k, v in self.to_dict().items() if default[k] != v}


def get_pretty_name(obj: Any) -> str:
    """A readable name for an object: its qualified name, or that of its class."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or str(obj)


def merge_dicts(source: dict, destination: dict) -> dict:
    """Merge ``source`` into ``destination`` recursively (nested dicts merged, other values
    overwritten); returns ``destination``."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination
