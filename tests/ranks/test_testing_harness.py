"""nbaccel.testing.run_on_ranks: results per rank, failures with tracebacks, no hangs."""

from __future__ import annotations

import signal

import pytest
import torch

from nbaccel.launch.host.processes import describe_exit
from nbaccel.testing import RankFailures, free_port, run_on_ranks


def _world(scale: int) -> tuple[int, int, list[int], str]:
    import os

    import torch

    from nbaccel import PartialState, gather

    s = PartialState()
    gathered = gather(torch.tensor([s.process_index * scale])).tolist()
    return s.process_index, s.num_processes, gathered, os.environ["OMP_NUM_THREADS"]


def test_results_are_indexed_by_rank_and_args_travel() -> None:
    assert run_on_ranks(_world, args=(10,)) == [(0, 2, [0, 10], "1"), (1, 2, [0, 10], "1")]


def test_three_ranks_and_extra_env() -> None:
    def ranks() -> tuple[int, str]:
        import os

        from nbaccel import PartialState

        return PartialState().process_index, os.environ["NBACCEL_TEST_FLAG"]

    # A lambda-like local function travels by value (cloudpickle), as in a notebook.
    results = run_on_ranks(ranks, num_processes=3, env={"NBACCEL_TEST_FLAG": "on"})
    assert results == [(0, "on"), (1, "on"), (2, "on")]


def _fails_on_rank_1() -> str:
    import os

    # No process group here: rank 0 must not depend on rank 1 to finish cleanly.
    rank = int(os.environ["RANK"])
    if rank == 1:
        _helper_that_raises(rank)
    return "fine"


def _helper_that_raises(rank: int) -> None:
    raise ValueError(f"boom on rank {rank}")


def test_failing_rank_is_reported_with_its_traceback() -> None:
    with pytest.raises(RankFailures) as info:
        run_on_ranks(_fails_on_rank_1, timeout=30)
    message = str(info.value)
    assert message.startswith("1 of 2 ranks failed:\n--- rank 1 ---\nValueError: boom on rank 1")
    assert "Traceback (most recent call last)" in message
    assert "_fails_on_rank_1" in message and "_helper_that_raises" in message
    assert "--- rank 0 ---" not in message
    assert isinstance(info.value, AssertionError)  # pytest shows it as a test failure


def _fails_while_peer_waits() -> None:
    from nbaccel import PartialState

    state = PartialState()
    if state.process_index == 1:
        raise RuntimeError("rank 1 gave up before the barrier")
    state.wait_for_everyone()  # rank 0 would wait here forever


def test_peer_stuck_in_a_collective_does_not_hang_the_test() -> None:
    with pytest.raises(RankFailures) as info:
        run_on_ranks(_fails_while_peer_waits, timeout=120)
    message = str(info.value)
    assert "--- rank 1 ---\nRuntimeError: rank 1 gave up before the barrier" in message
    # rank 0 was stopped for rank 1's failure, not left in the barrier until the timeout
    assert "timed out" not in message, message


def _hangs_on_rank_1() -> str:
    import os
    import time

    if os.environ["RANK"] == "1":
        time.sleep(600)
    return "done"


def test_hanging_rank_is_killed_at_the_timeout() -> None:
    with pytest.raises(RankFailures) as info:
        run_on_ranks(_hangs_on_rank_1, timeout=4)
    assert str(info.value) == "1 of 2 ranks failed:\n--- rank 1 ---\ntimed out after 4 s (killed)"


def _killed_on_rank_0() -> None:
    import os
    import signal

    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)


def test_rank_killed_by_a_signal_is_named() -> None:
    with pytest.raises(RankFailures) as info:
        run_on_ranks(_killed_on_rank_0, timeout=30)
    # the engine's one exit describer: signal name and number, then the host-RAM hint
    assert str(info.value) == (
        f"1 of 2 ranks failed:\n--- rank 0 ---\nprocess {describe_exit(-signal.SIGKILL)}"
    )
    assert str(info.value).startswith(
        "1 of 2 ranks failed:\n--- rank 0 ---\nprocess was killed by SIGKILL (signal 9). "
    )


def test_unpicklable_result_is_reported() -> None:
    def returns_a_generator() -> object:
        return (i for i in range(3))

    with pytest.raises(RankFailures, match="(?s)2 of 2 ranks failed.*cannot pickle 'generator'"):
        run_on_ranks(returns_a_generator, timeout=30)


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert 0 < port < 65536


def test_tensors_come_back_to_the_caller() -> None:
    def make() -> torch.Tensor:
        import torch

        return torch.arange(3)

    a, b = run_on_ranks(make)
    assert torch.equal(a, torch.arange(3)) and torch.equal(b, torch.arange(3))
