"""Is X available here? Package probes (``importlib.util.find_spec``: nothing heavy is imported),
device probes (torch's own ``is_available``), and version comparisons.

Stacks nbaccel does not drive (Megatron-LM, MS-AMP, PiPPy) report ``False`` even when their
package is installed, so code that branches on them takes its plain-PyTorch path instead of
reaching a NotImplementedError. bitsandbytes, torchao and FP8 report what is installed (quantized
loading and FP8 training use them).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import operator
from collections.abc import Callable
from typing import Any

import torch
from packaging.version import Version, parse

from nbaccel.values.booleans import env_flag

__all__ = [
    "STR_OPERATION_TO_FUNC",
    "USE_TORCH_XLA",
    "compare_versions",
    "deepspeed_required",
    "get_current_device_type",
    "is_torch_version",
    "torchao_required",
]  # + every ``is_*_available`` below, added at the end of the module

STR_OPERATION_TO_FUNC: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}

USE_TORCH_XLA = bool(env_flag("USE_TORCH_XLA", default=True))


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # parent package missing, or a half-initialised module
        return False


def _version_of(name: str) -> Version | None:
    try:
        return parse(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return None


def compare_versions(library_or_version: str | Version, operation: str, requirement_version: str):
    """Compare an installed library's version (or a version) with ``requirement_version``."""
    if operation not in STR_OPERATION_TO_FUNC:
        raise ValueError(
            f"operation must be one of {list(STR_OPERATION_TO_FUNC)}, not {operation!r}"
        )
    if isinstance(library_or_version, str):
        found = _version_of(library_or_version)
        if found is None:
            raise importlib.metadata.PackageNotFoundError(library_or_version)
        library_or_version = found
    return STR_OPERATION_TO_FUNC[operation](library_or_version, parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """``is_torch_version(">=", "2.4")``: compares the running torch (local suffix ignored)."""
    return compare_versions(parse(parse(torch.__version__).base_version), operation, version)


def _package_probe(*names: str) -> Callable[[], bool]:
    def probe() -> bool:
        return any(_installed(n) for n in names)

    probe.__doc__ = f"True when {' or '.join(names)} can be imported here."
    return probe


def _never(reason: str) -> Callable[..., bool]:
    def probe(*args: Any, **kwargs: Any) -> bool:
        return False

    probe.__doc__ = f"Always False: {reason}."
    return probe


_NOT_DRIVEN = "nbaccel does not drive this stack (plain PyTorch, DDP and FSDP2 instead)"

is_aim_available = _package_probe("aim")
is_boto3_available = _package_probe("boto3")
is_clearml_available = _package_probe("clearml")
is_comet_ml_available = _package_probe("comet_ml")
is_datasets_available = _package_probe("datasets")
is_dvclive_available = _package_probe("dvclive")
is_import_timer_available = _package_probe("import_timer")
is_lomo_available = _package_probe("lomo_optim")
is_matplotlib_available = _package_probe("matplotlib")
is_mlflow_available = _package_probe("mlflow")
is_pandas_available = _package_probe("pandas")
is_peft_available = _package_probe("peft")
is_pynvml_available = _package_probe("pynvml")
is_amdsmi_available = _package_probe("amdsmi")
is_pytest_available = _package_probe("pytest")
is_rich_available = _package_probe("rich")
is_sagemaker_available = _package_probe("sagemaker")
is_schedulefree_available = _package_probe("schedulefree")
is_swanlab_available = _package_probe("swanlab")
is_tensorboard_available = _package_probe("tensorboard", "tensorboardX")
is_timm_available = _package_probe("timm")
is_torchdata_available = _package_probe("torchdata")
is_torchdata_stateful_dataloader_available = _package_probe("torchdata.stateful_dataloader")
is_torchvision_available = _package_probe("torchvision")
is_tqdm_available = _package_probe("tqdm")
is_trackio_available = _package_probe("trackio")
is_transformers_available = _package_probe("transformers")
is_triton_available = _package_probe("triton")
is_wandb_available = _package_probe("wandb")

is_deepspeed_available = _package_probe("deepspeed")
is_megatron_lm_available = _never(_NOT_DRIVEN)
is_msamp_available = _never(_NOT_DRIVEN)
is_transformer_engine_available = _never(_NOT_DRIVEN)
is_transformer_engine_mxfp8_available = _never(_NOT_DRIVEN)
is_habana_gaudi1 = _never("Gaudi is not a device nbaccel drives")


def is_pippy_available() -> bool:
    """Whether torch has ``torch.distributed.pipelining`` (what ``prepare_pippy`` runs on)."""
    import importlib.util

    return importlib.util.find_spec("torch.distributed.pipelining") is not None


def is_bnb_available(min_version: str | None = None) -> bool:
    """True when bitsandbytes (>= ``min_version`` when given) is installed (not imported)."""
    found = _version_of("bitsandbytes") if _installed("bitsandbytes") else None
    return found is not None and (min_version is None or found >= parse(min_version))


def is_8bit_bnb_available() -> bool:
    """True when bitsandbytes can load 8-bit layers here (>= 0.46: CPU and CUDA backends)."""
    return is_bnb_available("0.46.0")


def is_4bit_bnb_available() -> bool:
    """True when bitsandbytes can load 4-bit layers here (>= 0.46: CPU and CUDA backends)."""
    return is_bnb_available("0.46.0")


def is_bitsandbytes_multi_backend_available() -> bool:
    """True when bitsandbytes has backends beyond CUDA (its CPU backend, >= 0.46)."""
    return is_bnb_available("0.46.0")


def is_torchao_available() -> bool:
    """True when torchao (>= 0.10, Float8 training and weight-only quantization) is installed."""
    found = _version_of("torchao") if _installed("torchao") else None
    return found is not None and found >= parse("0.10.0")


def is_fp8_available() -> bool:
    """True when FP8 training can run here: torchao or Transformer Engine is installed (FP8
    matmuls run on CPUs with torch >= 2.13's kernels, GPUs of compute capability >= 8.9, or
    emulated)."""
    return is_torchao_available() or _installed("transformer_engine")


def is_numpy_available(min_version: str = "1.25.0") -> bool:
    """True when numpy >= ``min_version`` is installed."""
    found = _version_of("numpy")
    return found is not None and found >= parse(min_version)


def is_torch_distributed_available() -> bool:
    """True when this torch build has ``torch.distributed``."""
    return torch.distributed.is_available()


def is_weights_only_available() -> bool:
    """True when ``torch.load(weights_only=...)`` exists with safe globals (torch >= 2.4)."""
    return is_torch_version(">=", "2.4.0")


def is_xccl_available() -> bool:
    """True when torch.distributed has the XCCL backend (Intel GPUs)."""
    probe = getattr(torch.distributed, "is_xccl_available", None)
    return bool(probe and probe())


def is_rocm_available() -> bool:
    """True on a ROCm (HIP) build of torch."""
    return getattr(torch.version, "hip", None) is not None


def is_cuda_available() -> bool:
    """True when a CUDA device can be used (``torch.cuda.is_available``)."""
    return torch.cuda.is_available()


def is_xpu_available(check_device: bool = False) -> bool:
    """True when torch has a usable Intel XPU (``check_device`` also counts the devices)."""
    xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available():
        return False
    return xpu.device_count() > 0 if check_device else True


def is_mps_available(min_version: str = "1.12") -> bool:
    """True on Apple-silicon builds whose MPS backend is usable."""
    return is_torch_version(">=", min_version) and torch.backends.mps.is_available()


def _vendor_device(package: str, attribute: str) -> Callable[..., bool]:
    def probe(check_device: bool = False) -> bool:
        if not _installed(package):
            return False
        module = getattr(torch, attribute, None)
        return bool(module is not None and module.is_available())

    probe.__doc__ = f"True when {package} is installed and torch.{attribute} has a device."
    return probe


is_npu_available = _vendor_device("torch_npu", "npu")
is_mlu_available = _vendor_device("torch_mlu", "mlu")
is_musa_available = _vendor_device("torch_musa", "musa")
is_sdaa_available = _vendor_device("torch_sdaa", "sdaa")
is_neuron_available = _vendor_device("torch_neuronx", "neuron")


def is_hpu_available(init_hccl: bool = False) -> bool:
    """True when Habana's torch bridge is installed and has a device."""
    return _vendor_device("habana_frameworks", "hpu")()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Can this machine compute in bfloat16? (CPU: yes; CUDA/XPU: asks the device.)"""
    from nbaccel.distributed.environment import detect_platform

    if detect_platform().get("tpu", False):
        return not ignore_tpu
    if is_cuda_available():
        return torch.cuda.is_bf16_supported()
    if is_xpu_available():
        return torch.xpu.is_bf16_supported()
    return True


def is_fp16_available() -> bool:
    """Can this machine compute in float16? (True for every device nbaccel drives.)"""
    return True


def get_current_device_type() -> tuple[str, str]:
    """``(device type, distributed type)`` of the accelerator here, without initialising it."""
    if is_cuda_available():
        return "cuda", "MULTI_GPU"
    if is_xpu_available():
        return "xpu", "MULTI_XPU"
    return "cpu", "MULTI_CPU"


def deepspeed_required(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` raises ImportError naming the extra when DeepSpeed is not installed."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not is_deepspeed_available():
            raise ImportError(f"{func.__name__} needs DeepSpeed: pip install nbaccel[deepspeed].")
        return func(*args, **kwargs)

    return wrapper


def torchao_required(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: ``func`` raises ImportError naming the extra when torchao is not installed."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not is_torchao_available():
            raise ImportError(
                f"{func.__name__} needs torchao >= 0.10: pip install 'nbaccel[torchao]'."
            )
        return func(*args, **kwargs)

    return wrapper


__all__ += sorted(n for n in dir() if n.startswith("is_") and n.endswith(("available", "gaudi1")))
