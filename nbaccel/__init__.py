"""nbaccel: Jupyter-native distributed training and big-model inference for PyTorch.

The public API follows Hugging Face Accelerate's names and signatures: swap
``from accelerate import ...`` for ``from nbaccel import ...``.
"""

from nbaccel.environment import detect_launch_environment, detect_platform
from nbaccel.ops import (
    ShapeMismatchError,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from nbaccel.seed import set_seed
from nbaccel.state import AcceleratorState, DistributedType, GradientState, PartialState

# -- launcher (issue 3) --
from nbaccel.launch.errors import LaunchTimeout, RankCrashed, RankError
from nbaccel.launch.launcher import debug_launcher, notebook_launcher
from nbaccel.launch.transport import UnpicklableError
# -- training core (issue 6) --
# -- big-model inference (issue 8) --
# -- notebook widgets (issue 5) --

__version__ = "0.1.0"

__all__ = [
    "AcceleratorState",
    "LaunchTimeout",
    "RankCrashed",
    "RankError",
    "UnpicklableError",
    "debug_launcher",
    "notebook_launcher",
    "DistributedType",
    "GradientState",
    "PartialState",
    "ShapeMismatchError",
    "broadcast",
    "broadcast_object_list",
    "detect_launch_environment",
    "detect_platform",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
    "send_to_device",
    "set_seed",
]


def _warm_up() -> None:
    from nbaccel.launch.forkserver import warm_up_if_in_kernel

    warm_up_if_in_kernel()


_warm_up()


def load_ipython_extension(ipython):  # pragma: no cover - thin shim, tested via the kernel
    """``%load_ext nbaccel``: register the magics."""
    from nbaccel.notebook.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):  # pragma: no cover
    from nbaccel.notebook.magics import unload_ipython_extension as _unload

    _unload(ipython)
