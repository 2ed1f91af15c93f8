"""Time to the first optimizer step of real work, in real kernels: nbaccel vs Accelerate.

Run: PYTHONPATH=. .venv/bin/python benchmarks/bench_first_step.py [--kernels 3] [--later 2]

Workload (a): the notebook imports torch and transformers (``LlamaForCausalLM``) and the
launcher at its top, as notebooks do; the launched function imports transformers, builds a
small Llama from its config (hidden 256, 2 layers, vocabulary 32000), prepares it with the
library's own ``Accelerator`` (CPU ranks, gloo) and takes 3 AdamW steps. Measured: the time from
the ``notebook_launcher`` call to the last rank's first ``optimizer.step()`` (wall clock, shared
by the processes), on the kernel's first launch and on its later launches; the seconds each rank
spent importing; each rank's unique memory (USS) after its first step; the fork server's
resident memory (nbaccel). Each library runs in its own fresh kernel, ``--kernels`` kernels per
library, alternating; the figures are medians over kernels. The losses must be the same on
both libraries (the same work happened).

``--order after``: the launcher is imported after torch and transformers (nbaccel's fork server
then starts only when nbaccel is imported, and imports them from there).

``--pool`` adds workload (d): a new ``%%distributed`` pool whose first cell imports transformers
and takes a step, in a kernel that imported torch and transformers (nbaccel alone: its peer,
nbdistributed, is measured only where installed, and is not yet). Workloads (b) and (c) of the
design (DeepSpeed ZeRO-3, a 4-bit model) are not measured yet; (e), Ray nodes against Ray Train,
is ``bench_ray.py --first-step``, and ssh hosts ``bench_hosts.py --first-step`` (both reuse this
workload's function).

Results: benchmarks/results/first_step.json (with provenance).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

LIBRARIES = ("nbaccel", "accelerate")

IMPORTS = """
import torch, transformers
from transformers import LlamaConfig, LlamaForCausalLM
"""

FUNCTION = """
def train(folder):
    import json, os, time
    started = time.time()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from {lib} import Accelerator
    imported = time.time() - started
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=32000)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(1 + accelerator.process_index)
    first, losses, uss = None, [], None
    for _ in range(3):
        ids = torch.randint(0, 32000, (2, 64), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if first is None:
            first = time.time()
            import psutil
            uss = psutil.Process().memory_full_info().uss
        losses.append(round(float(loss), 5))
    result = {{"first_step": first, "losses": losses, "imports_s": imported, "uss": uss,
              "pid": os.getpid()}}
    # Accelerate's launcher returns nothing: both libraries' ranks leave their figures in files
    with open(os.path.join(folder, f"rank{{accelerator.process_index}}.json"), "w") as handle:
        json.dump(result, handle)
"""

LAUNCH = """
import contextlib, io, time, json, os, tempfile
calls = []
for launch in range({launches}):
    folder = tempfile.mkdtemp(prefix="first-step-")
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        called = time.time()
        notebook_launcher(train, args=(folder,), num_processes=2{extra})
    out = [json.load(open(os.path.join(folder, f"rank{{i}}.json"))) for i in range(2)]
    calls.append({{"first_step_s": max(r["first_step"] for r in out) - called,
                  "imports_s": max(r["imports_s"] for r in out),
                  "uss_mib": max(r["uss"] for r in out) / 2**20,
                  "losses": [r["losses"] for r in out]}})
"""

REPORT = """
report = {"calls": calls}
try:
    from nbaccel.launch.launchers.forkserver import preload_report
    if "{lib}" == "nbaccel":
        report["preload"] = preload_report()
except Exception as exc:
    report["preload_error"] = repr(exc)
print("RESULT " + json.dumps(report, default=str))
"""


def cells(lib: str, launches: int, order: str) -> list[str]:
    """The notebook of one kernel: imports at the top, the function, the launches, the report."""
    launcher = f"from {lib} import notebook_launcher\n"
    top = launcher + IMPORTS if order == "first" else IMPORTS + launcher
    extra = ", renderer=__import__('nbaccel.launch.driver.render').launch.driver.render.Renderer()"
    return [
        "import time, json\n" + top,
        FUNCTION.format(lib=lib),
        LAUNCH.format(launches=launches, extra=extra if lib == "nbaccel" else ""),
        REPORT.replace("{lib}", lib),
    ]


def one_kernel(lib: str, launches: int, order: str) -> dict:
    """Run the notebook for ``lib`` in a fresh kernel; its report."""
    from kernel import cell_errors, cell_text, run_notebook

    nb = run_notebook(cells(lib, launches, order), timeout=600, shutdown=True)
    for cell in nb.cells:
        if cell_errors(cell):
            raise RuntimeError(f"{lib}: {cell_text(cell)[-2000:]}")
    text = cell_text(nb.cells[-1])
    line = next(x for x in text.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


POOL_CELL = """%%distributed -n 2 --cpu
import json, os, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from nbaccel import Accelerator
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, vocab_size=32000)
model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(1))
loss = model(input_ids=ids, labels=ids).loss
accelerator.backward(loss)
optimizer.step()
print("STEP", json.dumps({"at": time.time(), "loss": float(loss)}))
"""


def pool_kernel() -> dict:
    """Workload (d): a new ``%%distributed`` pool whose first cell imports transformers and
    steps, in a kernel that imported torch and transformers: call to the last first step."""
    from kernel import cell_errors, cell_text, run_notebook

    nb = run_notebook(
        [
            "import time, json\nfrom nbaccel import notebook_launcher\n" + IMPORTS,
            "%load_ext nbaccel",
            "called = time.time()",
            POOL_CELL,
            "print('CALLED', called)",
        ],
        timeout=600,
        shutdown=True,
    )
    for cell in nb.cells:
        if cell_errors(cell):
            raise RuntimeError(f"pool: {cell_text(cell)[-2000:]}")
    steps = [
        json.loads(line.split("STEP ", 1)[1])
        for line in cell_text(nb.cells[3]).splitlines()
        if "STEP " in line
    ]
    called = float(cell_text(nb.cells[4]).split()[-1])
    return {"first_step_s": max(s["at"] for s in steps) - called, "ranks": len(steps)}


def measure_pool(kernels: int = 3) -> dict:
    """Workload (d) over ``kernels`` fresh kernels (nbaccel; nbdistributed when installed)."""
    import importlib.util

    runs = []
    for index in range(kernels):
        runs.append(pool_kernel())
        print(f"[first_step] pool kernel {index + 1}: {runs[-1]['first_step_s']:.2f} s", flush=True)
    peer = None if importlib.util.find_spec("nbdistributed") else "nbdistributed is not installed"
    return {
        "nbaccel_first_step_s": statistics.median(r["first_step_s"] for r in runs),
        "runs": runs,
        "peer": peer or "not measured",
    }


def measure(kernels: int = 3, later: int = 2, order: str = "first") -> dict:
    """``kernels`` fresh kernels per library, alternating; medians and ratios."""
    runs: dict[str, list[dict]] = {lib: [] for lib in LIBRARIES}
    loads = [os.getloadavg()[0]]
    for round_ in range(kernels):
        libs = LIBRARIES if round_ % 2 == 0 else LIBRARIES[::-1]
        for lib in libs:
            report = one_kernel(lib, 1 + later, order)
            runs[lib].append(report)
            loads.append(os.getloadavg()[0])
            first = report["calls"][0]
            print(
                f"[first_step] {lib:10s} kernel {round_ + 1}: first launch "
                f"{first['first_step_s']:.2f} s, later "
                f"{[round(c['first_step_s'], 2) for c in report['calls'][1:]]}, "
                f"load {loads[-1]:.1f}",
                flush=True,
            )
    result: dict = {"kernels": kernels, "later_launches": later, "order": order, "runs": runs}
    for lib, reports in runs.items():
        firsts = [r["calls"][0]["first_step_s"] for r in reports]
        laters = [statistics.median(c["first_step_s"] for c in r["calls"][1:]) for r in reports]
        result[lib] = {
            "first_launch_s": statistics.median(firsts),
            "later_launch_s": statistics.median(laters),
            "rank_imports_first_s": statistics.median(r["calls"][0]["imports_s"] for r in reports),
            "rank_imports_later_s": statistics.median(
                statistics.median(c["imports_s"] for c in r["calls"][1:]) for r in reports
            ),
            "rank_uss_mib": statistics.median(
                statistics.median(c["uss_mib"] for c in r["calls"]) for r in reports
            ),
        }
    nb_runs = runs["nbaccel"]
    rss = [r.get("preload", {}).get("server_rss") for r in nb_runs]
    result["nbaccel"]["server_rss_mib"] = (
        statistics.median(x for x in rss if x) / 2**20 if any(rss) else None
    )
    result["nbaccel"]["preloaded"] = nb_runs[-1].get("preload", {}).get("preloaded")
    result["nbaccel"]["refused"] = nb_runs[-1].get("preload", {}).get("refused")
    for key in ("first_launch_s", "later_launch_s", "rank_uss_mib"):
        result[f"ratio_{key}"] = result["nbaccel"][key] / result["accelerate"][key]
    losses = {
        lib: [c["losses"] for r in reports for c in r["calls"]] for lib, reports in runs.items()
    }
    result["same_losses"] = all(
        a == b for a, b in zip(losses["nbaccel"], losses["accelerate"], strict=False)
    )
    result["load_average"] = {"start": loads[0], "max": max(loads), "end": loads[-1]}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=3, help="fresh kernels per library")
    parser.add_argument("--later", type=int, default=2, help="launches after the first, per kernel")
    parser.add_argument(
        "--order",
        choices=("first", "after"),
        default="first",
        help="the launcher imported before (first) or after torch and transformers",
    )
    parser.add_argument(
        "--pool", action="store_true", help="also workload (d): a new %%%%distributed pool"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    result = measure(args.kernels, args.later, args.order)
    if args.pool:
        result["pool"] = measure_pool(args.kernels)
    from provenance import stamp

    result["provenance"] = stamp()
    result["seconds"] = round(time.perf_counter() - started)
    name = "first_step.json" if args.order == "first" else "first_step_after.json"
    out = ROOT / "benchmarks" / "results" / name
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"\n{'':26s} {'nbaccel':>9s} {'Accelerate':>11s} {'ratio':>7s}")
    for key, label in (
        ("first_launch_s", "first launch of a kernel"),
        ("later_launch_s", "later launches"),
        ("rank_imports_first_s", "rank imports, first (s)"),
        ("rank_uss_mib", "rank USS (MiB)"),
    ):
        ours, peer = result["nbaccel"][key], result["accelerate"][key]
        print(f"{label:26s} {ours:9.2f} {peer:11.2f} {ours / peer:6.2f}x")
    if "pool" in result:
        pool = result["pool"]
        print(f"new %%distributed pool + first cell: {pool['nbaccel_first_step_s']:.2f} s "
              f"(peer: {pool['peer']})")  # fmt: skip
    print(f"fork server RSS: {result['nbaccel']['server_rss_mib']} MiB; same losses: "
          f"{result['same_losses']}; load {result['load_average']}; wrote {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
