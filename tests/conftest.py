import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Everything the suite and its kernels and ranks put in the temp folder (connection files of
# kernels the tests kill, logs, private directories) lands in one folder, removed at the end.
_TMP = tempfile.mkdtemp(prefix="nbaccel-tests-")
os.environ["TMPDIR"] = _TMP
os.environ.setdefault("NBACCEL_LOG_DIR", os.path.join(_TMP, "logs"))
tempfile.tempdir = None  # recomputed from TMPDIR
atexit.register(shutil.rmtree, _TMP, True)


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts with no shared distributed state in the test process."""
    from nbaccel.distributed.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


_TIERS = ("unit", "ranks", "kernel")


def pytest_collection_modifyitems(config, items):
    """Each test is marked with its tier (the folder it is in: ``-m unit`` selects the fast
    tier); tests marked ``gpu`` skip, with the reason, where torch sees no CUDA device."""
    for item in items:
        tier = item.path.parent.name
        if tier in _TIERS:
            item.add_marker(getattr(pytest.mark, tier))
    import torch

    if torch.cuda.is_available():
        return
    reason = (
        f"no CUDA device: torch {torch.__version__} reports torch.cuda.is_available() == False "
        "(run the GPU lane, scripts/test-gpu, on a machine with an NVIDIA GPU)"
    )
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
