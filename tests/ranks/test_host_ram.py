"""The host-RAM estimate a launch makes before its ranks start (used by the torch-xla launcher):
real tensors in ``args`` are shared once, meta ones cost one materialised copy per rank, and
device copies count per rank where device memory is host RAM (torch-xla's CPU device)."""

import warnings

import pytest
import torch
from torch import nn

from nbaccel.launch.host.host_ram import HostRamWarning, estimate_host_ram, warn_if_short

MiB = 1 << 20


def test_real_weights_are_shared_once_and_views_count_once():
    model = nn.Linear(1024, 256, bias=False)  # 1 MiB of float32
    flat = model.weight.detach().view(-1)
    estimate = estimate_host_ram((model, flat, [model.weight[:2]]), ranks=8, available=10**12)
    assert estimate.shared == MiB and estimate.per_rank == 0 and estimate.total == MiB


def test_meta_models_and_host_ram_devices_cost_one_copy_per_rank():
    real = nn.Linear(1024, 256, bias=False)
    with torch.device("meta"):
        meta = nn.Linear(2048, 256, bias=False)  # 2 MiB each rank builds
    on_chip = estimate_host_ram({"a": real, "b": meta}, ranks=4, available=10**12)
    assert (on_chip.shared, on_chip.per_rank, on_chip.total) == (MiB, 2 * MiB, 9 * MiB)
    on_cpu = estimate_host_ram((real, meta), ranks=4, device_copies_in_host_ram=True)
    assert on_cpu.per_rank == 3 * MiB and on_cpu.total == 13 * MiB


def test_warns_only_when_short_and_names_the_fix():
    with torch.device("meta"):
        meta = nn.Linear(1024, 1024, bias=False)  # 4 MiB per rank
    roomy = estimate_host_ram((meta,), ranks=8, available=64 * MiB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_short(roomy) is False
    short = estimate_host_ram((meta,), ranks=8, available=16 * MiB)
    with pytest.warns(HostRamWarning, match="8 ranks each materialising") as caught:
        assert warn_if_short(short, "CPU_NUM_DEVICES") is True
    message = str(caught[0].message)
    assert "pass it in args" in message and "CPU_NUM_DEVICES" in message


def _memory_cgroup_root() -> str | None:
    """A memory controller this process may make a child group in (root): cgroup v1's
    ``memory`` hierarchy, or v2's root with ``memory`` enabled for its children."""
    import os

    v1, v2 = "/sys/fs/cgroup/memory", "/sys/fs/cgroup"
    if os.path.exists(f"{v1}/memory.limit_in_bytes"):
        return v1 if os.access(v1, os.W_OK) else None
    try:
        with open(f"{v2}/cgroup.subtree_control") as handle:
            enabled = "memory" in handle.read().split()
    except OSError:
        return None
    return v2 if enabled and os.access(v2, os.W_OK) else None


@pytest.mark.skipif(_memory_cgroup_root() is None, reason="needs root and a memory cgroup")
def test_a_cgroup_limit_lowers_the_memory_a_launch_may_use(tmp_path):
    """A real cgroup with a 256 MiB limit (a container's, a SLURM job's): a process inside it
    sees at most that much in the capacity check, the host-RAM estimate and the CPU budget of
    a device map (``max_memory=None``)."""
    import os
    import subprocess
    import sys

    root = _memory_cgroup_root()
    group = os.path.join(root, f"nbaccel-test-{os.getpid()}")
    os.mkdir(group)
    try:
        v1 = os.path.exists(os.path.join(group, "memory.limit_in_bytes"))
        limit_file = "memory.limit_in_bytes" if v1 else "memory.max"
        with open(os.path.join(group, limit_file), "w") as handle:
            handle.write(str(256 * MiB))
        probe = (
            "import os, sys\n"
            f"open({os.path.join(group, 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
            "from nbaccel.launch.host.capacity import available_memory, check_capacity\n"
            "from nbaccel.launch.host.host_ram import estimate_host_ram\n"
            "from nbaccel.bigmodel import get_max_memory\n"
            "print(available_memory(), estimate_host_ram((), ranks=2).available,"
            " get_max_memory()['cpu'])\n"
            "try:\n"
            "    check_capacity(24)\n"
            "except ValueError as exc:\n"
            "    print(exc)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        first, _, refusal = out.stdout.partition("\n")
        seen = [int(figure) for figure in first.split()]  # capacity, host RAM, cpu budget
        assert len(seen) == 3 and all(0 < figure <= 256 * MiB for figure in seen), out.stdout
        # 24 forked ranks need at least 24 x 16 MiB = 384 MiB: more than the group allows
        assert "num_processes=24 needs at least 384 MiB" in refusal, out.stdout
        assert "Use at most" in refusal
    finally:
        for _ in range(50):  # the probe has exited; its group empties as it is reaped
            try:
                os.rmdir(group)
                break
            except OSError:
                import time

                time.sleep(0.1)
