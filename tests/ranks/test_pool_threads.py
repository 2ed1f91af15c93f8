"""The pool's lifecycle from several threads: restart or shutdown while a call runs.

Real ranks (an in-process pool driven by this test); the other thread is a real thread, as
when a kernel thread or a callback runs ``%dist_restart``/``%dist_shutdown`` during a cell.
"""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from nbaccel.launch.driver.renderer import Renderer
from nbaccel.notebook.kernel import pool as pool_module
from nbaccel.notebook.kernel.pool import PoolChangedError


def _sleep(seconds: float) -> str:
    import time

    time.sleep(seconds)
    return "slept"


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            pass
    return alive


def _in_thread(after: float, action) -> threading.Thread:
    def run() -> None:
        time.sleep(after)
        action()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("what", ["restarted", "shut down"])
def test_restart_or_shutdown_from_another_thread_during_a_call(what):
    pool = pool_module.start_pool(num_processes=2, renderer=Renderer())
    try:
        first = set(pool.pids.values())
        if what == "restarted":
            action = pool.restart
        else:
            action = pool_module.shutdown_pool
        thread = _in_thread(1.0, action)
        with pytest.raises(PoolChangedError, match=f"the pool was {what} during this call"):
            pool.call(_sleep, 60)
        thread.join(30)
        assert not thread.is_alive()
        deadline = time.monotonic() + 5
        while _alive(first) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(first) == []  # the old ranks are gone, none left without a pool
        if what == "restarted":
            assert pool_module.get_pool() is pool and set(pool.pids.values()) != first
            assert pool.call(_sleep, 0) == {0: "slept", 1: "slept"}
        else:
            assert pool_module.get_pool() is None and pool.pids == {}
    finally:
        pids = set(pool.pids.values())
        pool_module.shutdown_pool()
        pool.shutdown()
        assert _alive(pids) == []
