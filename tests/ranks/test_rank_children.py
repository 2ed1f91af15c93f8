"""What a rank starts ends with its launch, and a rank's death is seen from its exit status.

Ranks here start real processes: a child that keeps writing to the stdout it inherited, a
sleeping child, a double-forked daemon in a session of its own. Whether the launch returned,
raised or crashed, none of them is left once it ends; one started with ``NBACCEL_DETACH=1``
is left alone on purpose.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.wire.errors import LaunchTimeout, RankCrashed

_CHATTY = "import time\nwhile True:\n    print('chatter', flush=True)\n    time.sleep(0.02)\n"
_DAEMON = (
    "import os, sys, time\n"
    "if os.fork():\n    os._exit(0)\n"
    "os.setsid()\n"
    "if os.fork():\n    os._exit(0)\n"
    "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
    "time.sleep(600)\n"
)


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(pids: list[int], seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _alive(pids)


def _start_children(folder: str) -> None:
    """On rank 1: a chatty child on the inherited stdout, a sleeper and a daemon."""
    chatty = subprocess.Popen([sys.executable, "-c", _CHATTY])
    sleeper = subprocess.Popen(["sleep", "600"])
    marker = os.path.join(folder, "daemon")
    subprocess.run([sys.executable, "-c", _DAEMON, marker], check=True)
    while not os.path.exists(marker) or not _read(marker):
        time.sleep(0.01)
    with open(os.path.join(folder, "pids"), "w") as handle:
        handle.write(f"{chatty.pid} {sleeper.pid} {_read(marker)}")


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def _children_then(folder: str, end: str) -> str:
    if os.environ["RANK"] == "1":
        _start_children(folder)
        if end == "raise":
            raise ValueError("rank 1 fails")
        if end == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if end == "exit":
            os._exit(3)
    else:
        time.sleep(0.3 if end == "ok" else 60)
    return "ok"


def _pids(folder) -> list[int]:
    return [int(pid) for pid in (folder / "pids").read_text().split()]


def test_a_killed_rank_with_a_chatty_child_is_named_not_timed_out(tmp_path):
    """The child keeps the rank's stdout open and busy: the SIGKILL is still reported (from the
    exit status), not a timeout."""
    with pytest.raises(RankCrashed) as info:
        notebook_launcher(
            _children_then, (str(tmp_path), "crash"), num_processes=2, timeout=12,
            renderer=Renderer(),
        )  # fmt: skip
    assert not isinstance(info.value, LaunchTimeout)
    assert "rank 1 was killed by SIGKILL" in str(info.value)
    assert _wait_gone(_pids(tmp_path)) == []


@pytest.mark.parametrize("end", ["ok", "raise", "exit"])
def test_processes_a_rank_started_end_with_the_launch(tmp_path, end):
    if end == "ok":
        assert notebook_launcher(
            _children_then, (str(tmp_path), end), num_processes=2, renderer=Renderer()
        ) == ["ok", "ok"]
    else:
        with pytest.raises((ValueError, RankCrashed)):
            notebook_launcher(
                _children_then, (str(tmp_path), end), num_processes=2, timeout=30,
                renderer=Renderer(),
            )  # fmt: skip
    assert _wait_gone(_pids(tmp_path)) == []


def _detach() -> int:
    if os.environ["RANK"] == "0":
        child = subprocess.Popen(
            ["sleep", "600"], env={**os.environ, "NBACCEL_DETACH": "1"}, start_new_session=True
        )
        return child.pid
    return 0


def test_a_process_started_with_nbaccel_detach_outlives_its_launch():
    pid, _ = notebook_launcher(_detach, num_processes=2, renderer=Renderer())
    try:
        time.sleep(1.5)  # longer than the orphans' SIGTERM-to-SIGKILL grace
        assert _alive([pid]) == [pid]
    finally:
        os.kill(pid, signal.SIGKILL)
