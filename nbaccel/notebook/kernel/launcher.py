"""``notebook_launcher`` and ``debug_launcher``: run a function on N ranks from a notebook.

Accelerate's signature, with what nbaccel adds: per-rank return values, the original exception
type naming the rank, live rank-labelled output, interrupt and timeout that stop every rank, a
free port by default, CUDA-safe start through a fork server with torch preloaded.

This is a front on the launch engine: it chooses what the engine leaves open, the renderer
(widgets in Jupyter, text elsewhere), the worker hooks (tqdm bridge, memory sampler) and the
modules the fork server preloads; ``nbaccel.launch.plan.LaunchPlan`` decides the rest.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nbaccel.distributed.environment import is_torch_xla_available, is_tpu_requested
from nbaccel.launch.child_failed import as_child_failed
from nbaccel.launch.plan import Front, LaunchPlan, check_call, default_num_processes
from nbaccel.launch.remote.options import remote_options
from nbaccel.launch.render import Renderer
from nbaccel.launch.run import launch_xla, run_function
from nbaccel.notebook.kernel.renderers import choose_renderer
from nbaccel.notebook.preload import WORKER_PRELOAD
from nbaccel.notebook.rank.instrumentation import worker_setup

__all__ = ["debug_launcher", "notebook_launcher"]


def _tpu_requested() -> bool:
    """True on a TPU host with torch-xla, or when NBACCEL_XLA_LAUNCH=1 asks for the XLA path
    explicitly (the torch-xla lane uses it with PJRT_DEVICE=CPU)."""
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
    hosts: str | Sequence[str] | None = None,
    launcher: str | None = None,
    python: str | None = None,
    cwd: str | None = None,
    env: Mapping[str, str] | Sequence[str] | None = None,
    ssh_args: Sequence[str] | None = None,
    srun_args: Sequence[str] | None = None,
    channel_address: str | None = None,
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` ranks and return their results by rank.

    Output streams into the notebook as whole, rank-labelled lines while the function runs. The
    first failing rank's exception is raised here with its original type, naming the rank (and
    an instance of torch elastic's ``ChildFailedError`` too, as Accelerate raises); the other
    ranks are stopped. ``timeout`` (seconds) bounds the whole launch. tqdm bars on the
    ranks become live progress; ``memory=False`` turns off the per-rank memory monitor.
    ``num_processes`` defaults to one rank per GPU, else 1 (8 on TPUs; see
    ``nbaccel.launch.plan``). ``rdzv_conf`` and ``rdzv_id`` are refused unless left at their
    defaults: the world is formed through ``master_addr``/``use_port`` (or ``rdzv_endpoint``).
    On a TPU host the ranks are torch-xla's processes, forked so that they share the arguments.

    Many hosts: ``hosts=["node1:4", "node2:4"]`` runs the ranks there through ssh (one agent per
    host), ``launcher="slurm"`` on the nodes of the SLURM allocation this kernel runs in.
    ``python`` (the hosts' interpreter), ``cwd`` (their working directory), ``env`` (names of
    this kernel's variables to forward, or a dict), ``ssh_args``/``srun_args`` (extra
    arguments) and ``channel_address`` (this machine's address the hosts reach) tune it.
    """
    __tracebackhide__ = True  # IPython: show the rank's frames, not the launcher's
    if not callable(function):
        raise TypeError(
            f"notebook_launcher needs a callable to run on each rank, got "
            f"{type(function).__name__}; pass the function itself (no parentheses)."
        )
    args = check_call(args, timeout=timeout, max_restarts=max_restarts)
    remote = None
    if hosts is not None or launcher is not None:
        remote = remote_options(
            launcher or "ssh",
            num_processes,
            hosts,
            python=python,
            cwd=cwd,
            env=env,
            ssh_args=ssh_args,
            srun_args=srun_args,
            channel_address=channel_address,
        )
    hooks = worker_setup(memory=memory)
    renderer = renderer or choose_renderer()
    if remote is None and _tpu_requested():
        if num_nodes != 1 or max_restarts:
            raise ValueError(
                "a TPU launch runs torch-xla's processes on this host once: leave num_nodes=1 "
                "and max_restarts=0."
            )
        return launch_xla(
            function,
            args,
            num_processes or default_num_processes(Front.NOTEBOOK, xla=True),
            "fork",
            renderer=renderer,
            mixed_precision=mixed_precision,
            timeout=timeout,
            setup=hooks,
        )
    plan = LaunchPlan.create(
        Front.NOTEBOOK,
        num_processes,
        start_method=start_method,
        cpu=cpu,
        mixed_precision=mixed_precision,
        num_nodes=num_nodes,
        node_rank=node_rank,
        master_addr=master_addr,
        use_port=use_port,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_conf=rdzv_conf,
        rdzv_id=rdzv_id,
        remote=remote,
    )
    report = run_function(
        plan,
        function,
        args,
        renderer=renderer,
        setup=hooks,
        preload=WORKER_PRELOAD,
        timeout=timeout,
        max_restarts=max_restarts,
        interval=monitor_interval,
    )
    failure = report.exception()
    if failure is not None:
        if hasattr(failure, "rank"):  # also what Accelerate's elastic launch raises
            failure = as_child_failed(failure, getattr(function, "__name__", repr(function)))
        raise failure  # the rank's own exception, re-raised in the notebook
    return report.values()


def debug_launcher(
    function: Callable[..., Any], args: tuple = (), num_processes: int = 2
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` CPU ranks (gloo) to debug distributed code."""
    __tracebackhide__ = True  # IPython: show the rank's frames, not the launcher's
    return notebook_launcher(function, args, num_processes=num_processes, cpu=True)
