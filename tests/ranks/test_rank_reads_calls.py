"""A pool rank's main thread reads its calls itself: a call wakes no other thread of the rank
(on 8 ranks and 2 cores each switch costs the cell time), the driver's end hanging up is still
noticed by the rank's watcher thread (asleep in ``poll``, looking on a clock for the memory
sampler), and an interrupt between calls loses no call.

Real ranks of an in-process pool; thread switches are read from ``/proc``, outside the rank.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from proc_threads import voluntary_switches

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc")


def _watcher_thread() -> int:
    import threading

    from nbaccel.launch.rank.watch import WATCHER

    return next(t.native_id for t in threading.enumerate() if t.name == WATCHER)


def _answer(x: int) -> int:
    return x + 1


def test_calls_wake_no_thread_but_the_ranks_main_thread(pool):
    from nbaccel.launch.rank.watch import _LOOK

    watchers = pool.call(_watcher_thread)
    pool.run_cell("pass")  # a first cell's one-off set-up (duties it registers) happens now
    time.sleep(4 * _LOOK)  # the wake-ups of the rank's own start (its duties registered) are over
    before = {rank: voluntary_switches(pool.pids[rank], tid) for rank, tid in watchers.items()}
    started = time.monotonic()
    for i in range(50):
        assert pool.call(_answer, i) == {0: i + 1, 1: i + 1}
        pool.run_cell("pass")
    # It looks for new calls on a clock; each look may sleep once more, on the interpreter's
    # lock held by the busy main thread, so two switches per look (and the first and last).
    looks = (time.monotonic() - started) / _LOOK + 2
    for rank, tid in watchers.items():
        woke = voluntary_switches(pool.pids[rank], tid) - before[rank]
        assert woke <= 2 * looks, (rank, woke, looks)  # was one wake-up per call: 100


def test_an_interrupt_between_calls_loses_no_call(pool):
    assert pool.call(_answer, 0) == {0: 1, 1: 1}
    for _ in range(5):
        for pid in pool.pids.values():
            os.kill(pid, signal.SIGINT)
        time.sleep(0.02)
    assert pool.call(_answer, 41) == {0: 42, 1: 42}
    pool.run_cell("value = 6 * 7")
    assert pool.pull("value") == {0: 42, 1: 42}


def test_a_cell_run_again_names_its_own_run_in_tracebacks(pool):
    """Cell code is compiled once per text, but each run's frames carry that run's file name
    (the notebook keeps each run's lines under its own name), functions defined in it too."""
    source = "def f():\n    raise ValueError('boom')\nf()"
    for name in ("<rank-cell-1>", "<rank-cell-2>", "<rank-cell-1>"):
        with pytest.raises(ValueError, match="boom") as caught:
            pool.run_cell(source, filename=name)
        text = str(caught.value.__cause__)
        assert f'File "{name}", line 3, in <module>' in text
        assert f'File "{name}", line 2, in f' in text
    with pytest.raises(SyntaxError) as bad:
        pool.run_cell("x = (", filename="<rank-cell-9>")
    assert "<rank-cell-9>" in str(bad.value) + str(bad.value.__cause__)
