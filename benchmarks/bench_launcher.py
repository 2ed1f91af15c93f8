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

CELLS = [
    """
import time, json, statistics, os, threading
t0 = time.perf_counter()
import nbaccel
from nbaccel import notebook_launcher
from nbaccel.launch.render import Renderer
import_s = time.perf_counter() - t0
def noop():
    return None
t0 = time.perf_counter()
notebook_launcher(noop, num_processes=2, renderer=Renderer())
first_s = time.perf_counter() - t0
""",
    f"""
import accelerate
from accelerate import notebook_launcher as acc_launcher
import contextlib, io
nb_times, acc_times = [], []
for i in range({REPEATS}):
    t0 = time.perf_counter(); notebook_launcher(noop, num_processes=2, renderer=Renderer())
    nb_times.append(time.perf_counter() - t0)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        t0 = time.perf_counter(); acc_launcher(noop, num_processes=2)
        acc_times.append(time.perf_counter() - t0)
""",
    """
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
added_gib = (base - min(samples)) / 2**30
print(json.dumps({
    "import_s": import_s, "first_launch_s": first_s,
    "nbaccel_median_s": statistics.median(nb_times),
    "accelerate_median_s": statistics.median(acc_times),
    "nbaccel_times": nb_times, "accelerate_times": acc_times,
    "ratio_nbaccel_over_accelerate": statistics.median(nb_times) / statistics.median(acc_times),
    "ram_added_gib_1gib_tensor_2_ranks": added_gib, "accelerate_version": accelerate.__version__,
}))
""",
]


def main() -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    NotebookClient(nb, timeout=600, kernel_name="python3").execute()
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    result = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
    out = ROOT / "benchmarks" / "results" / "launcher.json"
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
