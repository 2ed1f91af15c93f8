"""Fault injections for the reliability suite and its report (run on the ranks).

Each fault is a function run on every rank by ``notebook_launcher``; rank 1 misbehaves and
rank 0 usually waits in a collective, the situation users hit in practice.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["FAULTS", "FIRST_LAUNCH_CELLS", "FIRST_LAUNCH_NAMED", "succeed"]


def _rank() -> int:
    return int(os.environ["RANK"])


def _wait_in_collective() -> None:
    from nbaccel import PartialState

    PartialState().wait_for_everyone()


def succeed() -> str:
    return "ok"


def raises() -> None:
    from nbaccel import PartialState

    PartialState()
    if _rank() == 1:
        raise ValueError("injected failure")
    _wait_in_collective()


def exits() -> None:
    if _rank() == 1:
        os._exit(3)
    time.sleep(60)


def sigkill() -> None:
    if _rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def segfault() -> None:
    import ctypes

    if _rank() == 1:
        ctypes.string_at(0)
    time.sleep(60)


def hang_in_collective_while_peer_fails() -> None:
    from nbaccel import PartialState

    state = PartialState()
    if _rank() == 1:
        time.sleep(0.2)
        raise RuntimeError("peer failed")
    state.wait_for_everyone()


def sigkill_in_collective() -> None:
    from nbaccel import PartialState

    state = PartialState()
    if _rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    state.wait_for_everyone()  # rank 0's gloo barrier breaks: "Connection reset by peer"


def hangs() -> None:
    time.sleep(3600)


# name -> (function, expected exception type name, text the notebook shows under the traceback:
# the message and the notes naming the rank, as traceback.format_exception_only writes them)
FAULTS = {
    "raises": (raises, "ValueError", "ValueError: injected failure\nraised on rank 1"),
    "os._exit(3)": (exits, "RankCrashed", "rank 1 exited with code 3"),
    "SIGKILL": (sigkill, "RankCrashed", "rank 1 was killed by SIGKILL"),
    "segfault": (segfault, "RankCrashed", "rank 1 was killed by SIGSEGV"),
    "collective + failing peer": (
        hang_in_collective_while_peer_fails,
        "RuntimeError",
        "RuntimeError: peer failed\nraised on rank 1",
    ),
    "SIGKILL while the peer is in a collective": (
        sigkill_in_collective,
        "RankCrashed",
        "rank 1 was killed by SIGKILL",
    ),
    "hangs (timeout=1)": (hangs, "LaunchTimeout", "exceeded timeout=1"),
}


#: Notebook cells of a fresh kernel's first launch whose rank 1 exits with code 3 while rank 0
#: waits in a barrier (rank 0 sees its peer vanish before rank 1's exit status reaches the
#: notebook); the last cell prints ``RAISED <type> <message>``. Used by
#: tests/kernel/test_first_launch.py and benchmarks/first_launch_stress.py.
FIRST_LAUNCH_CELLS = [
    "from nbaccel import notebook_launcher",
    """
def exits_while_peer_waits():
    import os
    import torch.distributed as dist
    from nbaccel import PartialState
    if PartialState().process_index == 1:
        os._exit(3)
    dist.barrier()
""",
    """
try:
    notebook_launcher(exits_while_peer_waits, num_processes=2)
except Exception as exc:
    print("RAISED", type(exc).__name__, exc)
""",
]
#: what the last of FIRST_LAUNCH_CELLS prints when the rank that exited is named
FIRST_LAUNCH_NAMED = "RAISED RankCrashed rank 1 exited with code 3 before returning a result"
