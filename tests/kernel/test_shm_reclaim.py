"""Shared memory is reclaimed after any death of its owner (a kernel SIGKILLed mid-launch).

A real kernel creates a segment for a large tensor in a launch's args (or a ``%dist_push``) and
is SIGKILLed while the segment exists; the next launch on this machine removes it.
"""

from __future__ import annotations

import os

import pytest
from faults import succeed
from kernel import run_notebook
from nbclient.exceptions import DeadKernelError

from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer

# In the kernel: a thread that SIGKILLs the kernel as soon as one of its segments appears.
_KILLER = """
import os, signal, threading, time, torch
def _kill_when_shared(record):
    mine = f"nbaccel-{os.getpid()}-"  # segments are named after their owner
    while True:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(mine)]
        if names:
            open(record, "w").write(names[0])
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.0005)
threading.Thread(target=_kill_when_shared, args=(RECORD,), daemon=True).start()
big = torch.ones(64 << 20, dtype=torch.uint8)
"""

_LAUNCH = "from nbaccel import notebook_launcher\nnotebook_launcher(len, (big,), num_processes=1)"
_PUSH = "%dist_push big"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
@pytest.mark.parametrize("how", ["launch", "push"])
def test_a_segment_of_a_killed_kernel_is_reclaimed(tmp_path, how):
    record = tmp_path / "segment"
    cells = ["%load_ext nbaccel"]
    if how == "push":
        cells.append("%%distributed -n 1\npass")
    cells += [_KILLER.replace("RECORD", repr(str(record))), _LAUNCH if how == "launch" else _PUSH]
    with pytest.raises(DeadKernelError):
        run_notebook(cells, timeout=120)
    path = os.path.join("/dev/shm", record.read_text())
    try:
        # left behind by its dead owner (unless another launch on this machine swept it
        # already), and removed by the next launch at the latest
        assert notebook_launcher(succeed, num_processes=1, renderer=Renderer()) == ["ok"]
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
