"""Run notebook cells in a real IPython kernel of *this* interpreter (nbclient), for tests.

    from kernel import run_notebook, cell_text, cell_errors   # tests/ is on sys.path
    nb = run_notebook(["%load_ext nbaccel", "%%distributed -n 2\\nprint(1)"], timeout=120)
    assert "[rank 0] 1" in cell_text(nb.cells[1])

The kernel is started from ``sys.executable`` through a temporary kernelspec, whatever
kernelspecs the machine has installed. ``interrupt_after={index: seconds}`` presses the stop
button (``KernelManager.interrupt_kernel``, i.e. SIGINT to the kernel's process group) that long
after cell ``index`` starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import threading
from typing import Any

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

from nbaccel.notebook.kernel.run_headless import output_text

__all__ = ["cell_errors", "cell_text", "run_notebook", "stream_text"]

_KERNEL_NAME = "nbaccel-test-python"


def _kernel_manager(spec_root: str) -> AsyncKernelManager:
    folder = os.path.join(spec_root, _KERNEL_NAME)
    os.makedirs(folder, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "nbaccel tests",
        "language": "python",
        "interrupt_mode": "signal",
    }
    with open(os.path.join(folder, "kernel.json"), "w") as handle:
        json.dump(spec, handle)
    specs = KernelSpecManager(kernel_dirs=[spec_root])
    return AsyncKernelManager(kernel_name=_KERNEL_NAME, kernel_spec_manager=specs)


def _press_stop(manager: AsyncKernelManager, delay: float, done: threading.Event) -> None:
    if not done.wait(delay):
        asyncio.run(manager.interrupt_kernel())


def run_notebook(
    cells: list[str],
    timeout: int = 120,
    interrupt_after: dict[int, float] | None = None,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    shutdown: bool = False,
) -> Any:
    """Execute ``cells`` (code sources) in a fresh kernel; the executed notebook.

    Errors in cells are kept as outputs (check them with :func:`cell_errors`); ``timeout`` is
    per cell; ``env`` adds variables to the kernel's environment. ``shutdown``: end the kernel
    as Jupyter does (a shutdown request) before returning; otherwise it lives until this process
    ends (nbclient leaves a kernel whose manager it was given running).
    """
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    interrupt_after = interrupt_after or {}
    with tempfile.TemporaryDirectory(prefix="nbaccel-kernelspec-") as spec_root:
        manager = _kernel_manager(spec_root)
        client = NotebookClient(
            nb,
            km=manager,
            timeout=timeout,
            # a cell's last output may trail its reply by seconds on a loaded machine (a flood
            # of lines still queued for the front): wait for it rather than drop it silently
            iopub_timeout=60,
            raise_on_iopub_timeout=True,
            allow_errors=True,
            resources={"metadata": {"path": cwd or os.getcwd()}},
        )
        kernel_env = {**os.environ, **(env or {})}
        with client.setup_kernel(env=kernel_env, cleanup_kc=shutdown):
            for index, cell in enumerate(nb.cells):
                done = threading.Event()
                presser = None
                if index in interrupt_after:
                    presser = threading.Thread(
                        target=_press_stop, args=(manager, interrupt_after[index], done)
                    )
                    presser.start()
                try:
                    client.execute_cell(cell, index)
                finally:
                    done.set()
                    if presser is not None:
                        presser.join()
    return nb


def cell_text(cell: Any) -> str:
    """Everything the user sees in a cell's outputs, as text (streams, results, errors)."""
    return "".join(output_text(output) for output in cell.get("outputs", []))


def stream_text(cell: Any, name: str = "stdout") -> str:
    """The text of one stream (``stdout`` or ``stderr``) of a cell."""
    return "".join(
        o.get("text", "")
        for o in cell.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == name
    )


def cell_errors(cell: Any) -> list[Any]:
    """The error outputs of a cell (``ename``, ``evalue``, ``traceback``)."""
    return [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
