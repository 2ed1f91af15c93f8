"""Widgets: message rate of bridged tqdm from 2 ranks, and the training slowdown they cause.

    .venv/bin/python benchmarks/bench_widgets.py [--runs 5]

1. Event rate at the driver: 2 ranks each run a 100k-iteration tqdm loop, with tqdm's default
   ``mininterval`` and with ``mininterval=0`` (display on every iteration: the coalescing limit
   does the work); progress events per bar per second, and all events per second.
2. Frontend traffic: the same loop in a real Jupyter kernel with the widget renderer; iopub
   ``comm_msg`` messages (widget updates) per second during the launch.
3. Training slowdown: a small MLP trained for a fixed number of steps on 2 ranks, timed inside the
   ranks: no bar and no monitor, vs plain tqdm writing text to stderr, vs the bridged bar plus
   the memory monitor; conditions alternate, medians over ``--runs`` launches each. The main
   figure is the CPU time of each rank process (all its threads: the sampler and the flusher
   included), which stays meaningful on a loaded machine; wall time is reported too.

Writes benchmarks/results/widgets.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer

RESULTS = Path(__file__).resolve().parent / "results" / "widgets.json"


class Counting(Renderer):
    def __init__(self) -> None:
        self.kinds: Counter = Counter()
        self.bars: Counter = Counter()
        self.final: dict = {}

    def event(self, rank, kind, payload):
        self.kinds[kind] += 1
        if kind == "progress":
            self.bars[rank, payload.bar] += 1
            if payload.final:
                self.final[rank, payload.bar] = payload


def tqdm_loop(n: int, mininterval: float) -> float:
    import math

    from tqdm.auto import tqdm

    acc = 0.0
    start = time.perf_counter()
    for i in tqdm(range(n), mininterval=mininterval):
        acc += math.sqrt(i) * math.sin(i)
    return time.perf_counter() - start


def message_rate(n: int = 100_000) -> dict:
    out = {}
    for mininterval in (0.1, 0.0):
        rec = Counting()
        t0 = time.perf_counter()
        loops = notebook_launcher(tqdm_loop, (n, mininterval), num_processes=2, renderer=rec)
        wall = time.perf_counter() - t0
        finals = list(rec.final.values())
        out[f"mininterval={mininterval}"] = {
            "loop_seconds_per_rank": [round(s, 3) for s in loops],
            "progress_events_per_bar": dict(
                sorted((f"rank{r}", c) for (r, _), c in rec.bars.items())
            ),
            "progress_events_per_bar_per_s": round(
                max(c for c in rec.bars.values()) / max(loops), 2
            ),
            "all_events": dict(rec.kinds),
            "all_events_per_s": round(sum(rec.kinds.values()) / wall, 2),
            "final_n_exact": all(f.n == n == f.total for f in finals) and len(finals) == 2,
        }
    return out


KERNEL_CODE = """
import time
from nbaccel import notebook_launcher
def loop(n):
    import math
    from tqdm.auto import tqdm
    acc = 0.0
    for i in tqdm(range(n), mininterval=0):
        acc += math.sqrt(i) * math.sin(i)
notebook_launcher(loop, (100_000,), num_processes=2)
"""


def frontend_rate() -> dict:
    """Widget messages a frontend receives while 2 ranks run the loop (real kernel)."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        kc.execute_interactive("import nbaccel", timeout=120)
        warm = "nbaccel.notebook_launcher(print, ('warm',), num_processes=2)"
        kc.execute_interactive(warm, timeout=120)
        counts: Counter = Counter()
        times: list[float] = []

        def hook(msg):
            counts[msg["msg_type"]] += 1
            times.append(time.perf_counter())

        t0 = time.perf_counter()
        kc.execute_interactive(KERNEL_CODE, output_hook=hook, timeout=300)
        wall = time.perf_counter() - t0
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return {
        "iopub_messages": dict(counts),
        "comm_msg_per_s": round(counts["comm_msg"] / wall, 1),
        "launch_wall_s": round(wall, 2),
    }


def train(steps: int, mode: str) -> tuple[float, float]:
    """Train a small MLP; mode: 'none' | 'tqdm-text' | 'bridged' (bar; monitor set by launcher)."""
    import tqdm as tqdm_module
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    steps_iter = range(steps)
    if mode == "bridged":
        steps_iter = tqdm_module.tqdm(steps_iter, desc="train")
    elif mode == "tqdm-text":  # tqdm's own class, writing \r text to the rank's stderr
        original = (
            tqdm_module.tqdm.__mro__[1]
            if tqdm_module.tqdm.__name__ == "RankTqdm"
            else tqdm_module.tqdm
        )
        steps_iter = original(steps_iter, desc="train", file=sys.stderr)
    start, cpu = time.perf_counter(), time.process_time()  # CPU: every thread of the rank
    for _ in steps_iter:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return time.perf_counter() - start, time.process_time() - cpu


def slowdown(runs: int, steps: int) -> dict:
    conditions = {
        "none": dict(mode="none", memory=False),
        "tqdm-text": dict(mode="tqdm-text", memory=False),
        "bridged+monitor": dict(mode="bridged", memory=True),
    }
    wall: dict[str, list[float]] = {k: [] for k in conditions}
    cpu: dict[str, list[float]] = {k: [] for k in conditions}
    notebook_launcher(train, (50, "none"), num_processes=2, renderer=Renderer(), memory=False)
    for _ in range(runs):
        for name, cfg in conditions.items():
            got = notebook_launcher(
                train,
                (steps, cfg["mode"]),
                num_processes=2,
                renderer=Renderer(),
                memory=cfg["memory"],
            )
            wall[name].extend(w for w, _ in got)
            cpu[name].extend(c for _, c in got)

    def summary(times: dict[str, list[float]]) -> dict:
        med = {k: statistics.median(v) for k, v in times.items()}
        return {
            "median_s": {k: round(v, 3) for k, v in med.items()},
            "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
            "slowdown_vs_none_pct": round(100 * (med["bridged+monitor"] / med["none"] - 1), 2),
            "slowdown_vs_tqdm_text_pct": round(
                100 * (med["bridged+monitor"] / med["tqdm-text"] - 1), 2
            ),
        }

    return {"steps": steps, "runs": runs, "cpu": summary(cpu), "wall": summary(wall)}


def raw_tqdm_cost(n: int = 100_000) -> dict:
    """The same loop in this process with tqdm's own class (display to /dev/null), for scale."""
    import math

    from tqdm.std import tqdm

    out = {}
    for mininterval in (0.1, 0.0):
        with open(os.devnull, "w") as null:
            start, acc = time.perf_counter(), 0.0
            for i in tqdm(range(n), mininterval=mininterval, file=null):
                acc += math.sqrt(i) * math.sin(i)
            out[f"mininterval={mininterval}"] = round(time.perf_counter() - start, 3)
    return {"loop_seconds_plain_tqdm_in_driver": out}


def component_costs(n: int = 3000) -> dict:
    """What the instrumentation costs a rank, piece by piece, measured in this process.

    A memory sample = read the counters + serialise the event (what ``emit`` sends); a progress
    send = the bridged bar's state + serialise it; a throttled display = the common case of a
    tqdm refresh inside the rate limit. The CPU share follows from the rates (2 samples/s,
    at most 10 sends/s per bar).
    """
    import cloudpickle

    from nbaccel.notebook.events import ProgressUpdate
    from nbaccel.notebook.rank.memory_sampler import sample_memory
    from nbaccel.notebook.rank.progress_bridge import RankTqdm

    def per_call(fn) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    sample_us = per_call(lambda: cloudpickle.dumps(("event", "memory", sample_memory())))
    bar = RankTqdm(total=10**9, mininterval=0)
    update = ProgressUpdate(1, "train", 5, 10, 1.0, 5.0)
    send_us = per_call(lambda: (bar.format_dict, cloudpickle.dumps(("event", "progress", update))))
    throttled_us = per_call(lambda: bar.display())
    bar.close()
    share = (2 * sample_us + 10 * send_us) / 1e6 * 100
    return {
        "memory_sample_us": round(sample_us, 1),
        "progress_send_us": round(send_us, 1),
        "throttled_display_us": round(throttled_us, 2),
        "cpu_share_pct_one_bar_plus_monitor": round(share, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--skip-kernel", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}",
        "component_costs": component_costs(),
        "message_rate": message_rate(),
        "plain_tqdm": raw_tqdm_cost(),
        "frontend": None if args.skip_kernel else frontend_rate(),
        "training": slowdown(args.runs, args.steps),
    }
    RESULTS.parent.mkdir(exist_ok=True)
    from provenance import stamp  # the date, commit and machine of this run

    result["provenance"] = stamp()
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
