"""Helpers of the GPU lane (tests marked ``gpu``, run by ``scripts/test-gpu``).

How many ranks a GPU test runs (one per GPU, at most 2: one GPU gives a world of one), skips
that need more GPUs or a package, and which processes hold GPU memory (``nvidia-smi``, which
sees every process of the machine; inside some containers it lists none, then only the
exit of the processes is checked).
"""

from __future__ import annotations

import shutil
import subprocess
import time

import psutil
import pytest
import torch


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def ranks() -> int:
    """Ranks of a multi-process GPU test: one per GPU, at most 2 (1 on a one-GPU machine)."""
    return max(1, min(2, gpu_count()))


def need_gpus(n: int) -> None:
    """Skip the running test unless ``n`` GPUs are visible."""
    if gpu_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs, this machine has {gpu_count()}")


def gpu_processes() -> dict[int, int] | None:
    """pid -> MiB of GPU memory for every process nvidia-smi lists (None without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0:
        return None
    found = {}
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            found[int(parts[0])] = int(parts[1]) if parts[1].isdigit() else 0
    return found


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def holders(pids: list[int], wait: float = 15.0) -> list[str]:
    """Which of ``pids`` still run or still hold GPU memory, after at most ``wait`` seconds
    (the driver frees a context shortly after its process ends); empty when none."""
    deadline = time.monotonic() + wait
    while True:
        alive = [p for p in pids if _running(p)]
        listed = gpu_processes() or {}
        holding = [p for p in pids if p in listed]
        if not alive and not holding:
            return []
        if time.monotonic() > deadline:
            return [f"pid {p} alive" for p in alive] + [
                f"pid {p} holds {listed[p]} MiB" for p in holding
            ]
        time.sleep(0.2)


def visible_uuids() -> list[str]:
    """UUIDs of the GPUs this process sees, in CUDA order."""
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(gpu_count())]
