"""The stop button on a pool whose ranks answer late because their output is still arriving
(a flood that the notebook, or a remote host's relay, has not drained yet): a rank that keeps
talking gets its grace renewed and the pool is kept; a silent late rank is restarted as before.

Real ranks of an in-process pool; the stop button is a real SIGINT to this process.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from nbaccel.launch.driver.renderer import Renderer

# Each rank catches the stop button (and the pool's second SIGINT) and keeps working for 2.5 s,
# far past the pool's 0.5 + 1 s grace, then reports the interrupt.
_LATE = """
import time
started = time.monotonic()
try:
    time.sleep(60)
except KeyboardInterrupt:
    until = time.monotonic() + 2.5
    while time.monotonic() < until:
        try:
            {work}
        except KeyboardInterrupt:
            pass
    raise KeyboardInterrupt
"""


class _Notices(Renderer):
    def __init__(self) -> None:
        super().__init__()
        self.notices: list[str] = []
        self.lines = 0

    def notice(self, text: str) -> None:
        self.notices.append(text)

    def line(self, rank: int, stream: str, text: str) -> None:
        self.lines += 1


def _stop_in(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def _stop_a_late_cell(pool, work: str) -> tuple[_Notices, dict[int, int]]:
    """Run a cell whose ranks answer the stop button 2.5 s late doing ``work``, press the stop
    button 1 s in; what the cell's renderer got and the pool's pids before it."""
    pool.run_cell("kept = 41")
    pids = dict(pool.pids)
    seen = _Notices()
    timer = _stop_in(1.0)
    with pytest.raises(KeyboardInterrupt):
        pool.run_cell(_LATE.format(work=work), renderer=seen)
    timer.join()
    return seen, pids


def test_a_rank_still_talking_after_the_stop_button_keeps_the_pool(pool) -> None:
    seen, pids = _stop_a_late_cell(pool, "print('still going', flush=True); time.sleep(0.05)")
    assert any("the pool and its names are kept" in n for n in seen.notices), seen.notices
    assert not any("restarting the pool" in n for n in seen.notices), seen.notices
    assert seen.lines > 20  # the output that kept the grace going reached the renderer
    assert pool.pids == pids and pool.pull("kept") == {0: 41, 1: 41}


def test_a_silent_late_rank_is_still_restarted(pool) -> None:
    seen, pids = _stop_a_late_cell(pool, "time.sleep(0.05)")
    assert any("did not stop within" in n and "restarting the pool" in n for n in seen.notices), (
        seen.notices
    )
    assert set(pool.pids.values()).isdisjoint(pids.values())  # fresh ranks
    assert pool.call(len, "ab") == {0: 2, 1: 2}
