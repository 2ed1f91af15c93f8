"""Training steps per second on 2 gloo ranks: hand-written DDP vs nbaccel vs accelerate.

Run: .venv/bin/python benchmarks/bench_training.py [--kept-memory]
(needs `pip install -c constraints.txt "accelerate==1.15.0"`). Both ranks build the three loops
once, then interleave them in short chunks of steps (rotating the order each round), so that
load from other processes on the machine hits all three alike. Reported: median steps/s per
loop, and the median over rounds of the paired per-round ratios (the robust figure on a noisy
machine). Results go to benchmarks/results/training.json. Two models: a small transformer
encoder and the MLP of ANCHORS.md (256-1024-1024-10), AdamW, batch 16 per rank, one thread per
rank. ``--kept-memory`` runs the MLP with the ranks' malloc tuning off and on, alternating (3 each),
to results/training_kept_memory.json. Never run in CI.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROUNDS = {"transformer": (30, 4), "mlp": (40, 10)}  # rounds, steps per chunk
BATCH = 16  # per rank


def _transformer():
    import torch

    class TinyLM(torch.nn.Module):
        def __init__(self, vocab=1000, d=128, layers=2, heads=4, seq=32):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, d)
            self.pos = torch.nn.Parameter(torch.zeros(seq, d))
            layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, 0.0, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(d, vocab)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens) + self.pos))

    g = torch.Generator().manual_seed(0)
    rounds, chunk = ROUNDS["transformer"]
    steps = (rounds + 1) * chunk
    tokens = torch.randint(0, 1000, (steps * BATCH * 2, 33), generator=g)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def loss_fn(out, target):
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    return TinyLM, data, loss_fn, steps


def _mlp():
    import torch

    def make():
        return torch.nn.Sequential(
            torch.nn.Linear(256, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 10),
        )

    g = torch.Generator().manual_seed(0)
    rounds, chunk = ROUNDS["mlp"]
    steps = (rounds + 1) * chunk
    x = torch.randn(steps * BATCH * 2, 256, generator=g)
    y = torch.randint(0, 10, (steps * BATCH * 2,), generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    return make, data, torch.nn.functional.cross_entropy, steps


def _rank_main(workload: str, rounds_chunk: tuple[int, int] | None = None) -> dict:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import nbaccel

    torch.set_num_threads(1)
    make_model, data, loss_fn, steps = (_transformer if workload == "transformer" else _mlp)()
    state = nbaccel.PartialState()

    def fresh():
        torch.manual_seed(0)
        model = make_model()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    # hand-written DDP
    model, opt = fresh()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    sampler = DistributedSampler(data, shuffle=False)
    hand_loader = DataLoader(data, batch_size=BATCH, sampler=sampler)

    def hand_steps(batches, n):
        for _ in range(n):
            x, y = next(batches)
            loss = loss_fn(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    # nbaccel
    nb = nbaccel.Accelerator()
    nb_model, nb_opt = fresh()
    nb_model, nb_opt, nb_loader = nb.prepare(nb_model, nb_opt, DataLoader(data, batch_size=BATCH))

    def nb_steps(batches, n):
        for _ in range(n):
            x, y = next(batches)
            loss = loss_fn(nb_model(x), y)
            nb.backward(loss)
            nb_opt.step()
            nb_opt.zero_grad()

    # accelerate
    import accelerate

    hf = accelerate.Accelerator(cpu=True)
    hf_model, hf_opt = fresh()
    hf_model, hf_opt, hf_loader = hf.prepare(hf_model, hf_opt, DataLoader(data, batch_size=BATCH))

    def hf_steps(batches, n):
        for _ in range(n):
            x, y = next(batches)
            loss = loss_fn(hf_model(x), y)
            hf.backward(loss)
            hf_opt.step()
            hf_opt.zero_grad()

    loops = {
        "hand_ddp": (hand_steps, iter(hand_loader)),
        "nbaccel": (nb_steps, iter(nb_loader)),
        "accelerate": (hf_steps, iter(hf_loader)),
    }
    checks = {
        "nbaccel_wrapped": type(nb_model).__name__,
        "accelerate_wrapped": type(hf_model).__name__,
        "accelerate_num_processes": hf.num_processes,
        "batches_per_epoch": [len(hand_loader), len(nb_loader), len(hf_loader)],
    }
    rounds, chunk = rounds_chunk or ROUNDS[workload]
    for run, batches in loops.values():  # warm-up chunk each
        run(batches, chunk)
    times: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(rounds):
        order = names[r % 3 :] + names[: r % 3]
        for name in order:
            run, batches = loops[name]
            dist.barrier()
            start = time.perf_counter()
            run(batches, chunk)
            dist.barrier()
            times[name].append(chunk / (time.perf_counter() - start))
    return {"steps_per_s": times, "checks": checks, "rank": state.process_index}


def measure(
    workloads: tuple[str, ...] = ("transformer", "mlp"),
    rounds_chunk: tuple[int, int] | None = None,
) -> dict:
    """Run each workload on 2 ranks and return the report (also for benchmarks/gate)."""
    from nbaccel.testing import run_on_ranks

    report: dict = {"rounds": ROUNDS, "batch_per_rank": BATCH, "ranks": 2, "workloads": {}}
    for workload in workloads:
        result = run_on_ranks(_rank_main, args=(workload, rounds_chunk), timeout=900)[0]
        rates = result["steps_per_s"]
        med = {k: statistics.median(v) for k, v in rates.items()}

        def paired(a: str, b: str, rates=rates) -> float:
            return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

        entry = {
            "steps_per_s": rates,
            "median_steps_per_s": med,
            "paired_nbaccel_over_hand_ddp": paired("nbaccel", "hand_ddp"),
            "paired_accelerate_over_hand_ddp": paired("accelerate", "hand_ddp"),
            "paired_nbaccel_over_accelerate": paired("nbaccel", "accelerate"),
            "median_nbaccel_over_hand_ddp": med["nbaccel"] / med["hand_ddp"],
            "median_accelerate_over_hand_ddp": med["accelerate"] / med["hand_ddp"],
            "checks": result["checks"],
        }
        report["workloads"][workload] = entry
        rounds, chunk = rounds_chunk or ROUNDS[workload]
        print(f"== {workload}: {rounds} rounds of {chunk} steps per loop, 2 ranks")
        for name, value in med.items():
            print(f"  {name:11s} median {value:8.2f} steps/s")
        print(
            f"  nbaccel / hand DDP    paired {entry['paired_nbaccel_over_hand_ddp']:.3f}  "
            f"(medians {entry['median_nbaccel_over_hand_ddp']:.3f})\n"
            f"  accelerate / hand DDP paired {entry['paired_accelerate_over_hand_ddp']:.3f}  "
            f"(medians {entry['median_accelerate_over_hand_ddp']:.3f})\n"
            f"  nbaccel / accelerate  paired {entry['paired_nbaccel_over_accelerate']:.3f}\n"
            f"  checks {result['checks']}"
        )
    return report


def measure_kept_memory(repeat: int = 3) -> dict:
    """The MLP workload with the ranks' malloc tuning off (``NBACCEL_KEEP_FREED_MEMORY=0``:
    glibc's defaults, as in Accelerate's ranks) and on (the default), alternating: each loop's
    median steps/s, and the minor page faults per step of a plain loop (median of the runs)."""
    import os

    from nbaccel.testing import run_on_ranks

    runs: dict[str, list[dict]] = {"glibc defaults": [], "kept (default)": []}
    for _ in range(repeat):
        for label, flag in (("glibc defaults", "0"), ("kept (default)", "1")):
            os.environ["NBACCEL_KEEP_FREED_MEMORY"] = flag
            try:
                result = run_on_ranks(_rank_main, args=("mlp", None), timeout=900)[0]
                faults = run_on_ranks(_faults_per_step, timeout=300)
            finally:
                del os.environ["NBACCEL_KEEP_FREED_MEMORY"]
            medians = {k: statistics.median(v) for k, v in result["steps_per_s"].items()}
            runs[label].append({"steps_per_s": medians, "faults_per_step": max(faults)})
    report = {}
    for label, entries in runs.items():
        report[label] = {
            "steps_per_s": {
                loop: statistics.median(e["steps_per_s"][loop] for e in entries)
                for loop in entries[0]["steps_per_s"]
            },
            "faults_per_step": statistics.median(e["faults_per_step"] for e in entries),
        }
        print(f"== mlp, {label}: {report[label]}")
    return report


def _faults_per_step() -> int:
    """Minor page faults of the median step of a plain MLP loop (zero_grad after the step)."""
    import resource

    import torch

    torch.set_num_threads(1)
    model, data, loss_fn, _ = _mlp()
    model = model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = data[:BATCH]
    faults = []
    for i in range(26):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if i >= 5:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sorted(faults)[len(faults) // 2]


def main() -> None:
    kept_memory = "--kept-memory" in sys.argv
    report = measure_kept_memory() if kept_memory else measure()
    name = "training_kept_memory.json" if kept_memory else "training.json"
    out = ROOT / "benchmarks" / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    from provenance import stamp  # the date, commit and machine of this run

    report["provenance"] = stamp()
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
