"""``notebook_launcher`` and ``debug_launcher``: run a function on N ranks from a notebook.

Accelerate's signature, with what nbaccel adds: per-rank return values, the original exception
type naming the rank, live rank-labelled output, interrupt and timeout that stop every rank, a
free port by default, CUDA-safe start through a fork server with torch preloaded.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from nbaccel.distributed.state import MIXED_PRECISION_CHOICES
from nbaccel.launch.errors import LaunchTimeout, RankCrashed, rebuild_exception
from nbaccel.launch.group import Outcome, WorkerGroup
from nbaccel.launch.plan import (
    LaunchPlan,
    free_port,
    resolve_start_method,
    worker_hooks,
)
from nbaccel.launch.processes import describe_exit
from nbaccel.launch.render import Renderer, TextRenderer
from nbaccel.launch.transport import pack

__all__ = ["debug_launcher", "notebook_launcher"]

_FAILURE_GRACE = 0.5  # seconds the other ranks get to finish on their own after a failure
_STOP_GRACE = 2.0  # then SIGTERM, and SIGKILL this long after


def _check_port(port: int, host: str) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host in ("127.0.0.1", "localhost") else "", port))
        except OSError:
            raise ValueError(
                f"use_port={port} is already in use on this machine (perhaps by an earlier "
                "launch that is still running); pass use_port=None to let nbaccel pick a free "
                "port, or choose another one."
            ) from None


def _validate(
    function: Any,
    num_processes: int,
    mixed_precision: str,
    num_nodes: int,
    node_rank: int,
    start_method: str,
    rdzv_backend: str,
) -> None:
    if not callable(function):
        raise TypeError(
            f"notebook_launcher needs a callable to run on each rank, got "
            f"{type(function).__name__}; pass the function itself (no parentheses)."
        )
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}.")
    if str(mixed_precision).lower() not in MIXED_PRECISION_CHOICES:
        raise ValueError(
            f"Unknown mixed_precision {mixed_precision!r}; choose one of "
            f"{', '.join(MIXED_PRECISION_CHOICES)}."
        )
    if num_nodes < 1 or not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank must be in [0, num_nodes={num_nodes}), got {node_rank}.")
    if rdzv_backend not in ("static", "c10d"):
        raise ValueError(f"rdzv_backend must be 'static' or 'c10d', got {rdzv_backend!r}.")
    gpus = torch.cuda.device_count()
    if gpus and num_processes > gpus:
        raise ValueError(
            f"num_processes={num_processes} but this machine has {gpus} GPU(s); use at most "
            f"{gpus}, or debug_launcher for CPU ranks."
        )


def _announce(num_processes: int, num_nodes: int, cpu: bool, defaulted: bool) -> str:
    gpus = 0 if cpu else torch.cuda.device_count()
    if gpus:
        what = f"{num_processes} GPU{'s' if num_processes > 1 else ''} (nccl)"
    else:
        what = f"{num_processes} CPU process{'es' if num_processes > 1 else ''} (gloo)"
    text = f"Launching on {what}"
    if num_nodes > 1:
        text += f" per node, {num_nodes} nodes"
    if defaulted:
        text += "; num_processes was not given: " + (
            f"using the {gpus} GPU(s) found" if gpus else "no GPU found, using 1"
        )
    return text + "."


def _default_renderer() -> Renderer:
    try:
        from nbaccel.notebook.kernel.renderers import choose_renderer
    except ImportError:
        return TextRenderer()
    return choose_renderer()


def _tpu_requested() -> bool:
    """True on a TPU host with torch-xla, or when NBACCEL_XLA_LAUNCH=1 asks for the XLA path
    explicitly (the torch-xla lane uses it with PJRT_DEVICE=CPU)."""
    from nbaccel.distributed.environment import is_torch_xla_available, is_tpu_requested

    if not is_torch_xla_available():
        return False
    if os.environ.get("NBACCEL_XLA_LAUNCH") == "1":
        return True
    return is_tpu_requested() and os.environ.get("PJRT_DEVICE", "TPU") != "CPU"


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: int | str | None = None,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    start_method: str = "auto",
    timeout: float | None = None,
    *,
    cpu: bool = False,
    renderer: Renderer | None = None,
    memory: bool = True,
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` ranks and return their results by rank.

    Output streams into the notebook as whole, rank-labelled lines while the function runs. The
    first failing rank's exception is raised here with its original type, naming the rank; the
    other ranks are stopped. ``timeout`` (seconds) bounds the whole launch. tqdm bars on the
    ranks become live progress; ``memory=False`` turns off the per-rank memory monitor.
    """
    __tracebackhide__ = True  # IPython: show the rank's frames, not the launcher's
    if _tpu_requested():
        from nbaccel.launch.xla import launch_xla

        return launch_xla(function, args, num_processes or 8, start_method="fork")
    defaulted = num_processes is None
    if num_processes is None:
        num_processes = (0 if cpu else torch.cuda.device_count()) or 1
    _validate(
        function, num_processes, mixed_precision, num_nodes, node_rank, start_method, rdzv_backend
    )
    method = resolve_start_method(start_method)
    if num_nodes > 1 and use_port is None and not rdzv_endpoint:
        raise ValueError("a multi-node launch needs use_port (the same on every node).")
    if rdzv_endpoint and use_port is None:
        master_addr, _, port_text = rdzv_endpoint.rpartition(":")
        use_port = int(port_text)
    if use_port is not None and node_rank == 0:
        _check_port(int(use_port), master_addr)
    payload, shared = pack(  # raises UnpicklableError naming the object, before any process
        (function, tuple(args), {}), element_names=("function", "args", "kwargs")
    )
    plan = LaunchPlan(num_processes, num_nodes, node_rank, master_addr, mixed_precision, cpu)
    renderer = renderer or _default_renderer()
    renderer.start(_announce(num_processes, num_nodes, cpu, defaulted), num_processes)
    ok = False
    try:
        attempt = 0
        while True:
            port = int(use_port) if use_port is not None else free_port()
            group = WorkerGroup(
                num_processes,
                lambda i, port=port: plan.rank_env(i, port),
                renderer,
                start_method=method,
                mode="call",
                payload=payload,
                global_rank=plan.global_rank,
                setup=worker_hooks(memory),
                local_rendezvous=num_nodes == 1,
            )
            try:
                results = _run_once(group, timeout, monitor_interval)
                ok = True
                return results
            except (KeyboardInterrupt, LaunchTimeout):
                raise
            except BaseException as exc:
                if attempt >= max_restarts:
                    raise
                attempt += 1
                renderer.notice(
                    f"{type(exc).__name__}: {exc}; restarting all ranks "
                    f"(restart {attempt} of {max_restarts})."
                )
    finally:
        if shared is not None:
            shared.release()
        renderer.finish(ok)


def _run_once(group: WorkerGroup, timeout: float | None, monitor_interval: float) -> list[Any]:
    """Run the group's single call; return results by rank or raise the first failure."""
    __tracebackhide__ = True  # IPython: show the rank's frames, not the launcher's
    num_processes = group.num_processes
    renderer = group.renderer
    group.expect_call(0)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        group.start()
        failed = _wait(group, deadline, monitor_interval)
        if failed is None and len(group.outcomes(0)) < num_processes:
            running = [r for r in group.ranks if r not in group.outcomes(0)]
            group.stop(_STOP_GRACE)
            raise LaunchTimeout(
                f"the launch exceeded timeout={timeout} s; rank(s) {running} were still running "
                "and have been stopped."
            )
        if failed is not None:
            group.pump_until(lambda: len(group.outcomes(0)) == num_processes, _FAILURE_GRACE)
            group.stop(_STOP_GRACE)
            rank, outcome = _first_failure(group)
            raise _as_exception(rank, outcome)
        return [group.outcomes(0)[r].value for r in group.ranks]
    except KeyboardInterrupt:
        renderer.notice("interrupted: stopping every rank")
        group.stop(1.5, first=signal.SIGINT)
        raise
    finally:
        group.close()


def _first_failure(group: WorkerGroup) -> tuple[int, Outcome] | None:
    """The earliest failure (by when it happened), not the lowest rank: a peer's error is often
    the consequence of the first one (a collective broken by the failed rank)."""
    failures = [(o.at, rank, o) for rank, o in group.outcomes(0).items() if o.kind != "result"]
    if not failures:
        return None
    _, rank, outcome = min(failures, key=lambda f: (f[0], f[1]))
    return rank, outcome


def _wait(group: WorkerGroup, deadline: float | None, interval: float):
    def finished() -> bool:
        return _first_failure(group) is not None or len(group.outcomes(0)) == group.num_processes

    while not finished():
        if deadline is not None and time.monotonic() >= deadline:
            return None
        group.pump(max(0.01, min(interval, 0.2)))
    return _first_failure(group)


def _as_exception(rank: int, outcome: Outcome) -> BaseException:
    if outcome.kind == "error":
        return rebuild_exception(outcome.value, rank)
    return RankCrashed(rank, outcome.value, describe_exit(outcome.value))


def debug_launcher(
    function: Callable[..., Any], args: tuple = (), num_processes: int = 2
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` CPU ranks (gloo) to debug distributed code."""
    __tracebackhide__ = True  # IPython: show the rank's frames, not the launcher's
    return notebook_launcher(function, args, num_processes=num_processes, cpu=True)
