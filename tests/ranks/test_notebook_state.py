"""Ranks start where the notebook stands, as a function called in the notebook (or a rank
forked from the kernel) would: torch's default dtype, generator, deterministic mode and matmul
precision; the generators of ``random`` and NumPy; the warning filters. Real launches; the test
process's state is restored."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from recorder import Recorder

from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer


@pytest.fixture
def notebook_torch():
    saved = (
        torch.get_default_dtype(),
        torch.random.get_rng_state(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_float32_matmul_precision(),
    )
    py_state, np_state = random.getstate(), np.random.get_state()
    with warnings.catch_warnings():
        yield
    random.setstate(py_state)
    np.random.set_state(np_state)
    dtype, rng, deterministic, warn_only, precision = saved
    torch.set_default_dtype(dtype)
    torch.random.set_rng_state(rng)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.set_float32_matmul_precision(precision)


def _settings() -> tuple:
    return (
        torch.get_default_dtype(),
        torch.rand(3).tolist(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_float32_matmul_precision(),
        torch.zeros(1).dtype,
    )


def test_ranks_start_with_the_notebooks_torch_settings(notebook_torch):
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_float32_matmul_precision("medium")
    torch.manual_seed(1234)
    here = _settings()  # what the function gives called in the notebook
    torch.manual_seed(1234)
    ranks = notebook_launcher(_settings, num_processes=2, renderer=Renderer())
    assert ranks == [here, here]
    assert here[0] is torch.float64 and here[2:5] == (True, True, "medium")
    assert torch.rand(3).tolist() == here[1]  # the launch read the generator, did not move it


def test_changed_settings_reach_the_next_launch(notebook_torch):
    torch.manual_seed(7)
    first = notebook_launcher(_settings, num_processes=2, renderer=Renderer())
    torch.set_default_dtype(torch.float16)
    torch.manual_seed(8)
    second = notebook_launcher(_settings, num_processes=2, renderer=Renderer())
    assert first[0][0] is torch.float32 and second[0][0] is torch.float16
    assert second[0][5] is torch.float16 and first[0][1] != second[0][1]
    torch.manual_seed(8)
    assert second[1][1] == torch.rand(3).tolist()  # float16 draws from seed 8, as here


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def test_seeding_in_the_notebook_seeds_the_ranks(notebook_torch):
    """``set_seed(42)``-style seeding of all three generators before a launch."""
    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(42)
    here = _draws()
    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(42)
    assert notebook_launcher(_draws, num_processes=2, renderer=Renderer()) == [here, here]


def _warn() -> None:
    warnings.warn(f"noisy library warning from rank {os.environ['RANK']}", stacklevel=1)
    warnings.warn(f"kept warning from rank {os.environ['RANK']}", stacklevel=1)


def test_the_notebooks_warning_filters_apply_on_the_ranks(notebook_torch):
    warnings.filterwarnings("ignore", message="noisy library warning")
    lines = Recorder()
    notebook_launcher(_warn, num_processes=2, renderer=lines)
    shown = lines.text()
    assert "kept warning from rank 0" in shown and "kept warning from rank 1" in shown
    assert "noisy library warning" not in shown


_NUMPY_PROBE = """
import sys
import numpy, torch
from nbaccel import notebook_launcher
from nbaccel.launch.launchers.forkserver.launcher import get_forkserver
from nbaccel.launch.driver.renderer import Renderer

def imported():
    return "numpy.random" in sys.modules

assert "numpy" in sys.modules and "numpy.random" not in sys.modules
ranks = notebook_launcher(imported, num_processes=2, renderer=Renderer())
print(ranks, "numpy.random" in sys.modules)
import numpy.random
numpy.random.seed(5)
ranks = notebook_launcher(imported, num_processes=2, renderer=Renderer())
print(ranks, "numpy.random" in get_forkserver().preloaded)
"""


def test_numpy_random_is_left_alone_until_the_notebook_imports_it():
    """Reading NumPy's generator must not import ``numpy.random`` (NumPy imports submodules on
    first access: 0.1 s here, and ~10 ms in every rank of every launch, nearly doubling an
    8-rank launch). Once the notebook has it, the fork server preloads it for the ranks."""
    done = subprocess.run(
        [sys.executable, "-c", _NUMPY_PROBE], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-2:] == ["[False, False] False", "[True, True] True"]
