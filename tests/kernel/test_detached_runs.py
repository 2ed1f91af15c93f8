"""Detached runs from real kernels: a run outlives its kernel (SIGKILLed mid-run), a new kernel
re-attaches and sees every line in order, the live view and the results; a failing rank's
exception comes back on attach with its type, naming the rank; the stop button detaches from a
run, ``run.stop()`` stops it; nothing is left behind."""

from __future__ import annotations

import os
import re
import signal
import time

from detached import runs_fixture  # noqa: F401 (the fixture `runs`)
from kernel import cell_errors, cell_text, run_notebook, stream_text

from nbaccel.launch.detached.folder import RunFolder, RunState

LINES, SECONDS = 500, 5.0  # per rank: 1,000 lines over about 5 s

_START = f"""
import os
from nbaccel import notebook_launcher

def chatty(lines, seconds):
    import time
    from tqdm.auto import tqdm
    rank = int(os.environ["RANK"])
    for i in tqdm(range(lines), desc="steps"):
        print(f"line {{i}}", flush=True)
        time.sleep(seconds / lines)
    return f"rank {{rank}} printed {{lines}} lines"

run = notebook_launcher(chatty, ({LINES}, {SECONDS}), num_processes=2, cpu=True, detach=True)
print("RUN", run.id, "PID", os.getpid())
"""


def test_a_detached_run_outlives_its_killed_kernel_and_a_new_kernel_attaches(runs):
    root, _, env = runs
    first = run_notebook([_START], timeout=120, env=env)
    found = re.search(r"RUN (\S+) PID (\d+)", cell_text(first.cells[0]))
    assert found, cell_text(first.cells[0])
    run_id, kernel_pid = found.group(1), int(found.group(2))
    time.sleep(2.0)
    os.kill(kernel_pid, signal.SIGKILL)  # the kernel dies mid-run
    folder = RunFolder(root / run_id)
    assert folder.info().state in (RunState.STARTING, RunState.RUNNING, RunState.FINISHED)

    attach = f"import nbaccel\nrun = nbaccel.attach({run_id!r})\nprint('RESULT', run.result())"
    second = run_notebook([attach, "print(nbaccel.runs())"], timeout=180, env=env, shutdown=True)
    cell = second.cells[0]
    assert not cell_errors(cell), cell_text(cell)
    out = stream_text(cell)
    for rank in (0, 1):
        seen = [int(n) for n in re.findall(rf"^\[rank {rank}\] line (\d+)$", out, re.M)]
        assert seen == list(range(LINES)), (rank, seen[:5], len(seen))
    expected = [f"rank {r} printed {LINES} lines" for r in (0, 1)]
    assert f"RESULT {expected!r}" in out
    views = [o for o in cell.outputs if "application/vnd.jupyter.widget-view+json" in
             o.get("data", {})]  # fmt: skip
    assert views, "the re-attached cell shows the live view (progress, output by rank)"
    assert "2 ranks finished" in cell_text(cell)  # the view's summary: final bars
    assert "steps" in cell_text(cell)
    assert run_id in cell_text(second.cells[1]) and "finished" in cell_text(second.cells[1])
    assert folder.info().state == RunState.FINISHED


_SLEEPER = """
import os, nbaccel
from nbaccel import notebook_launcher

def ticks():
    import time
    for i in range(600):
        print(f"tick {i}", flush=True)
        time.sleep(0.1)

def fails_on_one():
    if int(os.environ["RANK"]) == 1:
        raise ValueError("rank one cannot go on")
    return "fine"

long = notebook_launcher(ticks, num_processes=2, cpu=True, detach=True)
"""


def test_the_stop_button_detaches_stop_stops_and_a_failing_rank_raises_on_attach(runs):
    root, _, env = runs
    nb = run_notebook(
        [
            _SLEEPER,
            "import time\nwhile not long.info.last_line:\n    time.sleep(0.2)",
            "nbaccel.attach(long.id)",  # the stop button, below: detaches, the run goes on
            "print('STATE', long.state)",
            "print('STOPPED', long.stop().state, long.info.reason)",
            "run = notebook_launcher(fails_on_one, num_processes=2, cpu=True, detach=True)",
            "nbaccel.attach(run.id).result()",
        ],
        timeout=120, env=env, shutdown=True, interrupt_after={2: 4.0},
    )  # fmt: skip
    attached = cell_text(nb.cells[2])
    assert "[rank 0] tick 0" in attached and "[rank 1] tick 0" in attached, attached
    assert "detached from run" in attached, attached
    assert "STATE running" in cell_text(nb.cells[3])
    assert "STOPPED stopped stopped" in cell_text(nb.cells[4])
    (error,) = cell_errors(nb.cells[6])
    assert error["ename"] == "ValueError", error
    assert error["evalue"] == "rank one cannot go on"  # as the rank saw it; the rank in a note
    assert "\nraised on rank 1" in "\n".join(error["traceback"])
    states = {i.name: i for i in (RunFolder(p).info() for p in root.iterdir() if p.is_dir())}
    assert states["ticks"].state == RunState.STOPPED
    assert states["fails_on_one"].state == RunState.FAILED
    assert states["fails_on_one"].reason == "ValueError: rank one cannot go on (raised on rank 1)"
