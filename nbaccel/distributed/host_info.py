"""Facts about this host: CPU-rank layout from MPI/torchrun variables, GPU names and driver
(read with ``nvidia-smi`` so CUDA is not initialised), kernel version, NUMA pinning."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass

from packaging.version import Version

from nbaccel.distributed.environment_patch import get_int_from_env
from nbaccel.values.booleans import env_flag

__all__ = [
    "CPUInformation",
    "are_libraries_initialized",
    "check_cuda_fp8_capability",
    "check_fp8_launch",
    "fp8_emulation_requested",
    "fp8_hardware_problem",
    "check_cuda_p2p_ib_support",
    "check_os_kernel",
    "get_cpu_distributed_information",
    "get_driver_version",
    "get_gpu_info",
    "override_numa_affinity",
    "set_numa_affinity",
]

_MIN_KERNEL = "5.5.0"


@dataclass
class CPUInformation:
    """Where this process sits in a CPU run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1


def get_cpu_distributed_information() -> CPUInformation:
    """Rank and world sizes from torchrun, Intel MPI, Open MPI or MVAPICH variables."""
    return CPUInformation(
        rank=get_int_from_env(
            ["RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"], 0
        ),
        world_size=get_int_from_env(
            ["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1
        ),
        local_rank=get_int_from_env(
            [
                "LOCAL_RANK",
                "MPI_LOCALRANKID",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "MV2_COMM_WORLD_LOCAL_RANK",
            ],
            0,
        ),
        local_world_size=get_int_from_env(
            [
                "LOCAL_WORLD_SIZE",
                "MPI_LOCALNRANKS",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
                "MV2_COMM_WORLD_LOCAL_SIZE",
            ],
            1,
        ),
    )


def are_libraries_initialized(*library_names: str) -> list[str]:
    """The subset of ``library_names`` already imported in this process."""
    return [name for name in library_names if name in sys.modules]


def _nvidia_smi(*query: str) -> list[str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise FileNotFoundError("nvidia-smi is not on PATH: no NVIDIA driver visible here.")
    out = subprocess.check_output([exe, *query, "--format=csv,noheader"], text=True)
    return [line.strip() for line in out.strip().splitlines() if line.strip()]


def get_gpu_info() -> tuple[list[str], int]:
    """``(names, count)`` of the NVIDIA GPUs, from nvidia-smi."""
    rows = _nvidia_smi("--query-gpu=name")
    return rows, len(rows)


def get_driver_version() -> str:
    """The NVIDIA driver version (of the first GPU)."""
    return _nvidia_smi("--query-gpu=driver_version")[0]


def check_cuda_p2p_ib_support() -> bool:
    """False when several RTX 40xx GPUs sit behind a driver older than 550.40.07 (P2P/IB hang)."""
    try:
        names, count = get_gpu_info()
        if count > 1 and any("RTX 40" in n for n in names):
            return Version(get_driver_version()) >= Version("550.40.07")
    except Exception:
        pass
    return True


def check_cuda_fp8_capability() -> bool:
    """True when the current CUDA device has compute capability >= 8.9 (hardware FP8)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def fp8_hardware_problem(device_type: str = "cpu", emulate: bool = False) -> str | None:
    """Why FP8 matmuls cannot run on ``device_type`` here (None when they can): CUDA needs
    compute capability 8.9+ (Ada, Hopper, Blackwell); the CPU needs torch's FP8 ``_scaled_mm``
    kernel (torch >= 2.13). ``emulate`` (torchao's emulation) runs anywhere."""
    import torch

    if emulate:
        return None
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) >= (8, 9):
            return None
        name = torch.cuda.get_device_name()
        return (
            f"FP8 training needs an NVIDIA GPU of compute capability 8.9 or higher (L4, L40, "
            f"RTX 40xx, H100, B200); this one is {name} (sm_{major}{minor}). Pass "
            "AORecipeKwargs(emulate=True) (or set NBACCEL_FP8_EMULATE=1 before launching) to "
            "emulate FP8 (slower, for testing), or train in bf16."
        )
    if device_type == "cpu":
        try:
            one = torch.ones((16, 16)).to(torch.float8_e4m3fn)
            scale = torch.tensor(1.0)
            torch._scaled_mm(one, one.t(), scale, scale, out_dtype=torch.bfloat16)
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            return (
                f"This torch ({torch.__version__}) has no FP8 matmul on the CPU (torch >= 2.13 "
                "has one). Upgrade torch, or pass AORecipeKwargs(emulate=True)."
            )
        return None
    return (
        f"FP8 training is not available on {device_type!r} devices: use a CUDA GPU of compute "
        "capability 8.9+ or the CPU, or pass AORecipeKwargs(emulate=True)."
    )


def fp8_emulation_requested() -> bool:
    """Whether ``NBACCEL_FP8_EMULATE`` asks torchao to emulate FP8 (the launch check and
    ``AORecipeKwargs``'s default both read it)."""
    return bool(env_flag("NBACCEL_FP8_EMULATE"))


def check_fp8_launch(mixed_precision: str, cpu: bool) -> None:
    """Before any rank starts: refuse ``mixed_precision="fp8"`` on GPU ranks whose GPU has no
    FP8 matmul (compute capability below 8.9), unless emulation is asked for."""
    if str(mixed_precision).lower() != "fp8" or cpu:
        return
    problem = fp8_hardware_problem("cuda", fp8_emulation_requested())
    if problem is not None:
        raise RuntimeError(problem)


def check_os_kernel() -> None:
    """Warn when the Linux kernel is older than 5.5, where distributed runs are known to hang."""
    info = platform.uname()
    if info.system != "Linux":
        return
    found = re.search(r"\d+\.\d+\.\d+", info.release)
    if found and Version(found.group(0)) < Version(_MIN_KERNEL):
        from nbaccel.distributed.logging import get_logger

        get_logger(__name__).warning(
            f"Detected kernel version {found.group(0)}, which is below the recommended minimum of "
            f"{_MIN_KERNEL}; this can cause the process to hang. Upgrade the kernel."
        )


def override_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """Pin this process to the CPUs of the NUMA node of its GPU (Linux, NVIDIA); no-op elsewhere."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        import torch

        if not torch.cuda.is_available():
            return
        bus = torch.cuda.get_device_properties(local_process_index).pci_bus_id
        path = f"/sys/bus/pci/devices/{bus.lower()}/local_cpulist"
        with open(path) as f:
            spec = f.read().strip()
    except Exception as exc:  # no sysfs entry: leave the affinity alone, say why
        warnings.warn(f"NUMA affinity left unchanged: {exc}", stacklevel=2)
        return
    cpus: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus += list(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, cpus)
    if verbose:
        print(f"Process {local_process_index} pinned to CPUs {spec}")


class _Pinned:
    """The process indices this process has pinned to their NUMA node's CPUs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._indices: set[int] = set()

    def first(self, index: int) -> bool:
        """True the first time ``index`` is asked for (it is then noted as pinned)."""
        with self._lock:
            new = index not in self._indices
            self._indices.add(index)
            return new


_pinned = _Pinned()


def set_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """:func:`override_numa_affinity`, once per process index."""
    if _pinned.first(local_process_index):
        override_numa_affinity(local_process_index, verbose=verbose)
