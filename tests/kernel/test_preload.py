"""A kernel's ranks start with what the kernel imported (real kernel, real fork server, real
ranks): a library imported in the notebook is imported once, in the fork server, and inherited by
the ranks; one that starts a thread at import is kept out and named, and the launch goes on; a
module edited on ``sys.path`` is seen fresh by the next launch; a ``%%distributed`` pool's ranks
start with them as well. While the server is still importing, a launch forks its ranks from the
kernel (it has not used CUDA) rather than wait."""

from __future__ import annotations

import json

from kernel import cell_errors, cell_text, run_notebook

RECORDER = "import os\nIMPORTED_IN = os.getpid()\nVERSION = {version}\n"
SLOW = "import time\ntime.sleep(3)  # a library that takes a while to import\n"
THREADED = (
    "import threading, time\n"
    "threading.Thread(target=time.sleep, args=(60,), daemon=True, name='poller').start()\n"
)

LAUNCH = """
def where():
    import os, kernel_lib, threaded_lib
    from nbaccel.launch.rank.inherited import inherited_modules
    inherited = inherited_modules() or ()
    return {"imported_in": kernel_lib.IMPORTED_IN, "pid": os.getpid(), "parent": os.getppid(),
            "version": kernel_lib.VERSION, "threaded_inherited": "threaded_lib" in inherited}
print("OUT " + json.dumps(notebook_launcher(where, num_processes=2, cpu=True)))
"""


def _out(cell):
    line = next(x for x in cell_text(cell).splitlines() if x.startswith("OUT "))
    return json.loads(line[4:])


def test_ranks_start_with_the_kernels_libraries_kept_safe_and_fresh(tmp_path):
    (tmp_path / "kernel_lib.py").write_text(RECORDER.format(version=1))
    (tmp_path / "threaded_lib.py").write_text(THREADED)
    (tmp_path / "slow_lib.py").write_text(SLOW)
    edit = (
        f"import os\npath = {str(tmp_path / 'kernel_lib.py')!r}\n"
        f"open(path, 'w').write({RECORDER.format(version=2)!r})\n"
        "stat = os.stat(path)\nos.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))"
    )
    wait = (
        "from nbaccel.launch.launchers.forkserver.launcher import wait_preloaded\n"
        "wait_preloaded()\n"
    )
    nb = run_notebook(
        [
            f"import json, os, sys\nsys.path.insert(0, {str(tmp_path)!r})\n"
            "from nbaccel import notebook_launcher\nimport kernel_lib, threaded_lib, slow_lib\n"
            "print('OUT', os.getpid())",
            LAUNCH,  # at once: the server is still importing slow_lib
            wait + LAUNCH,
            edit,
            wait + LAUNCH,
            "from nbaccel.launch.launchers.forkserver.launcher import preload_report\n"
            "print('OUT ' + json.dumps(preload_report()))",
            "%load_ext nbaccel",
            "%%distributed -n 2\nimport os, kernel_lib\n"
            "print('POOL', kernel_lib.VERSION, kernel_lib.IMPORTED_IN == os.getppid())",
        ],
        timeout=180,
        env={"NBACCEL_PRELOAD": "auto"},
    )
    for cell in nb.cells:
        assert not cell_errors(cell), cell_text(cell)
    kernel = _out(nb.cells[0])
    early, first, second = _out(nb.cells[1]), _out(nb.cells[2]), _out(nb.cells[4])
    report = _out(nb.cells[5])
    # while the server still imports, a launch forks its ranks from the kernel (no CUDA here)
    assert all(rank["parent"] == kernel == rank["imported_in"] for rank in early)
    assert "ranks are forked from the notebook itself" in cell_text(nb.cells[1])
    for rank in first:  # imported once, in the server the ranks were forked from
        assert rank["imported_in"] == rank["parent"] not in (rank["pid"], kernel)
        assert rank["version"] == 1 and not rank["threaded_inherited"]
    text = cell_text(nb.cells[1]) + cell_text(nb.cells[2])
    assert "threaded_lib is not preloaded for the ranks: its import started a thread" in text
    assert "NBACCEL_PRELOAD=-threaded_lib" in text
    assert "ranks start with" in text and "kernel_lib" in text
    for rank in second:  # the edited file, from a fresh server that imported it
        assert rank["version"] == 2 and rank["imported_in"] == rank["parent"] != kernel
        assert rank["parent"] != first[0]["parent"]
    assert "kernel_lib" in report["preloaded"] and "threaded_lib" in report["refused"]
    assert report["server_rss"] > 0
    # a %%distributed pool's ranks start with them too
    pool = cell_text(nb.cells[7])
    assert pool.count("POOL 2 True") == 2, pool


STAMP = (
    "import os, time\n"
    "with open(os.environ['STAMP_LIB_OUT'], 'a') as out:\n"
    "    out.write(f'{os.getpid()} {time.time()}\\n')\n"
)


def test_the_server_steps_aside_while_ranks_forked_from_the_kernel_run(tmp_path):
    """nbaccel imported after the libraries: the server starts with them to import, the first
    launch forks its ranks from the kernel, and the server's imports wait until it ends."""
    (tmp_path / "slow_lib.py").write_text(SLOW.replace("3", "2"))
    (tmp_path / "stamp_lib.py").write_text(STAMP)
    out = tmp_path / "stamps"
    nb = run_notebook(
        [
            f"import json, os, sys, time\nsys.path.insert(0, {str(tmp_path)!r})\n"
            f"os.environ['STAMP_LIB_OUT'] = {str(out)!r}\n"
            "import slow_lib, stamp_lib\nfrom nbaccel import notebook_launcher\n"
            "print('OUT', os.getpid())",
            "def busy():\n    import time\n    time.sleep(6)\n    return time.time()\n"
            "ends = notebook_launcher(busy, num_processes=2, cpu=True)\n"
            "print('OUT ' + json.dumps(ends))",
            "from nbaccel.launch.launchers.forkserver.launcher import (\n"
            "    preload_report, wait_preloaded)\n"
            "wait_preloaded()\nprint('OUT ' + json.dumps(preload_report()['preloaded']))",
        ],
        timeout=180,
        env={"NBACCEL_PRELOAD": "auto"},
    )
    for cell in nb.cells:
        assert not cell_errors(cell), cell_text(cell)
    kernel, ends = _out(nb.cells[0]), _out(nb.cells[1])
    assert "ranks are forked from the notebook itself" in cell_text(nb.cells[1])
    assert "stamp_lib" in _out(nb.cells[2])
    stamps = [line.split() for line in out.read_text().splitlines()]
    in_server = [float(at) for pid, at in stamps if int(pid) != kernel]
    assert len(in_server) == 1, stamps  # the kernel's import, then the server's (once)
    # the server imported it only once the launch's ranks had ended (it was held meanwhile)
    assert in_server[0] >= max(ends), (in_server, ends)
