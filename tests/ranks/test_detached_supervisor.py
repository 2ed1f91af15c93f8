"""The supervisor of detached runs: reused while it runs, not a child of the launching
process, and when it dies (SIGKILL) its runs stop cleanly and are marked so."""

from __future__ import annotations

import os
import signal
import time

from detached import runs_fixture  # noqa: F401 (the fixture `runs`)

from nbaccel import notebook_launcher
from nbaccel.launch.detached.client import supervisor_pid
from nbaccel.launch.detached.folder import RunState


def waits(seconds: float) -> str:
    import time

    print("waiting", flush=True)
    time.sleep(seconds)
    return "done"


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[1])


def test_a_killed_supervisor_stops_its_runs_and_marks_them(runs, monkeypatch):
    root, _, env = runs
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    first = notebook_launcher(waits, (120,), num_processes=1, cpu=True, detach=True)
    pid = supervisor_pid(root)
    assert pid is not None and _parent(pid) != os.getpid()  # it belongs to no kernel
    second = notebook_launcher(waits, (120,), num_processes=1, cpu=True, detach=True)
    assert supervisor_pid(root) == pid  # reused
    for run in (first, second):  # running, so that there is something to stop
        while run.state == RunState.STARTING:
            time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    for run in (first, second):
        info = run.wait(timeout=120)
        assert info.state == RunState.STOPPED, info
        assert info.reason == "its supervisor ended", info
