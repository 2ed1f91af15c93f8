"""A rank keeps the memory it frees for its next step: a plain CPU training loop takes no page
faults per step in a rank, where glibc's defaults (``NBACCEL_KEEP_FREED_MEMORY=0``) fault in
megabytes on every step; the notebook's own ``MALLOC_*_`` variables reach the ranks (forked
ranks never read them at start); a value the ranks could not use is refused before anything
starts. Real ranks, real page-fault counts."""

from __future__ import annotations

import pytest

from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer


def _faults_per_step() -> int:
    import resource

    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(), torch.nn.Linear(1024, 10),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 256), torch.randint(0, 10, (16,))

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()  # frees the gradients: the next backward allocates them again

    for _ in range(5):
        step()
    faults = []
    for _ in range(21):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sorted(faults)[10]  # the median step's: a heap that grows once is not a step's cost


def _launch() -> list[int]:
    return notebook_launcher(_faults_per_step, num_processes=2, renderer=Renderer())


def test_a_ranks_training_steps_fault_in_nothing(monkeypatch):
    for name in ("NBACCEL_KEEP_FREED_MEMORY", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    kept = _launch()
    monkeypatch.setenv("NBACCEL_KEEP_FREED_MEMORY", "0")
    defaults = _launch()
    assert max(kept) < 100, (kept, defaults)  # 4 KiB pages per step
    # glibc's own thresholds: megabytes on most steps (a rank may settle where they do not)
    assert max(defaults) > 500, (kept, defaults)


def test_the_notebooks_malloc_variables_reach_the_ranks(monkeypatch):
    monkeypatch.delenv("NBACCEL_KEEP_FREED_MEMORY", raising=False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")  # give back every free page at once
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(8 << 20))  # as nbaccel sets it
    assert max(_launch()) > 500


@pytest.mark.parametrize(
    ("name", "value", "pattern"),
    [
        ("NBACCEL_KEEP_FREED_MEMORY", "maybe", "NBACCEL_KEEP_FREED_MEMORY='maybe' is not a bool"),
        ("MALLOC_TRIM_THRESHOLD_", "lots", r"MALLOC_TRIM_THRESHOLD_='lots' is not a number of b"),
    ],
)
def test_a_value_the_ranks_cannot_use_is_refused_first(monkeypatch, name, value, pattern):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=pattern):
        notebook_launcher(_faults_per_step, num_processes=2, renderer=Renderer())
