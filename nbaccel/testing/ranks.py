"""Run a test function on N real processes (CPU, gloo) and report every rank's failure.

``run_on_ranks(fn, num_processes=2)`` runs ``fn(*args)`` once on every rank through the launch
engine (the same fork server with torch preloaded, driver loop and exit descriptions as
``notebook_launcher``), with the torchrun-style variables set, and returns the per-rank results.
If any rank fails, a :class:`RankFailures` error carries every failing rank's traceback; a rank
that hangs past ``timeout`` is killed and reported, so no test can hang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from nbaccel.launch.driver.loop import CallReport, CallState, Settle
from nbaccel.launch.driver.renderer import TextRenderer
from nbaccel.launch.host.ports import free_port
from nbaccel.launch.host.processes import describe_exit
from nbaccel.launch.plan import LaunchPlan, check_call
from nbaccel.launch.request import Front, LaunchRequest
from nbaccel.launch.run import run_function
from nbaccel.launch.wire.protocol import OutcomeKind
from nbaccel.launch.wire.tracebacks import format_frames

__all__ = ["RankFailures", "free_port", "run_on_ranks"]

#: what the harness's fork server imports once (the ranks' usual first imports)
PRELOAD = ("nbaccel.distributed.state", "nbaccel.distributed.collectives")
_PEER_GRACE_S = 5.0  # a failed rank usually leaves its peers stuck in a collective


class RankFailures(AssertionError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


def _failure_text(report: CallReport, rank: int, timeout: float) -> str:
    outcome = report.outcomes.get(rank)
    if rank in report.stuck:  # no outcome after the grace period: the harness stopped it
        if report.state == CallState.TIMEOUT:
            return f"timed out after {timeout:g} s (killed)"
        return f"still running {_PEER_GRACE_S:.0f} s after another rank failed (killed)"
    if outcome.kind == OutcomeKind.CRASH:
        return f"process {describe_exit(outcome.value)}"
    info = outcome.value
    return f"{info['name']}: {info['message']}\n{format_frames(info, None)}"


def run_on_ranks(
    fn: Callable[..., Any],
    num_processes: int = 2,
    args: Sequence[Any] = (),
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
    cpu: bool = True,
) -> list[Any]:
    """Call ``fn(*args)`` on ``num_processes`` real ranks; return results indexed by rank.

    ``fn`` and ``args`` travel with cloudpickle (functions defined in a test module or locally
    travel by value, as in a notebook). ``env`` adds variables to every rank's environment.
    ``cpu=False`` puts each rank on its GPU (``cuda:LOCAL_RANK``, nccl), for the GPU lane.
    Raises :class:`RankFailures` naming every failing rank.
    """
    args = check_call(args)
    plan = LaunchPlan.create(
        Front.TESTING,
        LaunchRequest(num_processes=num_processes, cpu=cpu, timeout=timeout),
        extra_env={"OMP_NUM_THREADS": "1", **(env or {})},
    )
    report = run_function(
        plan,
        fn,
        args,
        renderer=TextRenderer(quiet=True),
        preload=PRELOAD,
        timeout=timeout,
        policy=Settle(failure_grace=_PEER_GRACE_S),
    )
    if report.state == CallState.DONE:
        return report.values()
    if report.state == CallState.INTERRUPTED:
        raise KeyboardInterrupt
    failed = sorted({*report.failures(), *report.stuck})
    text = "\n".join(
        f"--- rank {rank} ---\n{_failure_text(report, rank, timeout)}" for rank in failed
    )
    raise RankFailures(f"{len(failed)} of {num_processes} ranks failed:\n{text}")
