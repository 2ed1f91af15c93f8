"""What ranks on other hosts start with, in real kernels launching over ssh onto the lane's hosts.

Run with ``sudo bash scripts/test-hosts`` (marker ``hosts``). The notebook imports its own
modules from a folder the hosts see too (the lane's hosts share the filesystem, as an NFS home
would): each host's fork server imports them for the ranks there. One whose import starts a
thread is kept out on each host and named once per host in the launch's output; one edited
between two launches is seen as it is now by the next launch's ranks on every host.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel import cell_errors, cell_text
from kernel import run_notebook as _run_notebook

pytestmark = pytest.mark.hosts

ENV = {"NBACCEL_NO_WARMUP": "1", "NBACCEL_RENDERER": "text"}

LIBRARIES = {
    "lane_thread_lib": (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True,\n"
        "                 name='lane-poller').start()\n"
    ),
    "lane_version_lib": "VERSION = 1\n",
}


@pytest.fixture
def modules_folder():
    """The notebook's own modules, in a folder the hosts see too (their /tmp is their own)."""
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-lane-modules-", dir="/var/tmp"))
    for name, code in LIBRARIES.items():
        (folder / f"{name}.py").write_text(code)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _setup(folder: Path) -> str:
    """The notebook's first cell: its modules on ``sys.path`` (not the hosts' PYTHONPATH),
    imported at the top as notebooks do, and the launch."""
    return textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(folder)!r})
        import lane_thread_lib, lane_version_lib
        from nbaccel import notebook_launcher

        def where():
            import os, socket
            import lane_version_lib
            from nbaccel.launch.rank.inherited import inherited_modules
            inherited = inherited_modules() or ()
            return (socket.gethostname(), "lane_thread_lib" in inherited,
                    "lane_version_lib" in inherited, lane_version_lib.VERSION, os.getppid())

        def launch():
            return notebook_launcher(where, num_processes=2, hosts=["nbh1:1", "nbh2:1"])
        """
    )


def _notices(text: str, words: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[nbaccel]") and words in line]


def test_a_module_that_starts_a_thread_is_kept_out_on_each_host_and_named(
    ssh_hosts, modules_folder
):
    cells = [
        _setup(modules_folder),
        "first = launch(); print('FIRST', first)",
        "again = launch(); print('AGAIN', again)",
        "print('same servers:', [r[4] for r in again] == [r[4] for r in first])",
    ]
    nb = _run_notebook(cells, timeout=300, env=ENV, shutdown=True)
    texts = [cell_text(c) for c in nb.cells]
    assert not any(cell_errors(c) for c in nb.cells), texts
    # the ranks start with the plain module imported, not the one that starts a thread
    for host in ("nbh1", "nbh2"):
        assert f"('{host}', False, True, 1, " in texts[1], texts[1]
    # one line per host, in the launch's output, naming the host, the module, why, the fix
    for host in ("nbh1", "nbh2"):
        lines = _notices(texts[1], f"{host}: lane_thread_lib is not preloaded")
        assert len(lines) == 1, texts[1]
        assert "its import started a thread ('lane-poller')" in lines[0], lines
        assert "each rank imports it itself" in lines[0], lines
        assert "NBACCEL_PRELOAD=-lane_thread_lib" in lines[0], lines
    # said once: the next launch, from the same servers, says nothing of it
    assert not _notices(texts[2], "not preloaded"), texts[2]
    assert "same servers: True" in texts[3], texts


def test_an_edited_module_is_seen_fresh_by_the_next_launch_on_the_hosts(ssh_hosts, modules_folder):
    path = modules_folder / "lane_version_lib.py"
    edit = textwrap.dedent(
        f"""
        import os
        with open({str(path)!r}, "w") as handle:
            handle.write("VERSION = 2\\n")
        stat = os.stat({str(path)!r})  # a later date even on a coarse clock
        os.utime({str(path)!r}, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
        """
    )
    cells = [
        _setup(modules_folder),
        "first = launch(); print('FIRST', first)",
        edit,
        "second = launch(); print('SECOND', second)",
        "print('fresh servers:', all(a[4] != b[4] for a, b in zip(first, second)))",
        "third = launch(); print('same servers:', [r[4] for r in third] == [r[4] for r in second])",
    ]
    nb = _run_notebook(cells, timeout=300, env=ENV, shutdown=True)
    texts = [cell_text(c) for c in nb.cells]
    assert not any(cell_errors(c) for c in nb.cells), texts
    for host in ("nbh1", "nbh2"):
        assert f"('{host}', False, True, 1, " in texts[1], texts[1]
        # the file as it is now, imported by a fresh server on each host (the kernel itself
        # still holds version 1: it did not reload it)
        assert f"('{host}', False, True, 2, " in texts[3], texts[3]
        lines = _notices(texts[3], f"{host}: lane_version_lib changed since")
        assert len(lines) == 1, texts[3]
        assert "a fresh server imports the files as they are now" in lines[0], lines
    assert "fresh servers: True" in texts[4], texts
    assert "same servers: True" in texts[5] and not _notices(texts[5], "changed since"), texts


def test_a_module_imported_after_a_launch_reaches_the_hosts_before_the_next_one(
    ssh_hosts, modules_folder
):
    """The kernel's hook after each cell sends what it imported to the warm agents: their
    servers import it while the user types, and the next launch's ranks fork with it."""
    (modules_folder / "lane_later_lib.py").write_text(
        "import os, time\nIMPORTED_AT = time.time()\nIMPORTED_IN = os.getpid()\n"
    )
    later = textwrap.dedent(
        """
        def later():
            import os, socket, time
            import lane_later_lib
            return (socket.gethostname(), os.getppid() == lane_later_lib.IMPORTED_IN,
                    lane_later_lib.IMPORTED_AT < CALLED)
        """
    )
    cells = [
        _setup(modules_folder) + later,
        "first = launch()",  # the agents are up
        "import lane_later_lib",  # after this cell, the hook tells the agents
        "import time; time.sleep(3)",  # the user types
        "CALLED = time.time()\n"
        "print('LATER', notebook_launcher(later, num_processes=2, hosts=['nbh1:1', 'nbh2:1']))",
    ]
    nb = _run_notebook(cells, timeout=300, env=ENV, shutdown=True)
    texts = [cell_text(c) for c in nb.cells]
    assert not any(cell_errors(c) for c in nb.cells), texts
    # imported by each host's server, before the launch began
    assert "LATER [('nbh1', True, True), ('nbh2', True, True)]" in texts[4], texts[4]
