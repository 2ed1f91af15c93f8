"""A launch the machine cannot hold is refused before anything starts, with the numbers.

``num_processes=2**63`` once announced itself and grew the kernel until the OOM killer ended
it; ``%%distributed -n 10000`` and ``nbaccel launch --num_processes 10000`` likewise. A deleted
working directory (the ranks start in it) is named, with the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
from kernel import cell_text, run_notebook

from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.request import LaunchRequest
from nbaccel.notebook.kernel.pool import Pool

_TOO_MANY = 10**6  # more threads than any pid_max allows (4 194 304 at most)


def _forked_since(before: set[int]) -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)} - before


@pytest.mark.parametrize("n", [2**63, _TOO_MANY])
def test_notebook_launcher_refuses_more_ranks_than_the_machine_holds(n):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="this machine cannot hold the launch") as info:
        notebook_launcher(print, num_processes=n, renderer=Renderer())
    assert f"num_processes={n}" in str(info.value)
    assert "Use at most" in str(info.value)
    assert _forked_since(before) == set()


def test_the_pool_refuses_more_ranks_than_the_machine_holds():
    with pytest.raises(ValueError, match="Use at most"):
        Pool(LaunchRequest(num_processes=_TOO_MANY))


def test_nbaccel_launch_refuses_more_ranks_than_the_machine_holds(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    done = subprocess.run(
        [sys.executable, "-m", "nbaccel.cli", "launch", "--cpu",
         "--num_processes", str(_TOO_MANY), str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "this machine cannot hold the launch" in done.stderr + done.stdout
    assert "ran" not in done.stdout


def test_distributed_magic_refuses_more_ranks_than_the_machine_holds():
    nb = run_notebook(["%load_ext nbaccel", f"%%distributed -n {_TOO_MANY}\nprint('ran')"])
    text = cell_text(nb.cells[1])
    assert "this machine cannot hold the launch" in text
    assert "Starting a pool" not in text


def _here() -> str:
    return os.getcwd()


def test_a_deleted_working_directory_is_named_with_the_fix(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    here = os.getcwd()
    os.chdir(gone)
    try:
        gone.rmdir()
        with pytest.raises(FileNotFoundError) as info:
            notebook_launcher(_here, num_processes=1, renderer=Renderer())
    finally:
        os.chdir(here)
    assert str(gone) in str(info.value)
    assert "os.chdir" in str(info.value)
