"""No pool worker outlives its kernel (killed with SIGKILL: no chance to clean up)."""

from __future__ import annotations

import json
import time

import psutil
import pytest
from kernel import run_notebook
from nbclient.exceptions import DeadKernelError


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_workers_exit_when_the_kernel_dies(tmp_path):
    record = tmp_path / "pids.json"
    cells = [
        "%load_ext nbaccel\nfrom nbaccel.notebook.kernel.pool import get_pool",
        "%%distributed -n 2\npass",
        "import json, os, signal\n"
        f"open({str(record)!r}, 'w').write(json.dumps(list(get_pool().pids.values())))\n"
        "os.kill(os.getpid(), signal.SIGKILL)",
    ]
    with pytest.raises(DeadKernelError):
        run_notebook(cells, timeout=120)
    pids = json.loads(record.read_text())
    assert len(pids) == 2
    deadline = time.monotonic() + 15
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive(pids) == [], "workers outlived the kernel"


def test_a_killed_pool_ranks_child_does_not_survive_it(tmp_path):
    """A pool rank starts a process and is SIGKILLed: the process ends too (by the time the
    pool is shut down at the latest)."""
    record = tmp_path / "child"
    cells = [
        "%load_ext nbaccel",
        "%%distributed -n 2\npass",
        "%%distributed --ranks 1\nimport os, signal, subprocess\n"
        "child = subprocess.Popen(['sleep', '600'])\n"
        f"open({str(record)!r}, 'w').write(str(child.pid))\n"
        "os.kill(os.getpid(), signal.SIGKILL)",
        "%dist_shutdown",
    ]
    nb = run_notebook(cells, timeout=120)
    assert "SIGKILL" in json.dumps(nb.cells[2].outputs)
    child = int(record.read_text())
    deadline = time.monotonic() + 5
    while _alive([child]) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert _alive([child]) == [], "the killed rank's child outlived the pool"
    finally:
        if _alive([child]):
            psutil.Process(child).kill()
