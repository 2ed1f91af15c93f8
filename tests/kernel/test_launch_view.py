"""What the notebook shows when a launch fails or is stopped (a real kernel, nbclient).

The summary counts the ranks that failed by themselves, not those stopped because of them; the
tracebacks show the rank's frames and the cell's, not the engine's (driver, worker group,
selectors).
"""

from __future__ import annotations

import subprocess
import sys

from kernel import cell_errors, cell_text, run_notebook

_FUNCTIONS = """
def one_raises():
    from nbaccel import PartialState
    state = PartialState()
    if state.process_index == 1:
        raise ValueError("boom")
    state.wait_for_everyone()

def sleeps():
    import time
    time.sleep(60)
"""

_ENGINE = ("loop.py", "group.py", "rank_ends.py", "output_reader.py", "selectors.py", "run.py")


def test_failure_summary_counts_the_failed_rank_and_no_engine_frame_shows():
    nb = run_notebook(
        [
            "%load_ext nbaccel\nfrom nbaccel import notebook_launcher",
            _FUNCTIONS,
            "notebook_launcher(one_raises, num_processes=2)",
            "notebook_launcher(sleeps, num_processes=2)",
        ],
        interrupt_after={3: 8},
    )
    failed, stopped = nb.cells[2], nb.cells[3]
    assert "1 rank failed (1 stopped)" in cell_text(failed)
    assert "2 ranks failed" not in cell_text(failed)
    assert "2 ranks stopped" in cell_text(stopped)
    for cell, name in ((failed, "ValueError"), (stopped, "KeyboardInterrupt")):
        (error,) = cell_errors(cell)
        assert error["ename"] == name
        traceback = "\n".join(error["traceback"])
        assert not [f for f in _ENGINE if f in traceback], traceback


_EARLY_STOP = """
import os, signal, sys, time
from nbaccel.launch.launchers.forkserver.launcher import ForkServer
server = ForkServer()
time.sleep(0.3)  # it is importing torch now
os.kill(server.pid, signal.SIGINT)  # what the stop button's SIGINT to the process group does
server.wait_ready(120)
print("ready", flush=True)
server.close()
"""


def test_the_stop_button_during_the_fork_servers_imports_shows_no_traceback():
    """The fork server starts importing torch when nbaccel is imported in a kernel; the stop
    button pressed then must neither dump its imports' traceback (into the cell, or the
    terminal at shutdown) nor kill it."""
    done = subprocess.run(
        [sys.executable, "-c", _EARLY_STOP], capture_output=True, text=True, timeout=180
    )
    assert "Traceback" not in done.stderr, done.stderr
    # the first launch may say that it waits for the fork server's imports: nothing else
    lines = [line for line in done.stdout.splitlines() if "starting the fork server" not in line]
    assert [line for line in lines if line.strip()] == ["ready"], done.stdout
