"""Is the quantization backend a config asks for here, recent enough, and able to run on the
devices of the map? Checked from package metadata (nothing imported), before any weight is read;
each refusal names the package, the version and the extra that installs it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Iterable

from packaging.version import parse

__all__ = ["BNB_MIN_VERSION", "TORCHAO_MIN_VERSION", "require_backend"]

BNB_MIN_VERSION = "0.46.0"  # the first release with CPU 8-bit and 4-bit linear layers
BNB_CUDA_MIN_VERSION = "0.43.0"
TORCHAO_MIN_VERSION = "0.10.0"
MSLK_MIN_VERSION = "1.0.0"  # torchao's int4 weight-only kernels on the CPU


def _version(package: str) -> str | None:
    try:
        if importlib.util.find_spec(package) is None:
            return None
    except (ImportError, ValueError):  # blocked (sys.modules[name] = None) or broken
        return None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _require(package: str, minimum: str, extra: str, why: str) -> None:
    found = _version(package)
    if found is None:
        raise ImportError(
            f"{why} needs {package} >= {minimum}, which is not installed: "
            f"pip install 'nbaccel[{extra}]' (or pip install '{package}>={minimum}')."
        )
    if parse(found) < parse(minimum):
        raise ImportError(
            f"{why} needs {package} >= {minimum}; {found} is installed: "
            f"pip install -U 'nbaccel[{extra}]' (or pip install -U '{package}>={minimum}')."
        )


def require_backend(config: object, devices: Iterable[object] = ("cpu",)) -> None:
    """Raise ImportError naming the fix when ``config``'s backend cannot quantize for the
    ``devices`` of the device map (``"cpu"``, ``"disk"``, GPU indices) here."""
    devices = set(devices)
    on_cpu = bool(devices & {"cpu", "disk"}) or not devices
    backend = getattr(config, "backend", None)
    if backend == "bitsandbytes":
        minimum = BNB_MIN_VERSION if on_cpu else BNB_CUDA_MIN_VERSION
        where = "on the CPU" if on_cpu else "on the GPU"
        _require("bitsandbytes", minimum, "bnb", f"Quantizing with bitsandbytes {where}")
    elif backend == "torchao":
        _require("torchao", TORCHAO_MIN_VERSION, "torchao", "Quantizing with torchao")
        if getattr(config, "bits", 8) == 4 and on_cpu:
            found = _version("mslk")
            if found is None or parse(found) < parse(MSLK_MIN_VERSION):
                have = "not installed" if found is None else f"{found} is installed"
                raise ImportError(
                    f"torchao's int4 weight-only quantization on the CPU needs the mslk package "
                    f">= {MSLK_MIN_VERSION} ({have}). Install mslk, or use "
                    "TorchAoConfig('int8_weight_only'), or BnbQuantizationConfig(load_in_4bit="
                    "True) for 4-bit on the CPU."
                )
    else:
        raise TypeError(
            "bnb_quantization_config must be a BnbQuantizationConfig or a TorchAoConfig, not "
            f"{type(config).__name__}."
        )
