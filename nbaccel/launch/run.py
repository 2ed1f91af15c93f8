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

from nbaccel.launch.driver import ONE_SHOT, CallReport, CallState, Settle, run_once
from nbaccel.launch.group import WorkerGroup
from nbaccel.launch.launchers import make_launcher
from nbaccel.launch.launchers.xla import XlaLauncher, local_process_count, run_xla_process
from nbaccel.launch.plan import Front, LaunchPlan, free_port
from nbaccel.launch.render import Renderer, TextRenderer
from nbaccel.launch.spec import Inline, Mode
from nbaccel.launch.transport import Packed, pack

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
    launcher = make_launcher(plan.kind, preload=tuple(preload), **plan.launcher_options())
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
    ok = False
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
            )
            report = run_once(group, timeout, policy, interval)
            ok = report.state == CallState.DONE
            retry = report.state == CallState.FAILED and attempt < max_restarts
            if not retry:
                return report
            attempt += 1
            exc = report.exception()
            renderer.notice(
                f"{type(exc).__name__}: {exc}; restarting all ranks "
                f"(restart {attempt} of {max_restarts})."
            )
    finally:
        if shared is not None:
            shared.release()
        if isinstance(work, Packed):
            work.forget_inherited()
        renderer.finish(ok)


def launch_xla(
    function: Callable[..., Any],
    args: tuple = (),
    num_processes: int | None = None,
    start_method: str = "fork",
    *,
    renderer: Renderer | None = None,
    mixed_precision: str = "no",
    timeout: float | None = None,
    setup: Iterable[Callable[[], None]] = (),
    preload: Iterable[str] = (),
    front: Front = Front.NOTEBOOK,
) -> list[Any]:
    """Run ``function(*args)`` on every XLA device; the results by global rank (ordinal).

    ``num_processes=1`` runs on one device (torch-xla's ``nprocs=1``); any other value uses
    every device torch-xla sees (it cannot use a subset: limit devices with
    ``TPU_NUM_DEVICES`` / ``CPU_NUM_DEVICES`` instead), with a warning when the numbers differ.
    With ``start_method="fork"`` (the Colab/Kaggle default) the processes inherit the function
    and its arguments (a model passed in ``args`` is shared, not copied).
    """
    __tracebackhide__ = True
    plan = LaunchPlan.create(
        front,
        num_processes,
        start_method=start_method,
        xla=True,
        mixed_precision=mixed_precision,
    )
    if plan.kind == "xla":
        XlaLauncher().prepare()  # refuse an initialised runtime before asking torch-xla anything
    single = plan.num_processes == 1
    processes = 1 if single else local_process_count()
    report = run_function(
        dataclasses.replace(plan, num_processes=processes),
        run_xla_process,
        (function, tuple(args), 0 if single else processes),
        renderer=renderer or TextRenderer(),
        setup=setup,
        preload=preload,
        timeout=timeout,
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
