"""What ranks on Ray nodes start with, from a real kernel on a real 2-node Ray cluster.

The notebook imports its own modules from a folder every node sees: each node's agent has its
fork server import them. One whose import starts a thread is kept out on each node and named
once per node in the launch's output; one edited between two launches is seen as it is now by
the next launch's ranks (the same warm allocation, a fresh fork server on each node).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import pytest
from kernel import cell_errors, cell_text, run_notebook
from ray_cluster import RayCluster

LIBRARIES = {
    "ray_thread_lib": (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True,\n"
        "                 name='ray-poller').start()\n"
    ),
    "ray_version_lib": "VERSION = 1\n",
}

SETUP = """
import os, sys
sys.path.insert(0, {folder!r})
import ray_thread_lib, ray_version_lib
from nbaccel import notebook_launcher

def where():
    import os
    import ray_version_lib
    from nbaccel.launch.rank.inherited import inherited_modules
    inherited = inherited_modules() or ()
    return (os.environ["NBACCEL_HOST"], "ray_thread_lib" in inherited,
            "ray_version_lib" in inherited, ray_version_lib.VERSION, os.getppid())

def launch():
    return notebook_launcher(where, num_processes=2, launcher="ray", ray_address={address!r},
                             ray_placement="spread")
"""

EDIT = """
with open({path!r}, "w") as handle:
    handle.write("VERSION = 2\\n")
stat = os.stat({path!r})  # a later date even on a coarse clock
os.utime({path!r}, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
"""


@pytest.fixture
def modules_folder():
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-ray-modules-", dir="/var/tmp"))
    for name, code in LIBRARIES.items():
        (folder / f"{name}.py").write_text(code)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _notices(text: str, words: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[nbaccel]") and words in line]


def test_ray_nodes_keep_unsafe_modules_out_and_see_edited_ones_fresh(modules_folder):
    path = str(modules_folder / "ray_version_lib.py")
    with RayCluster(cpus=(2, 2)) as cluster:
        cells = [
            SETUP.format(folder=str(modules_folder), address=cluster.address),
            "first = launch(); print('FIRST', first)",
            EDIT.format(path=path),
            "second = launch(); print('SECOND', second)",
            "print('fresh servers:', all(a[4] != b[4] for a, b in zip(first, second)))",
        ]
        nb = run_notebook(cells, timeout=300, env={"NBACCEL_RENDERER": "text"}, shutdown=True)
    texts = [cell_text(c) for c in nb.cells]
    assert not any(cell_errors(c) for c in nb.cells), "\n-----\n".join(texts)
    nodes = re.search(r"on 2 Ray nodes \((\S+):1, (\S+):1;", texts[1])
    assert nodes, texts[1]
    for node in nodes.groups():
        assert f"('{node}', False, True, 1, " in texts[1], texts[1]
        lines = _notices(texts[1], f"{node}: ray_thread_lib is not preloaded for the ranks there")
        assert len(lines) == 1, texts[1]
        assert "its import started a thread ('ray-poller')" in lines[0], lines
        assert "NBACCEL_PRELOAD=-ray_thread_lib" in lines[0], lines
        # the edited file, as it is now, imported by a fresh server on each node
        assert f"('{node}', False, True, 2, " in texts[3], texts[3]
        lines = _notices(texts[3], f"{node}: ray_version_lib changed since")
        assert len(lines) == 1, texts[3]
    assert not _notices(texts[3], "not preloaded"), texts[3]
    assert "fresh servers: True" in texts[4], texts
