"""Failures as code written for Accelerate catches them, and arguments shared by inheritance.

- A failed rank's exception raised by ``notebook_launcher`` is its own type and torch elastic's
  ``ChildFailedError`` (what Accelerate's elastic launch raises): ``except ValueError`` and
  ``except ChildFailedError`` both catch it, with the rank's message, and it pickles as both.
- ``ShapeMismatchError`` (debug-mode operation checks) is a ``DistributedOperationException``.
- A ``multiprocessing.Queue`` in ``args`` reaches ranks forked from the kernel
  (``start_method="fork"``, as Accelerate's notebook test does) and is refused with the fix,
  before anything starts, by a launch through the fork server.
"""

from __future__ import annotations

import multiprocessing
import pickle

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from nbaccel import notebook_launcher
from nbaccel.launch.wire.unpicklable import UnpicklableError


def _even_ranks_fail():
    from nbaccel import PartialState

    if PartialState().process_index % 2 == 0:
        raise ValueError("I'm an even process. I don't like to sleep.")


def test_a_rank_error_is_its_own_type_and_child_failed_error():
    with pytest.raises(ChildFailedError, match="I'm an even process") as caught:
        notebook_launcher(_even_ranks_fail, num_processes=2, cpu=True)
    exc = caught.value
    assert isinstance(exc, ValueError) and type(exc).__name__ == "ValueError"
    assert str(exc) == "I'm an even process. I don't like to sleep."
    assert exc.__notes__ == ["raised on rank 0"]
    assert exc.rank == 0 and exc.name == "_even_ranks_fail" and list(exc.failures) == [0]
    again = pickle.loads(pickle.dumps(exc))
    assert isinstance(again, ValueError) and isinstance(again, ChildFailedError)
    assert str(again) == str(exc)


def test_shape_mismatch_is_a_distributed_operation_exception():
    from nbaccel import ShapeMismatchError
    from nbaccel.utils import DistributedOperationException

    assert issubclass(ShapeMismatchError, DistributedOperationException)
    assert issubclass(ShapeMismatchError, RuntimeError)


def _take_and_put_back(queue):
    value = queue.get(timeout=10)
    queue.put(value + 10)
    return value


def test_a_queue_reaches_forked_ranks_and_comes_back():
    queue = multiprocessing.get_context("fork").Queue()
    queue.put(3)
    queue.put(4)
    values = notebook_launcher(
        _take_and_put_back, (queue,), num_processes=2, cpu=True, start_method="fork"
    )
    assert sorted(values) == [3, 4]
    assert sorted([queue.get(timeout=10), queue.get(timeout=10)]) == [13, 14]


def test_a_queue_is_refused_by_a_fork_server_launch_before_it_starts(capsys):
    queue = multiprocessing.get_context("fork").Queue()
    with pytest.raises(UnpicklableError) as caught:
        notebook_launcher(
            _take_and_put_back, (queue,), num_processes=2, cpu=True, start_method="forkserver"
        )
    message = str(caught.value)
    assert message.startswith("args[0] (a multiprocessing Queue) reaches other processes only")
    assert "start_method='fork'" in message and "multiprocessing.Manager().Queue()" in message
    assert "Launching" not in capsys.readouterr().out  # nothing started
