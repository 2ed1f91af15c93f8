"""The fork server refuses to fork ranks once a preloaded module initialised CUDA at import.

On a machine without CUDA the library is simulated by a module that marks torch's CUDA state
initialised (what ``torch.cuda.init()`` leaves behind); ``tests/kernel/test_gpu_launch.py`` does
it for real on a GPU. Either way the launch must fail before any rank starts, naming the module
and the fix, and the next launch must get a fresh, working server.
"""

import sys

import pytest

from nbaccel.launch.driver.render import TextRenderer
from nbaccel.launch.launchers.forkserver import CudaInitializedInServer, shutdown_forkserver
from nbaccel.launch.plan import LaunchPlan
from nbaccel.launch.request import Front, LaunchRequest
from nbaccel.launch.run import run_function

CUDA_AT_IMPORT = "import torch\ntorch.cuda._initialized = True  # as torch.cuda.init() leaves it\n"


def _pid():
    import os

    return os.getpid()


@pytest.fixture
def cuda_library(tmp_path, monkeypatch):
    """A module named ``cuda_at_import_lib`` that initialises CUDA when imported."""
    (tmp_path / "cuda_at_import_lib.py").write_text(CUDA_AT_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "cuda_at_import_lib"
    sys.modules.pop("cuda_at_import_lib", None)
    shutdown_forkserver()  # never leave a poisoned server to the next test


def test_a_preloaded_module_that_initialises_cuda_is_refused_before_any_rank(cuda_library):
    plan = LaunchPlan.create(Front.TESTING, LaunchRequest(num_processes=2, cpu=True))
    shutdown_forkserver()  # a fresh server, started with this sys.path (the module's folder)
    with pytest.raises(CudaInitializedInServer) as info:
        run_function(plan, _pid, renderer=TextRenderer(quiet=True), preload=(cuda_library,))
    message = str(info.value)
    assert "'cuda_at_import_lib'" in message and "initialised CUDA" in message
    assert "start_method='spawn'" in message  # the fix is named
    # the poisoned server was dropped: the next launch (without that module) works
    report = run_function(plan, _pid, renderer=TextRenderer(quiet=True))
    assert len(report.values()) == 2


def test_spawn_start_method_is_not_affected(cuda_library):
    plan = LaunchPlan.create(
        Front.TESTING, LaunchRequest(num_processes=1, cpu=True, start_method="spawn")
    )
    report = run_function(plan, _pid, renderer=TextRenderer(quiet=True), preload=(cuda_library,))
    assert len(report.values()) == 1
