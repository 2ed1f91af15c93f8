"""What keeps a launch cheap on few cores: the fork server settles its memory (objects frozen
out of the cyclic GC, writable memory in huge pages) once it is idle, and a rank packing its
result imports nothing."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from nbaccel import notebook_launcher
from nbaccel.launch.launchers.forkserver import get_forkserver
from nbaccel.launch.launchers.huge_pages import collapse_writable_memory
from nbaccel.launch.render import Renderer


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
        "from nbaccel.launch.transport import pack\n"
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


#: the kernel's modules that the fork server (torch, nbaccel) does not import
_KERNEL_MODULES = ("IPython", "ipykernel", "traitlets", "pygments", "jedi", "numpy.random")


def test_ranks_launched_from_a_kernel_import_none_of_its_modules():
    """The notebook's state (warning filters naming IPython's categories, NumPy's generator)
    travels to the ranks by name: a launch from a kernel imported IPython, traitlets and
    pygments (warning categories) and numpy.random in every rank as it started, making an
    8-rank no-op launch 4-6x slower."""
    from kernel import cell_text, run_notebook

    nb = run_notebook(
        [
            "import sys, warnings\n"
            "from nbaccel import notebook_launcher\n"
            "from nbaccel.launch.render import Renderer\n"
            f"def kernel_modules_here():\n"
            f"    return [name for name in {_KERNEL_MODULES!r} if name in sys.modules]\n"
            "assert 'IPython' in sys.modules\n"
            "assert any(f[2].__module__.startswith('IPython') for f in warnings.filters)\n"
            "print(notebook_launcher(kernel_modules_here, num_processes=2, renderer=Renderer()))"
        ]
    )
    assert cell_text(nb.cells[0]).strip().splitlines()[-1] == "[[], []]"
