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
