"""What a large return value costs the notebook: the driver's peak memory while it arrives.

    .venv/bin/python benchmarks/bench_large_results.py --gib 1 --ranks 1
    .venv/bin/python benchmarks/bench_large_results.py --gib 1 --ranks 2

Each rank returns a ``--gib`` GiB float32 tensor. This process is the notebook (a fresh one per
run): a sampler thread reads its RSS every 5 ms (``VmHWM`` is read too, the kernel's own peak),
and the figure is the peak growth over the RSS before the launch, with the results touched
(summed) so their pages count. Target: at most 1.25x the returned size. Results go to
``benchmarks/results/bench_large_results.json``. Never asserted in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _returns(nbytes: int):
    import os

    import torch

    return torch.full((nbytes // 4,), float(os.environ["RANK"]), dtype=torch.float32)


def measure(gib: float, ranks: int) -> dict:
    from nbaccel import notebook_launcher
    from nbaccel.launch.driver.renderer import Renderer

    nbytes = int(gib * 2**30)
    notebook_launcher(_returns, (4096,), num_processes=ranks, renderer=Renderer())  # warm up
    base, hwm_before = _rss(), _hwm()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    results = notebook_launcher(_returns, (nbytes,), num_processes=ranks, renderer=Renderer())
    seconds = time.perf_counter() - start
    sums = [float(t.sum()) for t in results]  # touch every page of the results
    peak[0] = max(peak[0], _rss())
    done.set()
    sampler.join()
    assert sums == [float(r) * (nbytes // 4) for r in range(ranks)]
    returned = nbytes * ranks
    hwm = _hwm()
    growth = max(peak[0], hwm if hwm > hwm_before else 0) - base
    return {
        "gib_per_rank": gib,
        "ranks": ranks,
        "seconds": round(seconds, 2),
        "peak_growth_gib": round(growth / 2**30, 2),
        "ratio_to_returned": round(growth / returned, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument(
        "--output", default=str(ROOT / "benchmarks/results/bench_large_results.json")
    )
    args = parser.parse_args()
    report = measure(args.gib, args.ranks)
    print(json.dumps(report))
    results = {}
    if os.path.exists(args.output):
        with open(args.output) as handle:
            results = json.load(handle)
    from provenance import stamp  # the date, commit and machine of this run

    report["provenance"] = stamp()
    results[f"{args.gib}GiB x {args.ranks}"] = report
    with open(args.output, "w") as handle:
        json.dump(results, handle, indent=1)
        handle.write("\n")


if __name__ == "__main__":
    main()
