"""Races between ranks of one launch: no spurious failures, the root cause named.

A rank that returns early must not tear down its process group while a peer still connects to
it (a rank that holds nothing its peers need exits at once); a rank killed while its peer sits
in a collective is the failure to name, not the peer's consequential "Connection reset by
peer".
"""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch
from faults import hang_in_collective_while_peer_fails, sigkill_in_collective

from nbaccel import RankCrashed, notebook_launcher
from nbaccel.launch.driver.group import Outcome
from nbaccel.launch.driver.loop import CallReport, CallState
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.wire.errors import is_peer_loss
from nbaccel.launch.wire.protocol import OutcomeKind


class _Returned:
    """A return value that writes its rank's pid to ``marker`` when the worker pickles it to
    send it to the driver, i.e. once the function has returned; arrives as ``"returned"``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        with open(self.marker + ".tmp", "w") as handle:
            handle.write(str(os.getpid()))
        os.replace(self.marker + ".tmp", self.marker)
        return (str, ("returned",))


def _early_rank_outlives_the_call(folder: str, holds: str):
    """Rank 0 returns at once, holding ``holds`` (a process group, a tensor large enough to
    travel through a shared file, or nothing); rank 1, once rank 0's result is on its way,
    watches whether rank 0's process ends while rank 1 still runs."""
    import torch

    from nbaccel import PartialState

    if holds == "group":
        PartialState()  # a gloo process group on both ranks
    marker = os.path.join(folder, "rank0.pid")
    if os.environ["RANK"] == "0":
        value = torch.arange(1 << 18, dtype=torch.float32) if holds == "tensor" else None
        return _Returned(marker), value
    deadline = time.monotonic() + 20
    while not os.path.exists(marker):
        assert time.monotonic() < deadline, "rank 0 never returned"
        time.sleep(0.01)
    with open(marker) as handle:
        pid = int(handle.read())
    try:  # a rank that exits on return is gone well within this
        psutil.Process(pid).wait(timeout=2.0)
    except psutil.TimeoutExpired:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        pass  # gone before it could be watched
    return "exited while its peer still ran"


@pytest.mark.parametrize("holds", ["group", "tensor"])
def test_a_rank_that_returned_stays_up_while_its_peers_may_need_it(tmp_path, holds):
    """Its end of the process group (a slower peer may still be connecting to it), or the shared
    file of its result (the driver may not have mapped it yet), lives until every rank
    returned."""
    values = notebook_launcher(
        _early_rank_outlives_the_call,
        args=(str(tmp_path), holds),
        num_processes=2,
        renderer=Renderer(),
    )
    assert values[0][0] == "returned"
    assert values[1] not in (
        psutil.STATUS_ZOMBIE,
        psutil.STATUS_DEAD,
        "exited while its peer still ran",
    ), values
    if holds == "tensor":
        assert torch.equal(values[0][1], torch.arange(1 << 18, dtype=torch.float32))


def test_a_rank_holding_nothing_exits_once_it_returned(tmp_path):
    """As a ``torch.multiprocessing`` process does: its exit overlaps the slower ranks' work."""
    values = notebook_launcher(
        _early_rank_outlives_the_call,
        args=(str(tmp_path), "nothing"),
        num_processes=2,
        renderer=Renderer(),
    )
    assert values == [("returned", None), "exited while its peer still ran"]


def _join_and_return(lr: float) -> float:
    from nbaccel import PartialState

    state = PartialState()
    return state.process_index * lr


def test_quick_launches_in_a_row_never_fail_spuriously():
    for _ in range(25):
        values = notebook_launcher(
            _join_and_return, args=(0.1,), num_processes=3, renderer=Renderer()
        )
        assert values == [0.0, 0.1, 0.2]


def test_a_killed_rank_is_named_not_its_peers_broken_collective():
    for _ in range(8):
        try:
            notebook_launcher(sigkill_in_collective, num_processes=2, renderer=Renderer())
        except RankCrashed as exc:
            assert "rank 1 was killed by SIGKILL" in str(exc)
        else:
            raise AssertionError("the launch did not fail")


def test_a_failing_rank_is_named_every_time_its_peer_is_stopped():
    """The peer is stopped while the launch ends: its streams close while the driver drains
    them (this once raised ``ValueError: Invalid file descriptor: -1`` in ~5% of runs)."""
    for _ in range(30):
        try:
            notebook_launcher(
                hang_in_collective_while_peer_fails, num_processes=2, renderer=Renderer()
            )
        except RuntimeError as exc:
            assert str(exc) == "peer failed" and exc.rank == 1
        else:
            raise AssertionError("the launch did not fail")


def _error(message: str, at: float, name: str = "RuntimeError") -> Outcome:
    return Outcome(OutcomeKind.ERROR, {"name": name, "message": message, "frames": []}, at)


def test_first_failure_prefers_the_root_cause_over_consequential_errors():
    reset = _error("[pair.cc:537] Read error: Connection reset by peer", at=100.0)
    crash = Outcome(OutcomeKind.CRASH, -9, at=100.2)  # the death was observed after the reset
    report = CallReport(0, [0, 1], CallState.FAILED, {0: reset, 1: crash})
    assert is_peer_loss(reset.value)
    assert report.first_failure()[0] == 1
    # an ordinary error still wins by time, and a lone communication error is still named
    value = _error("bad shape", at=100.5, name="ValueError")
    assert CallReport(0, [0, 1], CallState.FAILED, {0: reset, 1: value}).first_failure()[0] == 1
    assert CallReport(0, [0], CallState.FAILED, {0: reset}).first_failure()[0] == 0


def _slow_output():
    for i in range(5):
        print(f"tick {i}", flush=True)
        time.sleep(0.2)
    return "done"


def test_a_silent_connection_to_the_channel_stalls_nothing(monkeypatch):
    """Any local process may connect and say nothing: the launch goes on meanwhile (the
    handshake timeout is 10 s; the launch's own timeout of 6 s would expire while blocked)."""
    import socket

    from nbaccel.launch.driver.group import WorkerGroup

    silent: list[socket.socket] = []
    start = WorkerGroup.start

    def start_then_connect(self, *args, **kwargs):
        start(self, *args, **kwargs)
        family = (
            socket.AF_UNIX if self.connections.listener.address.family == "unix" else socket.AF_INET
        )
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.connect(self.connections.listener.address.location)  # and then never a byte
        silent.append(sock)

    monkeypatch.setattr(WorkerGroup, "start", start_then_connect)
    try:
        values = notebook_launcher(_slow_output, num_processes=2, renderer=Renderer(), timeout=6)
    finally:
        for sock in silent:
            sock.close()
    assert values == ["done", "done"]
    assert silent


def _rank_number():
    return int(os.environ["RANK"])


def test_hundreds_of_ranks_connect_and_return():
    """More ranks than the old listen backlog (256) and more sockets than ``select`` can watch
    (1024: three streams per rank, 1200 here): every rank connects while the others are still
    starting, and returns."""
    ranks = 400
    assert notebook_launcher(_rank_number, num_processes=ranks, renderer=Renderer()) == list(
        range(ranks)
    )
