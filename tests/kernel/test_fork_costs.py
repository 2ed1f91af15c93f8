"""What keeps a launch cheap on few cores: the fork server settles its memory (objects frozen
out of the cyclic GC, writable memory in huge pages) once it is idle, and a rank packing its
result imports nothing."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.launchers.forkserver.huge_pages import collapse_writable_memory
from nbaccel.launch.launchers.forkserver.launcher import get_forkserver


def _huge_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def _frozen_objects() -> int:
    import gc

    return gc.get_freeze_count()


def test_idle_server_is_frozen_and_in_huge_pages_and_ranks_inherit_it():
    if collapse_writable_memory() == 0:  # this kernel cannot collapse (before Linux 6.1)
        pytest.skip("MADV_COLLAPSE is not available on this kernel")
    server = get_forkserver()
    server.wait_ready()
    deadline, seen = time.monotonic() + 30, [0]
    while time.monotonic() < deadline:  # until the collapse (a few 100 ms) is over
        time.sleep(0.25)
        seen.append(_huge_kib(server.pid))
        if seen[-1] and seen[-1] == seen[-2]:
            break
    assert seen[-1] > 32 * 1024  # most of ~150 MB of torch's heap and arenas
    frozen = notebook_launcher(_frozen_objects, num_processes=2, renderer=Renderer())
    assert min(frozen) > 10_000  # torch's modules and their objects, frozen before the fork


def test_packing_a_result_imports_no_module():
    code = (
        "import sys\n"
        "from nbaccel.launch.wire.transport import pack\n"
        "before = set(sys.modules)\n"
        "pack({'loss': 1.5, 'names': ['a', 'b']}, name='the return value')\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_queue_still_reaches_forked_ranks_by_inheritance():
    import multiprocessing

    queue = multiprocessing.get_context("fork").Queue()

    def put(q):
        from nbaccel import PartialState

        q.put(PartialState().process_index)

    notebook_launcher(put, (queue,), num_processes=2, start_method="fork", renderer=Renderer())
    assert sorted(queue.get(timeout=10) for _ in range(2)) == [0, 1]


_PROBE_CELL = """
import sys, warnings
import numpy.random
from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer
numpy.random.seed(3)
warnings.filterwarnings("ignore", message="x", category=numpy.exceptions.RankWarning)
assert any(f[2].__module__.startswith("IPython") for f in warnings.filters)

def imported_here():
    from nbaccel.launch.rank.inherited import inherited_modules
    return sorted(set(sys.modules) - inherited_modules())

print(notebook_launcher(imported_here, num_processes=2, renderer=Renderer()))
"""


def test_ranks_launched_from_a_kernel_import_nothing_as_they_start():
    """Everything a launch sends its ranks besides the user's function (the notebook's state:
    warning filters naming IPython's categories, NumPy's generator, torch's settings) arrives
    without importing a module in the rank: each import is paid again by every rank of every
    launch. They imported IPython, traitlets, pygments and numpy.random as they started, and
    an 8-rank no-op launch from a kernel took 0.28-0.37 s instead of 0.06 s."""
    from kernel import cell_text, run_notebook

    nb = run_notebook([_PROBE_CELL])
    assert cell_text(nb.cells[0]).strip().splitlines()[-1] == "[[], []]"


def _has_ipython_display() -> bool:
    return "IPython.display" in sys.modules


def test_a_pool_has_the_fork_server_import_ipythons_display_for_its_ranks():
    """Each pool rank routes ``display`` through IPython's formatters: imported once in the
    fork server, not in every rank (about 35 ms of CPU each). A plain launch's ranks never
    import it themselves (test above), so seeing it there means the server had it."""
    from nbaccel.notebook.kernel import pool as pool_module
    from nbaccel.notebook.preload import POOL_PRELOAD

    pool_module.start_pool(renderer=Renderer(), num_processes=2)
    try:
        assert set(POOL_PRELOAD) <= get_forkserver().preloaded
        seen = notebook_launcher(_has_ipython_display, num_processes=2, renderer=Renderer())
    finally:
        pool_module.shutdown_pool()
    assert seen == [True, True]
