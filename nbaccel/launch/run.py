"""One-shot launches: run a function once on a fresh group of ranks.

:func:`run_function` is what ``notebook_launcher`` and ``nbaccel.testing.run_on_ranks`` call:
pack the work (or hand it over in memory to fork-based launchers), start a group with the plan's
launcher variant, run the call through the driver loop, restart on failure when asked. The front
passes what the engine does not decide: the renderer, the worker hooks and the modules the fork
server preloads. :func:`launch_xla` is the same for torch-xla's processes.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from nbaccel.launch.driver.group import WorkerGroup
from nbaccel.launch.driver.loop import ONE_SHOT, CallReport, CallState, Settle, run_once
from nbaccel.launch.driver.renderer import Renderer, TextRenderer
from nbaccel.launch.host.host_ram import estimate_host_ram, warn_if_short
from nbaccel.launch.host.ports import free_port
from nbaccel.launch.launchers.xla import (
    XlaLauncher,
    local_layout,
    run_xla_process,
    use_compile_cache,
)
from nbaccel.launch.plan import LaunchPlan
from nbaccel.launch.request import Front, LaunchRequest
from nbaccel.launch.wire.errors import failure_text
from nbaccel.launch.wire.protocol import LaunchKind
from nbaccel.launch.wire.spec import Inline, Mode
from nbaccel.launch.wire.transport import Packed, pack

__all__ = ["launch_xla", "run_function"]


def run_function(
    plan: LaunchPlan,
    function: Callable[..., Any],
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    renderer: Renderer,
    setup: Iterable[Callable[[], None]] = (),
    preload: Iterable[str] = (),
    timeout: float | None = None,
    max_restarts: int = 0,
    interval: float = 0.2,
    policy: Settle = ONE_SHOT,
) -> CallReport:
    """Run ``function(*args, **kwargs)`` once on every rank of ``plan``; the call's report.

    Args:
        renderer: where the announcement, lines, events and notices go.
        setup: worker hooks (importable callables) run in each rank before the function.
        preload: modules the fork server imports once, before forking the ranks.
        timeout: seconds for the whole attempt, start included.
        max_restarts: failed attempts (not timeouts or interrupts) rerun on fresh ranks.
        interval: longest wait between two checks of the ranks.
    """
    __tracebackhide__ = True
    launcher = plan.make_launcher(preload)
    shared = None
    if launcher.pickles_work:  # raises UnpicklableError naming the object, before any process
        work, shared = pack(
            (function, tuple(args), dict(kwargs or {})),
            element_names=("function", "args", "kwargs"),
            inherit=launcher.forks_driver,
        )
    else:
        work = Inline(function, tuple(args), dict(kwargs or {}))
    renderer.start(plan.announcement(launcher.describe()), plan.num_processes)
    for line in plan.notices():  # never silently different from what was asked
        renderer.notice(line)
    ok, failed = False, None
    try:
        attempt = 0
        while True:
            port = plan.port if plan.port is not None else free_port()
            group = WorkerGroup(
                plan.num_processes,
                lambda i, port=port: plan.rank_env(i, port),
                renderer,
                launcher,
                mode=Mode.CALL,
                work=work,
                global_rank=plan.global_rank,
                setup=setup,
                local_rendezvous=plan.local_rendezvous,
                line_prefix=plan.line_prefix,
            )
            report = run_once(group, timeout, policy, interval)
            ok, failed = report.state == CallState.DONE, report.causes()
            retry = report.state == CallState.FAILED and attempt < max_restarts
            if not retry:
                return report
            attempt += 1
            exc = report.exception()
            renderer.notice(
                f"{failure_text(exc)}; restarting all ranks (restart {attempt} of {max_restarts})."
            )
    except KeyboardInterrupt:
        failed = []  # nobody's failure: every rank was stopped
        raise
    finally:
        if shared is not None:
            shared.release()
        if isinstance(work, Packed):
            work.forget_inherited()
        renderer.finish(ok, failed)


def launch_xla(
    function: Callable[..., Any],
    args: tuple = (),
    request: LaunchRequest | None = None,
    *,
    renderer: Renderer | None = None,
    setup: Iterable[Callable[[], None]] = (),
    preload: Iterable[str] = (),
    front: Front = Front.LAUNCHER,
    **options: Any,
) -> list[Any]:
    """Run ``function(*args)`` on every XLA device, as ``request`` says (without one,
    ``options`` are its keywords: ``num_processes=1``); the results by global rank (ordinal).

    ``num_processes`` defaults to the local devices (one per TPU chip; ``CPU_NUM_DEVICES`` on
    the CPU). With one device and no ``num_processes`` the function runs here, in this process
    (a TPU v5e-1: there is nothing to fork), and the announcement says so. ``num_processes=1``
    runs on one device in a forked process (torch-xla's ``nprocs=1``); any other value uses
    every device torch-xla sees (it cannot use a subset: limit devices with
    ``TPU_NUM_DEVICES`` / ``CPU_NUM_DEVICES`` instead), with a warning when the numbers differ.
    With ``start_method`` ``"auto"`` or ``"fork"`` (the Colab/Kaggle way) the processes inherit
    the function and its arguments (a model passed in ``args`` is shared, not copied). Before
    anything starts: an XLA runtime already initialised here is refused (a forked process could
    not use it), and a :class:`~nbaccel.launch.host.host_ram.HostRamWarning` is given when the
    ranks would need more host RAM than is available.
    """
    __tracebackhide__ = True
    if request is None:
        request = LaunchRequest.create(front, **options)
    elif options:
        raise TypeError(f"pass either a LaunchRequest or its options, not both: {sorted(options)}")
    plan = LaunchPlan.create(front, request, xla=True)
    renderer = renderer or TextRenderer()
    processes, per_process = local_layout()  # ImportError naming torch-xla when it is absent
    from torch_xla import runtime as xr

    single = plan.num_processes == 1
    devices = 1 if single else processes * per_process
    warn_if_short(
        estimate_host_ram(args, devices, device_copies_in_host_ram=xr.device_type() == "CPU"),
        "TPU_NUM_DEVICES / CPU_NUM_DEVICES",
    )
    if plan.defaulted and devices == 1:
        return [_run_in_this_process(function, args, renderer)]
    if plan.kind == LaunchKind.XLA:
        XlaLauncher().prepare()  # refuse an initialised runtime before asking torch-xla anything
    report = run_function(
        dataclasses.replace(plan, num_processes=1 if single else processes),
        run_xla_process,
        (function, tuple(args), 0 if single else processes),
        renderer=renderer,
        setup=setup,
        preload=preload,
        timeout=request.timeout,
    )
    results: dict[int, Any] = {}
    for by_ordinal in report.values():
        results.update(by_ordinal)
    if not plan.defaulted and plan.num_processes != len(results):
        warnings.warn(
            f"num_processes={plan.num_processes} but torch-xla ran on {len(results)} devices "
            "(it always uses every device it sees).",
            stacklevel=2,
        )
    return [results[rank] for rank in sorted(results)]


def _run_in_this_process(function: Callable[..., Any], args: tuple, renderer: Renderer) -> Any:
    """One XLA device: run the function here (the XLA runtime then lives in this process)."""
    renderer.start(
        "Running in this process on its one XLA device (one chip: nothing to fork); the XLA "
        "runtime now stays initialised here.",
        1,
    )
    ok = False
    try:
        use_compile_cache(0)
        (result,) = run_xla_process(function, tuple(args), 0).values()
        ok = True
        return result
    finally:
        renderer.finish(ok)
