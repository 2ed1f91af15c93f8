"""The host-RAM estimate a launch makes before its ranks start (used by the torch-xla launcher):
real tensors in ``args`` are shared once, meta ones cost one materialised copy per rank, and
device copies count per rank where device memory is host RAM (torch-xla's CPU device)."""

import warnings

import pytest
import torch
from torch import nn

from nbaccel.launch.host_ram import HostRamWarning, estimate_host_ram, warn_if_short

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
