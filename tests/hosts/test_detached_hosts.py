"""Detached runs on other hosts (the hosts lane): a kernel starts a detached run on two ssh
hosts and is SIGKILLed mid-run; a new kernel re-attaches, sees every line labelled with its
host, and gets the results; nothing is left on the hosts."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from detached import runs_fixture  # noqa: F401 (the fixture `runs`)
from kernel import cell_errors, run_notebook, stream_text
from test_remote_hosts import clean_hosts  # noqa: F401 (the fixture)

pytestmark = pytest.mark.hosts

LINES = 100

_START = f"""
import os, sys
from nbaccel import notebook_launcher

def chatty(lines):
    import socket, time
    for i in range(lines):
        print(f"line {{i}}", flush=True)
        time.sleep(0.03)
    return (int(os.environ["RANK"]), socket.gethostname())

run = notebook_launcher(chatty, ({LINES},), num_processes=2, hosts=["nbh1:1", "nbh2:1"],
                        python=sys.executable, detach=True)
print("RUN", run.id, "PID", os.getpid())
"""


def test_a_detached_run_on_two_hosts_outlives_its_kernel(runs, clean_hosts):  # noqa: F811
    _, _, env = runs
    env = {**env, "NBACCEL_NO_WARMUP": "1", "NBACCEL_RENDERER": "text"}
    first = run_notebook([_START], timeout=120, env=env)
    found = re.search(r"RUN (\S+) PID (\d+)", stream_text(first.cells[0]))
    assert found, stream_text(first.cells[0])
    run_id, kernel_pid = found.group(1), int(found.group(2))
    time.sleep(1.0)
    os.kill(kernel_pid, signal.SIGKILL)
    attach = f"import nbaccel\nrun = nbaccel.attach({run_id!r})\nprint('RESULT', run.result())"
    second = run_notebook([attach], timeout=300, env=env, shutdown=True)
    cell = second.cells[0]
    assert not cell_errors(cell), stream_text(cell)
    out = stream_text(cell)
    for rank, host in ((0, "nbh1"), (1, "nbh2")):
        seen = re.findall(rf"^\[rank {rank} @ {host}\] line (\d+)$", out, re.M)
        assert seen == [str(i) for i in range(LINES)], (rank, len(seen), out[-500:])
    assert "RESULT [(0, 'nbh1'), (1, 'nbh2')]" in out
