"""Launch-to-return of a no-op on 2 ranks in one real Jupyter kernel: nbaccel vs accelerate.

Run: .venv/bin/python benchmarks/bench_launcher.py   (needs `pip install -c constraints.txt
accelerate`). Alternates the two launchers (>= 6 each), reports medians and their ratio, the
first launch after `import nbaccel` (fork-server warm-up), and the RAM added when a 1 GiB tensor
is passed to 2 ranks. Results go to benchmarks/results/launcher.json. Never run in CI.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 8


def cells(ranks: tuple[int, ...], repeats: int, ram: bool) -> list[str]:
    """The notebook: import + first launch, then both launchers alternated at each rank count,
    then (``ram``) the RAM added while 2 ranks read a 1 GiB tensor passed in ``args``."""
    setup = """
import time, json, statistics, os, threading
t0 = time.perf_counter()
import nbaccel
from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer
import_s = time.perf_counter() - t0
def noop():
    return None
t0 = time.perf_counter()
notebook_launcher(noop, num_processes=2, renderer=Renderer())
first_s = time.perf_counter() - t0
result = {"import_s": import_s, "first_launch_s": first_s}
"""
    peer = """
import accelerate
from accelerate import notebook_launcher as acc_launcher
# as after a pause in a notebook: the fork server has imported what the kernel just did (the
# peer's library), instead of importing it while the launches below are timed
from nbaccel.launch.launchers.forkserver.launcher import wait_preloaded
wait_preloaded()
"""
    alternate = f"""
import contextlib, io
result["accelerate_version"] = accelerate.__version__
for ranks in {tuple(ranks)!r}:
    nb_times, acc_times = [], []
    for i in range({repeats}):
        t0 = time.perf_counter(); notebook_launcher(noop, num_processes=ranks, renderer=Renderer())
        nb_times.append(time.perf_counter() - t0)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            t0 = time.perf_counter(); acc_launcher(noop, num_processes=ranks)
            acc_times.append(time.perf_counter() - t0)
    suffix = "" if ranks == 2 else f"_{{ranks}}"
    result["nbaccel_median_s" + suffix] = statistics.median(nb_times)
    result["accelerate_median_s" + suffix] = statistics.median(acc_times)
    result["nbaccel_times" + suffix], result["accelerate_times" + suffix] = nb_times, acc_times
    result["ratio_nbaccel_over_accelerate" + suffix] = (
        statistics.median(nb_times) / statistics.median(acc_times))
"""
    memory = """
import psutil, torch
big = torch.ones(256 * 1024 * 1024)  # 1 GiB of float32
def touch(t):
    s = float(t.sum())  # read every page
    time.sleep(1.5)
    return s
samples = []
stop = threading.Event()
def sample():
    while not stop.is_set():
        samples.append(psutil.virtual_memory().available)
        time.sleep(0.05)
base = psutil.virtual_memory().available
th = threading.Thread(target=sample); th.start()
out = notebook_launcher(touch, args=(big,), num_processes=2, renderer=Renderer())
stop.set(); th.join()
result["ram_added_gib_1gib_tensor_2_ranks"] = (base - min(samples)) / 2**30
"""
    return [setup, peer, alternate, *([memory] if ram else []), "print(json.dumps(result))"]


def measure(ranks: tuple[int, ...] = (2,), repeats: int = REPEATS, ram: bool = True) -> dict:
    """Run the notebook in a fresh kernel and return its figures (also for benchmarks/gate)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells(ranks, repeats, ram)]
    NotebookClient(nb, timeout=900, kernel_name="python3").execute()
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def main() -> None:
    result = measure()
    out = ROOT / "benchmarks" / "results" / "launcher.json"
    from provenance import stamp  # the date, commit and machine of this run

    result["provenance"] = stamp()
    out.write_text(json.dumps(result, indent=2) + "\n")
    for key in (
        "import_s",
        "first_launch_s",
        "nbaccel_median_s",
        "accelerate_median_s",
        "ratio_nbaccel_over_accelerate",
        "ram_added_gib_1gib_tensor_2_ranks",
    ):
        print(f"{key:38s} {result[key]:.3f}")


if __name__ == "__main__":
    sys.exit(main())
