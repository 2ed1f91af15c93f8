"""The one driver loop: run a call on a worker group, settle stragglers, raise the first failure.

Every front uses it: ``notebook_launcher`` and ``nbaccel.testing.run_on_ranks`` through
:func:`run_once` (start a one-shot group, run its call, stop it), the ``%%distributed`` pool
through :func:`run_call` on its long-lived group. A call ends in one :class:`CallState`; what
happens to ranks that have not reported by then is a :class:`Settle` policy (one-shot ranks are
stopped; pool ranks are interrupted and left for the pool to restart if they do not come back);
:class:`CallReport` turns the outcome into results or into the exception to raise.

Failure attribution lives in :meth:`CallReport.first_failure` (the earliest failure, by when it
happened, not the lowest rank).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from nbaccel.launch.driver.group import Outcome, WorkerGroup
from nbaccel.launch.host.processes import describe_exit
from nbaccel.launch.wire.errors import (
    LaunchTimeout,
    RankCrashed,
    add_note,
    exit_hint,
    is_peer_loss,
    rebuild_exception,
)
from nbaccel.launch.wire.labels import LOCAL_LABELS, RankLabels
from nbaccel.launch.wire.protocol import STACKS_SIGNAL, OutcomeKind

__all__ = [
    "ONE_SHOT",
    "POOL",
    "CallReport",
    "CallState",
    "Settle",
    "outcome_exception",
    "run_call",
    "run_once",
]


class CallState(str, Enum):
    """How waiting on a call ended."""

    DONE = "done"  # every target returned a value
    FAILED = "failed"  # a target raised or crashed
    TIMEOUT = "timeout"  # the deadline passed first
    INTERRUPTED = "interrupted"  # the stop button (in the notebook, or reported by a rank)


@dataclass(frozen=True)
class Settle:
    """What happens to ranks that have not reported when a call ends without them.

    Args:
        failure_grace: seconds the other ranks get to finish on their own after a failure.
        interrupt_grace: seconds the ranks get to report an interrupt they received themselves.
        disposable: one-shot ranks: stop the stragglers (SIGTERM, then SIGKILL after
            ``stop_grace``). Otherwise (a pool): SIGINT them and wait ``recover`` seconds; the
            ones still busy are reported as stuck.
        dead_drain: at most this long, ranks whose process died get their streams read to the
            end and their crash recorded before the others are stopped.
        stacks_wait: after a timeout, or a stop the ranks did not answer within their grace,
            how long their stack dumps get to arrive before they are stopped.
        cause_wait: when every failure so far is an echo (a collective that lost its peer),
            at most this long for the cause (the peer's crash or error) to be seen before the
            others are stopped: stopped, the cause would look like one of the stopped.
        talking: after the stop button, a rank that is still sending output may have its answer
            queued behind that output (a flood through a remote host's relay, a slow notebook
            front): its grace is renewed while it keeps talking, up to this many seconds in
            all. Silent ranks get their grace and no more.
    """

    failure_grace: float = 0.5
    interrupt_grace: float = 1.0
    disposable: bool = True
    stop_grace: float = 2.0
    recover: float = 3.0
    dead_drain: float = 3.0
    stacks_wait: float = 0.3
    cause_wait: float = 5.0
    talking: float = 0.0


ONE_SHOT = Settle()
#: seconds a one-shot rank gets to end after the stop button, per signal (SIGINT, then SIGTERM)
STOP_GRACE = 0.6
# A pool rank that has not reported its interrupt within half a second is SIGINTed once more and
# given a second to come back (a long native op ends); after that the pool restarts it. A rank
# whose output is still arriving gets its grace renewed, at most 15 s in all.
POOL = Settle(disposable=False, interrupt_grace=0.5, recover=1.0, talking=15.0)


def outcome_exception(
    rank: int, outcome: Outcome, labels: RankLabels = LOCAL_LABELS
) -> BaseException:
    """The exception for one failed rank: its original type naming the rank (as ``labels``, its
    worker group's, do), or RankCrashed."""
    if outcome.kind == OutcomeKind.CRASH:
        if outcome.lost:
            return RankCrashed(rank, outcome.value, f"was lost: {outcome.detail}", labels)
        text = describe_exit(outcome.value)
        if outcome.detail:
            text = f"{text}; {outcome.detail}"
        return RankCrashed(rank, outcome.value, text, labels)
    exit_code = outcome.value.get("exit_code")
    if exit_code is not None:  # sys.exit(n) in the function: the rank exited, say so
        text = f"exited with code {exit_code} (sys.exit){exit_hint(outcome.value)}"
        return RankCrashed(rank, exit_code, text, labels)
    named = outcome.value.get("rank")
    return rebuild_exception(outcome.value, rank if named is None else named, labels)


def _secondary(outcome: Outcome) -> bool:
    """A failure that follows from another one: a rank the driver stopped, or a collective that
    lost its peer. The root cause (a raise, a crash) is named before any of these."""
    if outcome.kind == OutcomeKind.CRASH:
        return outcome.secondary
    return outcome.secondary or is_peer_loss(outcome.value)


def _own_failure(outcome: Outcome) -> bool:
    """A failure that is a cause: not a result, not an echo of a peer's, not the stop button."""
    return (
        outcome.kind != OutcomeKind.RESULT and not _secondary(outcome) and not _interrupted(outcome)
    )


def _interrupted(outcome: Outcome) -> bool:
    """The rank was interrupted by SIGINT (the stop button, or the driver): not a failure of
    its own. A ``KeyboardInterrupt`` its code raised is a failure like any other exception."""
    return (
        outcome.kind == OutcomeKind.ERROR
        and outcome.value.get("name") == "KeyboardInterrupt"
        and outcome.value.get("signalled", True)
    )


@dataclass
class CallReport:
    """The end of one call: its state, every target's outcome, and who never reported."""

    call_id: int
    targets: list[int]
    state: CallState
    outcomes: dict[int, Outcome]
    timeout: float | None = None
    late: list[int] = field(default_factory=list)  # no outcome when the state was decided
    stuck: list[int] = field(default_factory=list)  # still no outcome after settling
    policy: Settle = ONE_SHOT
    labels: RankLabels = LOCAL_LABELS  # how its worker group names the ranks
    deaf: list[int] = field(default_factory=list)  # of the stuck, those ignoring SIGINT

    @property
    def crashed(self) -> list[int]:
        return sorted(r for r, o in self.outcomes.items() if o.kind == OutcomeKind.CRASH)

    def results(self) -> dict[int, Any]:
        return {
            r: o.value for r, o in sorted(self.outcomes.items()) if o.kind == OutcomeKind.RESULT
        }

    def failures(self) -> dict[int, Outcome]:
        return {r: o for r, o in sorted(self.outcomes.items()) if o.kind != OutcomeKind.RESULT}

    def causes(self) -> list[int]:
        """The ranks whose failure was their own: not stopped by the driver, not a peer's
        broken collective, not the stop button."""
        return sorted(r for r, o in self.outcomes.items() if _own_failure(o))

    def first_failure(self) -> tuple[int, Outcome] | None:
        """The earliest failure (by when it happened), not the lowest rank: a peer's error is
        often the consequence of the first one (a collective broken by the failed rank)."""
        failures = [
            (_secondary(o), o.at, r, o)
            for r, o in self.outcomes.items()
            if o.kind != OutcomeKind.RESULT
        ]
        if not failures:
            return None
        *_, rank, outcome = min(failures, key=lambda f: f[:3])
        return rank, outcome

    def exception(self, what: str = "the launch", others: bool = False) -> BaseException | None:
        """What to raise in the notebook, or None when every target returned.

        ``what`` names the call in a timeout message; ``others`` adds the other ranks that
        raised in a note (the pool does: its ranks outlive the call).
        """
        if self.state == CallState.INTERRUPTED:
            return KeyboardInterrupt()
        if self.state == CallState.TIMEOUT:
            done = "stopped" if self.policy.disposable else "interrupted"
            stacks = (
                "" if STACKS_SIGNAL is None else " Their Python stacks at the timeout are above."
            )
            return LaunchTimeout(
                f"{what} exceeded timeout={self.timeout} s on rank(s) {self.late}; they were "
                f"{done}.{stacks}"
            )
        failure = self.first_failure()
        if failure is None:
            return None
        rank, outcome = failure
        exc = outcome_exception(rank, outcome, self.labels)
        also = sorted(
            r
            for r, o in self.outcomes.items()
            if r != rank and o.kind == OutcomeKind.ERROR and not _interrupted(o)
        )
        if others and also:
            add_note(exc, f"rank(s) {also} failed too")
        exc.rank_results = self.results()  # type: ignore[attr-defined]
        return exc

    def values(self, what: str = "the launch") -> list[Any]:
        """The targets' values in rank order; raises the call's failure instead."""
        __tracebackhide__ = True  # IPython: show the rank's frames, not the driver's
        exc = self.exception(what)
        if exc is not None:
            raise exc
        return [self.outcomes[r].value for r in self.targets]


def _wait(
    group: WorkerGroup,
    call_id: int,
    targets: list[int],
    deadline: float | None,
    interrupted: Callable[[], bool],
    interval: float,
) -> CallState:
    seen = None  # the outcomes are looked at again only once another came in
    while True:
        if interrupted():
            return CallState.INTERRUPTED
        if group.outcomes_recorded != seen:
            seen = group.outcomes_recorded
            got = group.outcomes(call_id, targets)
            unreturned = [o for o in got.values() if o.kind != OutcomeKind.RESULT]
            if unreturned:
                failed = not any(_interrupted(o) for o in unreturned)
                return CallState.FAILED if failed else CallState.INTERRUPTED
            if len(got) == len(targets):
                return CallState.DONE
        wait = interval
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
            if wait <= 0:
                return CallState.TIMEOUT
        group.pump(wait)


def _settle(
    group: WorkerGroup, call_id: int, targets: list[int], state: CallState, policy: Settle
) -> list[int]:
    """Bring the targets of an unfinished call to an end; the ranks that never reported."""

    def pending() -> list[int]:
        got = group.outcomes(call_id, targets)
        return [r for r in targets if r not in got]

    def deaf() -> bool:  # every rank left ignores SIGINT: waiting on it is waiting for nothing
        left = pending()
        return state == CallState.INTERRUPTED and group.ignoring(signal.SIGINT, left) == left

    def cause_seen() -> bool:  # a failure of its own, or a rank whose process has ended
        got = group.outcomes(call_id, targets).values()
        return any(_own_failure(o) for o in got) or bool(group.dead_unreported(call_id))

    grace = {CallState.INTERRUPTED: policy.interrupt_grace, CallState.FAILED: policy.failure_grace}
    talk_until = time.monotonic() + policy.talking  # the most that talking ranks are waited for
    if state == CallState.INTERRUPTED:
        _pump_while_talking(
            group, lambda: not pending() or deaf(), pending, grace[state], talk_until
        )
    else:
        group.pump_until(lambda: not pending() or deaf(), grace.get(state, 0.0))
    if state == CallState.FAILED:
        # Only echoes so far: the rank that broke the collective has died or failed and says
        # so within moments (its exit status comes from its launcher, which may lag the echo
        # on a busy machine, as at a fresh kernel's first launch).
        group.pump_until(lambda: not pending() or cause_seen(), policy.cause_wait)
    # A rank that died is a cause, maybe the root one: read its streams to the end (its own
    # last words) and record its crash before stopping the others turns them into casualties.
    group.pump_until(lambda: not group.dead_unreported(call_id), policy.dead_drain)
    if not pending():
        return []
    stuck = pending()
    # a timeout, or ranks the stop button did not reach: show where each one hangs
    if state in (CallState.TIMEOUT, CallState.INTERRUPTED) and group.dump_stacks(stuck):
        group.pump_until(lambda: False, policy.stacks_wait)
    if policy.disposable:
        group.stop(policy.stop_grace)
        return stuck
    deaf_ranks = group.ignoring(signal.SIGINT, stuck)
    listening = [rank for rank in stuck if rank not in deaf_ranks]
    if listening:  # a second SIGINT, and time to end a long native op, for those it can reach
        group.signal_all(signal.SIGINT, listening)

        def still() -> list[int]:
            return [r for r in pending() if r in listening]

        _pump_while_talking(group, lambda: not still(), still, policy.recover, talk_until)
    return pending()


def _pump_while_talking(
    group: WorkerGroup,
    done: Callable[[], bool],
    waited: Callable[[], list[int]],
    grace: float,
    talk_until: float,
) -> bool:
    """Pump until ``done()``: ``grace`` seconds, renewed while output of the ``waited()`` ranks
    keeps arriving, not past ``talk_until`` (monotonic); False when the time ran out. Output,
    not events: a rank's memory samples come from its watcher thread, busy or not."""
    start = time.monotonic()
    last = max(start + grace, talk_until)
    while not done():
        now = time.monotonic()
        end = min(last, max(start, group.output_at(waited())) + grace)
        if now >= end:
            return False
        group.pump(min(0.2, end - now))
    return True


def run_call(
    group: WorkerGroup,
    call_id: int,
    targets: list[int],
    timeout: float | None = None,
    policy: Settle = POOL,
    interrupted: Callable[[], bool] = lambda: False,
    interval: float = 0.2,
    deadline: float | None = None,
) -> CallReport:
    """Wait on ``call_id`` (already sent to ``targets``), settle stragglers; the report.

    ``interrupted()`` is polled between selector rounds (the pool's deferred stop button);
    ``deadline`` (monotonic) overrides ``timeout`` as the end of the wait.
    """
    if deadline is None and timeout is not None:
        deadline = time.monotonic() + timeout
    state = _wait(group, call_id, targets, deadline, interrupted, max(0.01, min(interval, 0.2)))
    got = group.outcomes(call_id, targets)
    late = [r for r in targets if r not in got]
    if state == CallState.INTERRUPTED and interrupted() and late:
        group.signal_all(signal.SIGINT, late)  # the stop button, passed on to the busy ranks
    stuck = _settle(group, call_id, targets, state, policy) if state != CallState.DONE else []
    deaf = group.ignoring(signal.SIGINT, stuck)
    group.end_call()
    outcomes = group.outcomes(call_id, targets)
    labels = group.labels
    return CallReport(call_id, targets, state, outcomes, timeout, late, stuck, policy, labels, deaf)


def run_once(
    group: WorkerGroup,
    timeout: float | None = None,
    policy: Settle = ONE_SHOT,
    interval: float = 0.2,
) -> CallReport:
    """Start a one-shot (``Mode.CALL``) group, wait on its call, stop and close it.

    ``timeout`` counts from before the start. The stop button (``KeyboardInterrupt`` here)
    interrupts every rank, escalates to SIGTERM/SIGKILL, and is re-raised.
    """
    __tracebackhide__ = True
    group.expect_call(0)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        group.start(180.0 if deadline is None else max(0.0, deadline - time.monotonic()))
        return run_call(
            group, 0, group.ranks, timeout, policy, interval=interval, deadline=deadline
        )
    except KeyboardInterrupt:
        group.renderer.notice("interrupted: stopping every rank")
        group.release()  # ranks that already reported (their KeyboardInterrupt) may exit now
        group.stop(STOP_GRACE, first=signal.SIGINT)
        raise
    finally:
        group.close()
