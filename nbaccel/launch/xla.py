"""Launch a function on every TPU core (or the XLA CPU device) through torch-xla's process model.

``notebook_launcher`` calls :func:`launch_xla` when a TPU is detected. torch-xla starts one
process per TPU chip and one thread per core in it (``xmp.spawn`` semantics); with
``start_method="fork"`` (the Colab/Kaggle default) the function and its arguments are *inherited*
by the children, never pickled: a model built once in the notebook and passed in ``args`` is
shared copy-on-write by all processes instead of costing one copy of host RAM per process.

A process that dies without reporting (SIGKILL from the OOM killer, SIGSEGV) is reported as
:class:`nbaccel.launch.errors.RankCrashed` naming the signal, the ranks it ran and the host-RAM
hint, instead of torch-xla's bare "process pool was terminated abruptly".
"""

from __future__ import annotations

import functools
import os
import signal
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

__all__ = ["launch_xla"]

# (function, args) for forked children: they inherit this instead of unpickling a copy.
_PENDING: tuple[Callable[..., Any], tuple] | None = None


class _Entry:
    """What each device thread runs: record (pid, ordinal), call the function, tag errors."""

    def __init__(self, payload: bytes | None, marker_dir: str) -> None:
        self.payload = payload  # cloudpickled (function, args) for spawn; None under fork
        self.marker_dir = marker_dir

    def __call__(self, *_: Any) -> Any:
        import cloudpickle
        import torch_xla.runtime as xr

        ordinal = xr.global_ordinal()
        open(os.path.join(self.marker_dir, f"{os.getpid()}.{ordinal}"), "w").close()
        function, args = _PENDING if self.payload is None else cloudpickle.loads(self.payload)
        try:
            return function(*args)
        except Exception as exc:
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (f"[rank {ordinal}] {exc.args[0]}", *exc.args[1:])
            raise


def _local_process_count() -> int:
    """How many processes torch-xla starts on this host (one per TPU chip; 1 on CPU)."""
    from torch_xla import runtime as xr
    from torch_xla._internal import tpu

    try:
        from torch_xla.experimental import plugins

        if plugins.using_dynamic_plugins():
            return plugins.default().physical_chip_count()
    except ImportError:
        pass
    return tpu.num_local_processes() if xr.device_type() == "TPU" else 1


def _describe(returncode: int) -> str:
    try:
        from nbaccel.launch.processes import describe_exit

        return describe_exit(returncode)
    except ImportError:  # pragma: no cover - the launcher package is always there
        if returncode < 0:
            return f"was killed by {signal.Signals(-returncode).name}"
        return f"exited with code {returncode}"


def _crash_error(processes: dict[int, Any], marker_dir: str) -> BaseException:
    """The RankCrashed for the process that died first (SIGTERMs are the pool's clean-up)."""
    from nbaccel.launch.errors import RankCrashed

    codes = {pid: p.exitcode for pid, p in processes.items()}
    dead = [(pid, c) for pid, c in codes.items() if c is not None and c != 0]
    dead.sort(key=lambda item: item[1] == -signal.SIGTERM)
    if not dead:
        return RankCrashed(-1, 0, "ended abruptly (torch-xla's process pool broke)")
    pid, code = dead[0]
    ranks = sorted(int(n.split(".")[1]) for n in os.listdir(marker_dir) if n.startswith(f"{pid}."))
    who = ranks[0] if ranks else -1
    detail = f"(TPU process {pid}, ranks {ranks or 'unknown'}) {_describe(code)}"
    return RankCrashed(who, code, detail)


def _run_pool(entry: _Entry, start_method: str) -> dict[int, Any]:
    """torch-xla's multi-process run, keeping hold of the processes to read their exit codes."""
    import torch.multiprocessing as tmp
    import torch_xla
    from torch_xla._internal import pjrt

    if torch_xla._XLAC._xla_runtime_is_initialized():
        raise RuntimeError(
            "The XLA runtime is already initialised in this process (an XLA device or tensor was "
            "used before launching). Restart the kernel and call notebook_launcher before "
            "touching the XLA device in the notebook."
        )
    count = _local_process_count()
    task = functools.partial(
        pjrt._run_thread_per_device,
        local_world_size=count,
        fn=entry,
        initializer_fn=pjrt.initialize_multiprocess,
    )
    results: dict[int, Any] = {}
    broken: BrokenProcessPool | None = None
    with ProcessPoolExecutor(max_workers=count, mp_context=tmp.get_context(start_method)) as pool:
        futures = [pool.submit(task, rank) for rank in range(count)]
        processes = pool._processes  # the same dict object the pool fills; read after a crash
        try:
            for future in futures:
                results.update(future.result())
        except BrokenProcessPool as exc:
            broken = exc
    if broken is not None:  # read exit codes only now: the pool has joined (reaped) every process
        raise _crash_error(dict(processes or {}), entry.marker_dir) from broken
    return results


def launch_xla(
    function: Callable[..., Any],
    args: tuple = (),
    num_processes: int | None = None,
    start_method: str = "fork",
) -> list[Any]:
    """Run ``function(*args)`` on every XLA device and return the results by global rank.

    ``num_processes=1`` runs the function here, on one device (torch-xla's ``nprocs=1``); any
    other value uses every device torch-xla sees (it cannot use a subset: limit devices with
    ``TPU_NUM_DEVICES`` / ``CPU_NUM_DEVICES`` instead).
    """
    global _PENDING
    from nbaccel.distributed.environment import is_torch_xla_available

    if not is_torch_xla_available():
        raise ImportError(
            "A TPU launch needs torch-xla: pip install 'torch-xla' matching your torch version "
            "(or `pip install nbaccel[tpu]`)."
        )
    if start_method not in ("fork", "spawn", "forkserver"):
        raise ValueError(
            f"start_method must be 'fork', 'spawn' or 'forkserver', not {start_method!r}"
        )
    args = tuple(args)
    with tempfile.TemporaryDirectory(prefix="nbaccel-xla-") as marker_dir:
        if num_processes == 1:
            import torch_xla.distributed.xla_multiprocessing as xmp

            out: list[Any] = []
            _PENDING = (function, args)
            try:
                xmp.spawn(lambda _index: out.append(_Entry(None, marker_dir)()), nprocs=1)
            finally:
                _PENDING = None
            return out
        payload = None
        if start_method != "fork":
            import cloudpickle

            payload = cloudpickle.dumps((function, args))
        _PENDING = (function, args)
        try:
            results = _run_pool(_Entry(payload, marker_dir), start_method)
        finally:
            _PENDING = None
    if num_processes is not None and num_processes != len(results):
        warnings.warn(
            f"num_processes={num_processes} but torch-xla ran on {len(results)} devices (it "
            "always uses every device it sees).",
            stacklevel=2,
        )
    return [results[rank] for rank in sorted(results)]
