"""nbaccel: Jupyter-native distributed training and big-model inference for PyTorch.

The public API follows Hugging Face Accelerate's names and signatures: swap
``from accelerate import ...`` for ``from nbaccel import ...``.
"""

# First, so that in a kernel the fork server starts importing torch while this import does too.
from nbaccel import _warm_up  # noqa: F401
from nbaccel.bigmodel import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    infer_auto_device_map,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
)
from nbaccel.bigmodel.memory_estimate import estimate_memory
from nbaccel.compat import install as _install_compat_paths
from nbaccel.data import skip_first_batches
from nbaccel.distributed.collectives import (
    ShapeMismatchError,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from nbaccel.distributed.environment import detect_launch_environment, detect_platform
from nbaccel.distributed.random import set_seed
from nbaccel.distributed.state import AcceleratorState, DistributedType, GradientState, PartialState
from nbaccel.launch.detached.handle import RunStopped
from nbaccel.launch.host.log_store import keep_logs
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.wire.errors import LaunchTimeout, RankCrashed, RankError, ResultNotLoadable
from nbaccel.launch.wire.unpicklable import UnpicklableError
from nbaccel.notebook import tracker as _notebook_tracker  # noqa: F401 (log_with="notebook")
from nbaccel.notebook.kernel.detached import Run, attach, runs
from nbaccel.notebook.kernel.detached_pool import pools
from nbaccel.notebook.kernel.launcher import debug_launcher, notebook_launcher
from nbaccel.notebook.kernel.pool import attach_pool
from nbaccel.notebook.kernel.widgets.device_map_view import show_device_map
from nbaccel.training.accelerator.core import Accelerator
from nbaccel.training.config.configuration import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from nbaccel.training.config.kwargs_handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)
from nbaccel.training.step.batch_size import find_executable_batch_size
from nbaccel.training.step.local_sgd import LocalSGD
from nbaccel.training.strategies.deepspeed.plugin import DeepSpeedPlugin
from nbaccel.training.strategies.fsdp.plugin import FullyShardedDataParallelPlugin
from nbaccel.training.strategies.megatron.plugin import MegatronLMPlugin
from nbaccel.training.strategies.megatron.scheduler import MegatronLMDummyScheduler
from nbaccel.training.strategies.training_memory import gather_training_memory, training_memory

__version__ = "0.1.0"

# Accelerate's import paths (nbaccel.utils.*, nbaccel.logging, ...) and extra names: nbaccel.compat.
__getattr__ = _install_compat_paths(__name__)

__all__ = [
    "Accelerator",
    "Run",
    "RunStopped",
    "attach",
    "attach_pool",
    "pools",
    "runs",
    "AcceleratorState",
    "AutocastKwargs",
    "broadcast",
    "broadcast_object_list",
    "cpu_offload",
    "cpu_offload_with_hook",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "debug_launcher",
    "gather_training_memory",
    "training_memory",
    "detect_launch_environment",
    "detect_platform",
    "disk_offload",
    "dispatch_model",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "estimate_memory",
    "find_executable_batch_size",
    "FullyShardedDataParallelPlugin",
    "gather",
    "gather_object",
    "GradientAccumulationPlugin",
    "GradientState",
    "GradScalerKwargs",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "keep_logs",
    "InitProcessGroupKwargs",
    "LaunchRequest",
    "LaunchTimeout",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "LocalSGD",
    "MegatronLMDummyScheduler",
    "MegatronLMPlugin",
    "notebook_launcher",
    "pad_across_processes",
    "PartialState",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RankCrashed",
    "RankError",
    "ResultNotLoadable",
    "reduce",
    "send_to_device",
    "set_seed",
    "ShapeMismatchError",
    "show_device_map",
    "skip_first_batches",
    "UnpicklableError",
]


def load_ipython_extension(ipython):  # pragma: no cover - thin shim, tested via the kernel
    """``%load_ext nbaccel``: register the magics."""
    from nbaccel.notebook.kernel.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):  # pragma: no cover
    from nbaccel.notebook.kernel.magics import unload_ipython_extension as _unload

    _unload(ipython)
