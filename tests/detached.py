"""What the tests of detached runs share: a private runs folder per test, and the check that
nothing of its runs is left (processes, shared memory) once its supervisor is gone.

    from detached import runs_fixture   # tests/ is on sys.path: the fixture ``runs``
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbaccel.launch.detached.client import request
from nbaccel.launch.detached.paths import RUNS_DIR_VAR

__all__ = ["leftovers", "runs_env", "runs_fixture", "shut_down"]


def runs_env(root: Path, shm: Path) -> dict[str, str]:
    """The environment of a test's kernels and runs: its own runs folder and shm folder; the
    supervisor exits soon after its last run."""
    return {
        RUNS_DIR_VAR: str(root),
        "NBACCEL_SHM_DIR": str(shm),
        "NBACCEL_SUPERVISOR_IDLE": "3",
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep),
    }


def _processes_with(marker: str) -> list[int]:
    """Pids of the processes whose environment holds ``marker`` (the runs folder)."""
    found, needle = [], marker.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                if needle in handle.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


def shut_down(root: Path, timeout: float = 60.0) -> None:
    """Ask the supervisor of ``root`` (if any) to stop and wait for its runs' processes."""
    try:
        request("shutdown", root, start=False)
    except (ConnectionError, OSError, RuntimeError):
        pass
    deadline = time.monotonic() + timeout
    while _processes_with(f"{RUNS_DIR_VAR}={root}") and time.monotonic() < deadline:
        time.sleep(0.2)


def leftovers(root: Path, shm: Path) -> dict[str, list]:
    """What is left of the runs under ``root``: processes, shared-memory segments."""
    return {
        "processes": _processes_with(f"{RUNS_DIR_VAR}={root}"),
        "shm": sorted(os.listdir(shm)) if shm.is_dir() else [],
    }


@pytest.fixture(name="runs")
def runs_fixture() -> Iterator[tuple[Path, Path, dict[str, str]]]:
    """A test's runs folder, shm folder and the environment naming them; afterwards its
    supervisor is shut down and nothing of its runs may be left."""
    # short: the supervisor's socket lives there (a Unix socket path has ~100 bytes)
    root = Path(tempfile.mkdtemp(prefix="runs-", dir="/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="nbaccel-test-", dir="/dev/shm"))
    try:
        yield root, shm, runs_env(root, shm)
        shut_down(root)
        left = leftovers(root, shm)
        assert left == {"processes": [], "shm": []}, left
    finally:
        shut_down(root, timeout=10)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
