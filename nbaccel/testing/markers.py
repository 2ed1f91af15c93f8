# ruff: noqa: E501  (the marker tables read best one marker per line)
"""Test markers: skip a test unless a device, a number of devices or a package is present.

Each ``require_*`` decorates a test function or class (``unittest.skipUnless``); ``slow`` tests
run only with ``RUN_SLOW=1``. Device facts are read once from torch.
"""

from __future__ import annotations

import os
import unittest
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from nbaccel.distributed import probes
from nbaccel.distributed.environment import is_torch_xla_available
from nbaccel.distributed.environment_patch import parse_flag_from_env

__all__ = [
    "device_count",
    "get_backend",
    "memory_allocated_func",
    "require_torch_min_version",
    "run_first",
    "skip",
    "slow",
    "torch_device",
]  # + the require_* markers, added at the end

_T = TypeVar("_T")


def get_backend() -> tuple[str, int, Callable[[], int]]:
    """``(device type, device count, memory-allocated function)`` of this machine."""
    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count(), torch.cuda.memory_allocated
    if probes.is_xpu_available():
        return "xpu", torch.xpu.device_count(), torch.xpu.memory_allocated
    if probes.is_mps_available():
        return "mps", 1, torch.mps.current_allocated_memory
    return "cpu", 1, lambda: 0


torch_device, device_count, memory_allocated_func = get_backend()

_run_slow = parse_flag_from_env("RUN_SLOW", default=False)


def slow(test_case: _T) -> _T:
    """Run only when ``RUN_SLOW=1``."""
    return unittest.skipUnless(_run_slow, "slow test: set RUN_SLOW=1 to run it")(test_case)


def skip(test_case: _T) -> _T:
    """Always skipped."""
    return unittest.skip("test was skipped")(test_case)


def run_first(test_case: _T) -> _T:
    """Mark a test to run before the others (with pytest-order); otherwise unchanged."""
    try:
        import pytest

        return pytest.mark.order(1)(test_case)
    except Exception:
        return test_case


def _marker(name: str, condition: Callable[[], bool], reason: str) -> Callable[[_T], _T]:
    def marker(test_case: _T) -> _T:
        return unittest.skipUnless(condition(), reason)(test_case)

    marker.__name__ = marker.__qualname__ = name
    marker.__doc__ = f"Skip unless {reason.removeprefix('test requires ')}."
    return marker


def require_torch_min_version(test_case: Any = None, version: str | None = None) -> Any:
    """Skip unless torch >= ``version`` (usable bare or as ``@require_torch_min_version(version=...)``)."""
    if test_case is None:
        return lambda case: require_torch_min_version(case, version=version)
    ok = probes.is_torch_version(">=", version)
    return unittest.skipUnless(ok, f"test requires torch >= {version}")(test_case)


def _multi(kind: str) -> bool:
    return torch_device == kind and device_count > 1


_DEVICE_MARKERS: dict[str, tuple[Callable[[], bool], str]] = {
    "require_cpu": (lambda: torch_device == "cpu", "test requires only a CPU"),
    "require_non_cpu": (lambda: torch_device != "cpu", "test requires a hardware accelerator"),
    "require_cuda": (torch.cuda.is_available, "test requires a CUDA GPU"),
    "require_cuda_or_xpu": (lambda: torch.cuda.is_available() or probes.is_xpu_available(), "test requires a CUDA or XPU device"),
    "require_cuda_or_hpu": (lambda: torch.cuda.is_available() or probes.is_hpu_available(), "test requires a CUDA or HPU device"),
    "require_xpu": (probes.is_xpu_available, "test requires an XPU"),
    "require_non_xpu": (lambda: torch_device != "xpu", "test requires a device other than XPU"),
    "require_mps": (probes.is_mps_available, "test requires MPS"),
    "require_npu": (probes.is_npu_available, "test requires an NPU"),
    "require_mlu": (probes.is_mlu_available, "test requires an MLU"),
    "require_musa": (probes.is_musa_available, "test requires a MUSA device"),
    "require_sdaa": (probes.is_sdaa_available, "test requires an SDAA device"),
    "require_neuron": (probes.is_neuron_available, "test requires a Neuron device"),
    "require_hpu": (probes.is_hpu_available, "test requires an HPU"),
    "require_non_hpu": (lambda: not probes.is_hpu_available(), "test requires a device other than HPU"),
    "require_tpu": (lambda: is_torch_xla_available() and bool(os.environ.get("TPU_NAME") or os.environ.get("PJRT_DEVICE") == "TPU"), "test requires a TPU"),
    "require_non_torch_xla": (lambda: not is_torch_xla_available(), "test requires an environment without torch_xla"),
    "require_single_device": (lambda: torch_device != "cpu" and device_count == 1, "test requires one hardware accelerator"),
    "require_single_gpu": (lambda: torch.cuda.device_count() == 1, "test requires one CUDA GPU"),
    "require_single_xpu": (lambda: _multi("xpu") is False and probes.is_xpu_available(), "test requires one XPU"),
    "require_multi_device": (lambda: torch_device != "cpu" and device_count > 1, "test requires several hardware accelerators"),
    "require_multi_gpu": (lambda: torch.cuda.device_count() > 1, "test requires several CUDA GPUs"),
    "require_multi_xpu": (lambda: _multi("xpu"), "test requires several XPUs"),
    "require_multi_gpu_or_xpu": (lambda: torch.cuda.device_count() > 1 or _multi("xpu"), "test requires several CUDA GPUs or XPUs"),
    "require_fp16": (lambda: torch_device != "cpu" or probes.is_torch_version(">=", "2.3"), "test requires fp16 support"),
    "require_bf16": (probes.is_bf16_available, "test requires bf16 support"),
    "require_fp8": (probes.is_fp8_available, "test requires FP8 (torchao or Transformer Engine)"),
    "require_fsdp2": (lambda: probes.is_torch_version(">=", "2.6.0"), "test requires torch >= 2.6 (FSDP2)"),
    "require_fsdp": (lambda: probes.is_torch_version(">=", "2.1.0"), "test requires FSDP"),
    "require_tp": (lambda: False, "test requires tensor parallelism (not driven by nbaccel)"),
}  # fmt: skip

_PACKAGE_MARKERS: dict[str, Callable[[], bool]] = {
    "require_aim": probes.is_aim_available,
    "require_bnb": probes.is_bnb_available,
    "require_clearml": probes.is_clearml_available,
    "require_comet_ml": probes.is_comet_ml_available,
    "require_datasets": probes.is_datasets_available,
    "require_deepspeed": probes.is_deepspeed_available,
    "require_dvclive": probes.is_dvclive_available,
    "require_import_timer": probes.is_import_timer_available,
    "require_matplotlib": probes.is_matplotlib_available,
    "require_mlflow": probes.is_mlflow_available,
    "require_pandas": probes.is_pandas_available,
    "require_peft": probes.is_peft_available,
    "require_pippy": probes.is_pippy_available,
    "require_schedulefree": probes.is_schedulefree_available,
    "require_swanlab": probes.is_swanlab_available,
    "require_tensorboard": probes.is_tensorboard_available,
    "require_timm": probes.is_timm_available,
    "require_torchao": probes.is_torchao_available,
    "require_torchdata_stateful_dataloader": probes.is_torchdata_stateful_dataloader_available,
    "require_torchvision": probes.is_torchvision_available,
    "require_trackio": probes.is_trackio_available,
    "require_transformer_engine": probes.is_transformer_engine_available,
    "require_transformer_engine_mxfp8": probes.is_transformer_engine_mxfp8_available,
    "require_transformers": probes.is_transformers_available,
    "require_triton": probes.is_triton_available,
    "require_wandb": probes.is_wandb_available,
    "require_huggingface_suite": lambda: probes.is_transformers_available() and probes.is_datasets_available(),
    "require_trackers": lambda: any(
        p() for p in (probes.is_wandb_available, probes.is_tensorboard_available, probes.is_comet_ml_available,
                      probes.is_aim_available, probes.is_mlflow_available, probes.is_clearml_available,
                      probes.is_dvclive_available, probes.is_swanlab_available, probes.is_trackio_available)
    ),
}  # fmt: skip

for _name, (_condition, _reason) in _DEVICE_MARKERS.items():
    globals()[_name] = _marker(_name, _condition, _reason)
for _name, _condition in _PACKAGE_MARKERS.items():
    globals()[_name] = _marker(_name, _condition, f"test requires {_name.removeprefix('require_')}")
__all__ += sorted([*_DEVICE_MARKERS, *_PACKAGE_MARKERS])
