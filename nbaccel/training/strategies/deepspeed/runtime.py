"""Importing DeepSpeed for a run: the optional extra, its CPU accelerator, no needless JIT builds.

DeepSpeed is an optional extra (``pip install nbaccel[deepspeed]``), imported only when a
DeepSpeed run asks for it. On CPU ranks it must use its CPU accelerator (``DS_ACCELERATOR=cpu``),
which speaks gloo when oneCCL is absent. DeepSpeed's communication backend JIT-compiles a
shared-memory all-reduce op when it starts (minutes, once per extensions directory); that op
serves only ``inference_all_reduce`` (tensor-parallel inference), never training, so on gloo
ranks nbaccel marks it unavailable unless ``NBACCEL_DEEPSPEED_SHM=1`` asks for it.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from types import ModuleType
from typing import Any

import torch

from nbaccel.values.booleans import env_flag

__all__ = ["deepspeed_missing", "import_deepspeed", "is_deepspeed_available"]

_SHM_OP = "deepspeed_shm_comm"


def is_deepspeed_available() -> bool:
    """True when DeepSpeed can be imported here (it is not imported to find out)."""
    return importlib.util.find_spec("deepspeed") is not None


def deepspeed_missing(what: str = "DeepSpeed") -> ImportError:
    """The error for a DeepSpeed path used where DeepSpeed is not installed."""
    return ImportError(
        f"{what} needs DeepSpeed, which is not installed here: pip install nbaccel[deepspeed] "
        "(or pip install deepspeed)."
    )


def import_deepspeed(device: torch.device | str | None = None) -> ModuleType:
    """``deepspeed``, set up for ranks on ``device`` (CPU ranks: its CPU accelerator, gloo, and
    no shared-memory op build)."""
    kind = torch.device(device).type if device is not None else None
    if kind == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not is_deepspeed_available():
        raise deepspeed_missing()
    with warnings.catch_warnings():  # its import uses torch.jit APIs torch now deprecates
        warnings.simplefilter("ignore", DeprecationWarning)
        import deepspeed
    from deepspeed.accelerator import get_accelerator

    if kind == "cpu" and get_accelerator().device_name() != "cpu":
        # DeepSpeed picked a GPU accelerator before this run asked for CPU ranks (cpu=True)
        from deepspeed.accelerator import set_accelerator
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    if kind == "cpu" and not env_flag("NBACCEL_DEEPSPEED_SHM"):
        _without_shm_op()
    # DeepSpeed calls torch's older collective names at every step; the warning is not the user's
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into|reduce_scatter)_tensor` is deprecated",
        category=FutureWarning,
    )
    return deepspeed


class _ProbedOnDemand(dict):
    """DeepSpeed's table of ops this machine can build, each probed when first asked about
    (DeepSpeed probes all of them, with compiler runs, the first time it reads the table)."""

    def __missing__(self, name: str) -> bool:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        from deepspeed.ops.op_builder.builder import probe_is_compatible

        builder = ALL_OPS.get(name)
        value = builder is not None and bool(probe_is_compatible(builder))
        self[name] = value
        return value

    def get(self, name: Any, default: Any = None) -> Any:
        return self[name]


def _without_shm_op() -> None:
    import deepspeed.ops

    table = vars(deepspeed.ops).get("__compatible_ops__")
    if table is None:
        table = _ProbedOnDemand()
        deepspeed.ops.__compatible_ops__ = table
    table[_SHM_OP] = False
