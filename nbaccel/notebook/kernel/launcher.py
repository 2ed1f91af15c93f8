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
from collections.abc import Callable
from typing import Any

from nbaccel.distributed.environment import is_torch_xla_available, is_tpu_requested
from nbaccel.distributed.host_info import check_fp8_launch
from nbaccel.launch.driver.child_failed import as_child_failed
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.plan import LaunchPlan, check_call
from nbaccel.launch.request import Front, LaunchRequest
from nbaccel.launch.run import launch_xla, run_function
from nbaccel.notebook.kernel.detached import Run
from nbaccel.notebook.kernel.widget_renderer import choose_renderer
from nbaccel.notebook.preload import WORKER_PRELOAD
from nbaccel.notebook.rank.instrumentation import worker_setup
from nbaccel.values.booleans import env_flag

__all__ = ["debug_launcher", "launch_request", "notebook_launcher", "start_detached"]


def _tpu_requested() -> bool:
    """True on a TPU host with torch-xla, or when NBACCEL_XLA_LAUNCH=1 asks for the XLA path
    explicitly (the torch-xla lane uses it with PJRT_DEVICE=CPU). The environment is read
    first: looking for torch-xla lists every ``sys.path`` folder that changed, per launch."""
    if env_flag("NBACCEL_XLA_LAUNCH"):
        return is_torch_xla_available()
    tpu = is_tpu_requested() and os.environ.get("PJRT_DEVICE", "TPU") != "CPU"
    return tpu and is_torch_xla_available()


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
    log_line_prefix_template: str | None = None,
    *,
    renderer: Renderer | None = None,
    **options: Any,
) -> list[Any] | Run:
    """Run ``function(*args)`` on ``num_processes`` ranks and return their results by rank.

    Output streams into the notebook as whole, rank-labelled lines while the function runs. The
    first failing rank's exception is raised here with its original type, naming the rank (and
    an instance of torch elastic's ``ChildFailedError`` too, as Accelerate raises); the
    other ranks are stopped. ``num_processes`` defaults to one rank per GPU, else 1 (on TPUs
    one per local chip; with a single chip the function runs in the kernel, see
    ``nbaccel.launch.run.launch_xla``).
    On a TPU host the ranks are torch-xla's processes, forked so that they share the arguments.

    The positional parameters are Accelerate's. Every option, these and nbaccel's own keywords
    (``timeout``, ``start_method``, ``cpu``, ``memory``; ranks on other hosts with
    ``hosts=["node1:4", "node2:4"]`` or ``launcher="slurm"``, tuned by ``python``, ``cwd``,
    ``env``, ``ssh_args``, ``srun_args``, ``channel_address``), is defined, with its help and
    checks, in :class:`nbaccel.launch.request.LaunchRequest`.

    ``detach=True`` returns a :class:`~nbaccel.notebook.kernel.detached.Run` at once instead:
    the ranks run under this user's supervisor and outlive the kernel (see ``nbaccel.attach``).
    """
    __tracebackhide__ = True  # IPython: show the rank's frames, not the launcher's
    request = LaunchRequest.create(
        Front.LAUNCHER,
        num_processes=num_processes,
        mixed_precision=mixed_precision,
        use_port=use_port,
        master_addr=master_addr,
        node_rank=node_rank,
        num_nodes=num_nodes,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_conf=rdzv_conf,
        rdzv_id=rdzv_id,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        log_line_prefix_template=log_line_prefix_template,
        **options,
    )
    return launch_request(function, args, request, renderer)


def launch_request(
    function: Callable[..., Any],
    args: tuple,
    request: LaunchRequest,
    renderer: Renderer | None = None,
) -> list[Any] | Run:
    """Run ``function(*args)`` as ``request`` says, from the notebook: the ranks' results
    (a :class:`~nbaccel.notebook.kernel.detached.Run` with ``request.detach``).

    What the notebook adds to the engine: the renderer (widgets in Jupyter, else text), the
    worker hooks (tqdm bridge, memory sampler) and the modules the fork server preloads.
    """
    __tracebackhide__ = True
    check_fp8_launch(request.mixed_precision, request.cpu)  # before any rank starts
    if not callable(function):
        raise TypeError(
            f"notebook_launcher needs a callable to run on each rank, got "
            f"{type(function).__name__}; pass the function itself (no parentheses)."
        )
    args = check_call(args)
    xla = request.remote is None and _tpu_requested()
    if xla and (request.num_nodes != 1 or request.max_restarts):
        raise ValueError(
            "a TPU launch runs torch-xla's processes on this host once: leave num_nodes=1 "
            "and max_restarts=0."
        )
    hooks = worker_setup(memory=request.memory)
    if request.detach:
        if xla:
            raise ValueError(
                "detach=True is not available for a TPU launch (torch-xla's processes share "
                "the launching process's runtime): leave detach out on a TPU host."
            )
        # checked here, before anything starts (the run's own process plans it again)
        plan = LaunchPlan.create(Front.LAUNCHER, request)
        return start_detached(function, args, request, hooks, WORKER_PRELOAD, plan.num_processes)
    renderer = renderer or choose_renderer()
    if xla:
        return launch_xla(function, args, request, renderer=renderer, setup=hooks)
    try:
        report = run_function(
            LaunchPlan.create(Front.LAUNCHER, request),
            function,
            args,
            renderer=renderer,
            setup=hooks,
            preload=WORKER_PRELOAD,
            timeout=request.timeout,
            max_restarts=request.max_restarts,
            interval=request.monitor_interval,
        )
    except KeyboardInterrupt:  # the stop button: the engine's frames (selectors...) are noise
        raise KeyboardInterrupt from None
    failure = report.exception()
    if failure is not None:
        if hasattr(failure, "rank"):  # also what Accelerate's elastic launch raises
            failure = as_child_failed(failure, getattr(function, "__name__", repr(function)))
        raise failure  # the rank's own exception, re-raised in the notebook
    return report.values()


def start_detached(
    function: Callable[..., Any],
    args: tuple,
    request: LaunchRequest,
    setup: Any = (),
    preload: Any = (),
    num_processes: int | None = None,
) -> Run:
    """Hand ``function(*args)`` to this user's supervisor (``request.detach``): the
    :class:`~nbaccel.notebook.kernel.detached.Run`, at once. Its ranks outlive this process."""
    from nbaccel.launch.detached.handle import submit

    folder = submit(
        function, args, request, setup=setup, preload=preload, num_processes=num_processes
    )
    run = Run(folder.id)
    print(f"[nbaccel] detached run {run.id} ({run.info.name}) started: nbaccel.attach("
          f"{run.id!r}) follows it from any notebook, `nbaccel runs logs {run.id} --follow` "
          "from a shell.")  # fmt: skip
    return run


def debug_launcher(
    function: Callable[..., Any], args: tuple = (), num_processes: int = 2
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` CPU ranks (gloo) to debug distributed code."""
    __tracebackhide__ = True  # IPython: show the rank's frames, not the launcher's
    return notebook_launcher(function, args, num_processes=num_processes, cpu=True)
