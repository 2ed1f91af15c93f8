"""A process's age (``%dist_status``'s uptime): bracketed by clocks read around its start."""

import subprocess
import sys
import time

import psutil
import pytest

from nbaccel.launch.host.processes import process_age

TICK = 0.02  # a process's start is kept in clock ticks (1/100 s)


def _clock() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@pytest.mark.skipif(not hasattr(time, "CLOCK_BOOTTIME"), reason="the boot clock is Linux's")
def test_age_lies_between_the_clock_before_and_after_the_start():
    before = _clock()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        after = _clock()
        time.sleep(0.5)
        low, age, high = _clock() - after, process_age(child.pid), _clock() - before
        assert low - TICK <= age <= high + TICK, (low, age, high)
    finally:
        child.kill()
        child.wait()


def test_a_gone_process_is_no_such_process():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(psutil.NoSuchProcess):
        process_age(child.pid)
