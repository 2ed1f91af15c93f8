"""A kernel with nbaccel in use honours a shutdown request and cleans up after itself.

ipykernel terminates its child processes on shutdown and waits while any child is left, zombies
included; Jupyter kills a kernel that takes too long, and then nothing registered with ``atexit``
runs (the pool's private directory stays, the fork server is never reaped). The kernel here runs
a ``%%distributed`` pool and a one-shot launch, then is asked to shut down politely.
"""

from __future__ import annotations

import asyncio
import glob
import os
import tempfile

import psutil
from kernel import _kernel_manager

CELLS = [
    "%load_ext nbaccel",
    "%%distributed -n 2\nimport os\nprint('pid', os.getpid())",
    "from nbaccel import notebook_launcher\nnotebook_launcher(print, ('hi',), num_processes=2)",
    "import os, psutil\n"
    "print('KERNEL', os.getpid())\n"
    "print('CHILDREN', *[p.pid for p in psutil.Process().children(recursive=True)])",
]


async def _run_and_shut_down(spec_root: str) -> str:
    manager = _kernel_manager(spec_root)
    await manager.start_kernel()
    client = manager.client()
    client.start_channels()
    await client.wait_for_ready(timeout=60)
    text = []
    for cell in CELLS:
        msg_id = client.execute(cell)
        while True:
            msg = await client.get_iopub_msg(timeout=120)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                text.append(msg["content"]["text"])
            if msg["msg_type"] == "error":
                raise AssertionError("\n".join(msg["content"]["traceback"]))
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
    # Jupyter's default: wait shutdown_wait_time, then SIGTERM, then SIGKILL. A kernel that
    # needs the kill never runs its atexit hooks.
    manager.shutdown_wait_time = 5.0
    await manager.shutdown_kernel(now=False)
    client.stop_channels()
    return "".join(text)


def test_shutdown_request_runs_cleanup_and_leaves_no_process(tmp_path):
    out = asyncio.run(_run_and_shut_down(str(tmp_path)))
    kernel_pid = int(out.split("KERNEL", 1)[1].split()[0])
    children = [int(pid) for pid in out.split("CHILDREN", 1)[1].split()]
    assert len(children) >= 1, out  # the fork server (and its pool workers)
    gone, alive = psutil.wait_procs(
        [p for p in map(_process, children) if p is not None], timeout=10
    )
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    # the pool's private directory was removed by atexit, so the kernel was not killed
    leftovers = glob.glob(os.path.join(tempfile.gettempdir(), f"nbaccel-{kernel_pid}-*"))
    assert leftovers == []


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
