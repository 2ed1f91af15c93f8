"""The XLA variant: ranks are torch-xla's processes (one per TPU chip, one thread per core in it).

The ``xla`` launcher forks each process from the driver, so the function and its arguments are
*inherited*, never pickled: a model built once in the notebook and passed in ``args`` is shared
copy-on-write by all processes instead of costing one copy of host RAM per process (the
Colab/Kaggle TPU situation). Inside each process, :func:`run_xla_process` runs the function on
every device of that process through torch-xla's own thread-per-device runner and returns the
results by global ordinal. Everything else (output, events, crash reports naming the signal and
the host-RAM hint, timeouts, interrupt) is the engine's, as for any other launcher.

Neither the kernel nor nbaccel's fork server initialises the XLA runtime: :func:`local_layout`
reads the host's chips without it. Each XLA process points torch-xla's persistent compile cache
at :func:`compile_cache_dir` before its runtime starts, so the next launch of the same code
finds its compiled graphs on disk instead of recompiling them (``NBACCEL_XLA_CACHE`` sets the
folder, ``NBACCEL_XLA_CACHE=off`` turns it off).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from nbaccel.launch.launchers.fork import ForkLauncher
from nbaccel.launch.wire.protocol import LaunchKind

__all__ = [
    "XLA_CACHE_VAR",
    "XLA_PROCESS_VAR",
    "XlaLauncher",
    "compile_cache_dir",
    "local_device_count",
    "local_layout",
    "local_process_count",
    "run_xla_process",
    "use_compile_cache",
]

#: The local index of an XLA process (set by the plan in each rank's environment).
XLA_PROCESS_VAR = "NBACCEL_XLA_PROCESS"
#: The persistent compile cache's folder (``off`` to turn it off).
XLA_CACHE_VAR = "NBACCEL_XLA_CACHE"


def _require_torch_xla() -> None:
    from nbaccel.distributed.environment import is_torch_xla_available

    if not is_torch_xla_available():
        raise ImportError(
            "A TPU launch needs torch-xla: pip install 'torch-xla' matching your torch version "
            "(or `pip install nbaccel[tpu]`)."
        )


def local_process_count() -> int:
    """How many processes torch-xla starts on this host (one per TPU chip; 1 on CPU)."""
    _require_torch_xla()
    from torch_xla import runtime as xr
    from torch_xla._internal import tpu

    try:
        from torch_xla.experimental import plugins
    except ImportError:  # older torch-xla: no dynamic plugins
        plugins = None
    if plugins is not None and plugins.using_dynamic_plugins():
        return plugins.default().physical_chip_count()
    return tpu.num_local_processes() if xr.device_type() == "TPU" else 1


def local_layout() -> tuple[int, int]:
    """``(processes, devices per process)`` torch-xla uses on this host, read without starting
    the XLA runtime: one process per TPU chip (2 devices per chip up to TPU v3); on the CPU one
    process with ``CPU_NUM_DEVICES`` devices (threads)."""
    processes = local_process_count()
    from torch_xla import runtime as xr

    kind = xr.device_type()
    if kind == "CPU":
        return processes, max(1, int(os.environ.get("CPU_NUM_DEVICES", "1")))
    if kind == "TPU":
        from torch_xla._internal import tpu

        try:
            return processes, tpu.num_logical_cores_per_chip()
        except Exception:  # no TPU metadata (an odd host): one device per chip
            return processes, 1
    return processes, 1


def local_device_count() -> int:
    """XLA devices on this host (the ranks of a launch): chips, or CPU_NUM_DEVICES on the CPU."""
    processes, per_process = local_layout()
    return processes * per_process


def compile_cache_dir() -> str | None:
    """Where the XLA processes keep compiled graphs between launches (None: turned off).

    ``$NBACCEL_XLA_CACHE``, else ``$XDG_CACHE_HOME/nbaccel/xla`` (``~/.cache/...``), one folder
    per device type and torch-xla version (entries of another version would not load)."""
    chosen = os.environ.get(XLA_CACHE_VAR)
    if chosen is not None and chosen.strip().lower() in ("", "0", "off", "none"):
        return None
    import torch_xla
    from torch_xla import runtime as xr

    if chosen:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    kind = (xr.device_type() or "xla").lower()
    return os.path.join(base, "nbaccel", "xla", f"{kind}-torch_xla-{torch_xla.__version__}")


def use_compile_cache(local_index: int) -> str | None:
    """Point torch-xla's persistent compile cache at :func:`compile_cache_dir` (before this
    process's runtime starts; only local process 0 writes, the others read). Returns the folder."""
    import torch_xla
    from torch_xla import runtime as xr

    path = compile_cache_dir()
    if path is None or torch_xla._XLAC._xla_computation_cache_is_initialized():
        return None
    os.makedirs(path, exist_ok=True)
    xr.initialize_cache(path, readonly=local_index != 0)
    return path


class XlaLauncher(ForkLauncher):
    """Fork torch-xla's processes from the driver; they inherit the work (no pickling)."""

    name = LaunchKind.XLA
    pickles_work = False

    def prepare(self) -> None:
        _require_torch_xla()
        import torch_xla

        if torch_xla._XLAC._xla_runtime_is_initialized():
            raise RuntimeError(
                "The XLA runtime is already initialised in this process (an XLA device or tensor "
                "was used before launching). Restart the kernel and call notebook_launcher "
                "before touching the XLA device in the notebook."
            )


class _Device:
    """What each device thread runs: the function, its errors tagged with the global ordinal."""

    def __init__(self, function: Callable[..., Any], args: tuple) -> None:
        self.function = function
        self.args = args

    def __call__(self, *_: Any) -> Any:
        import torch_xla.runtime as xr

        try:
            return self.function(*self.args)
        except BaseException as exc:
            exc._nbaccel_rank = xr.global_ordinal()  # the rank to name in the notebook
            raise


def run_xla_process(
    function: Callable[..., Any], args: tuple, local_processes: int
) -> dict[int, Any]:
    """Run ``function(*args)`` on every XLA device of this process; results by global ordinal.

    ``local_processes`` is 0 for torch-xla's single-process mode (``nprocs=1``: one device).
    The persistent compile cache is set up first (:func:`use_compile_cache`).
    """
    device = _Device(function, tuple(args))
    use_compile_cache(int(os.environ.get(XLA_PROCESS_VAR, "0")))
    if local_processes == 0:
        import torch_xla.distributed.xla_multiprocessing as xmp
        import torch_xla.runtime as xr

        out: dict[int, Any] = {}
        xmp.spawn(lambda _index: out.__setitem__(xr.global_ordinal(), device()), nprocs=1)
        return out
    from torch_xla._internal import pjrt

    return pjrt._run_thread_per_device(
        int(os.environ[XLA_PROCESS_VAR]),
        local_world_size=local_processes,
        fn=device,
        initializer_fn=pjrt.initialize_multiprocess,
    )
