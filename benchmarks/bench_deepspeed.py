"""DeepSpeed ZeRO 0-3 on 2 CPU ranks: nbaccel vs torch DDP vs Accelerate's own DeepSpeed path.

Run: .venv/bin/python benchmarks/bench_deepspeed.py [--steps 30 --rounds 2]   (the peer needs
`pip install -c constraints.txt "accelerate==1.15.0"`). Each variant runs in fresh ranks (so the
peak memory is its own): a small transformer LM (vocab 1000, width 128, 2 layers, sequence 32),
AdamW, micro batch 8 per rank, one thread per rank, the same DeepSpeed config for nbaccel and
Accelerate (gradient_clipping 0, no "auto" left). Variants run in rotated order for ``--rounds``
rounds. Reported per variant: median steps/s after 5 warm-up steps, each rank's peak RSS and its
growth over the run, and the parameter / gradient / optimizer-state bytes each rank holds
(``nbaccel.training_memory``); ratios against DDP. Accelerate runs DeepSpeed on CPU ranks only
with ``InitProcessGroupKwargs(backend="gloo")`` (without it, it asserts on the batch size); that
is how it is run here. Both DeepSpeed paths leave out DeepSpeed's shared-memory op (built for
minutes, used by inference all-reduce only). Results: benchmarks/results/deepspeed.json. Never
run in CI.
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
sys.path.insert(0, str(ROOT))

MICRO = 8
WARMUP = 5


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "train_batch_size": MICRO * 2,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _workload(steps: int):
    """The model, its optimizer, the data and the loss of one run."""
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self, vocab=1000, d=128, layers=2, heads=4, seq=32):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.zeros(seq, d))
            layer = nn.TransformerEncoderLayer(d, heads, 4 * d, 0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens) + self.pos))

    g = torch.Generator().manual_seed(0)
    total = (steps + WARMUP) * MICRO * 2
    tokens = torch.randint(0, 1000, (total, 33), generator=g)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_of(out, target):
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    return model, optimizer, data, loss_of


def _prepared(variant: str, model, optimizer, data):
    """``(model, optimizer, loader, step(loss), rank)`` for one variant."""
    import torch

    kind, _, stage = variant.partition("_zero")
    if kind == "ddp":
        import torch.distributed as dist

        from nbaccel.distributed.state import PartialState

        PartialState()  # the gloo group
        model = torch.nn.parallel.DistributedDataParallel(model)
        sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=False)
        loader = torch.utils.data.DataLoader(data, batch_size=MICRO, sampler=sampler)

        def step(loss):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        return model, optimizer, loader, step, dist.get_rank()
    from nbaccel.training.strategies.deepspeed.runtime import import_deepspeed

    import_deepspeed("cpu")  # the same DeepSpeed set-up for both paths (no shm op build)
    if kind == "nbaccel":
        from nbaccel import Accelerator, DeepSpeedPlugin

        accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_config(int(stage)))
        )
    else:
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

        accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_config(int(stage))),
            kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
        )
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    def step(loss):
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, loader, step, accelerator.process_index


def _rank(variant: str, steps: int) -> dict:
    """One variant on this rank: build, warm up, time ``steps`` steps, count memory."""
    import resource

    import torch

    torch.set_num_threads(1)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model, optimizer, data, loss_of = _workload(steps)
    model, optimizer, loader, backward, rank = _prepared(variant, model, optimizer, data)
    times = []
    for i, (x, y) in enumerate(loader):
        if i == steps + WARMUP:
            break
        start = time.perf_counter()
        backward(loss_of(model(x), y))
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    from nbaccel import training_memory

    held = training_memory(model, optimizer, rank)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "steps_per_s": len(times) / sum(times),
        "peak_rss_mib": peak / 1024,
        "rss_growth_mib": (peak - rss0) / 1024,
        "parameters": held.parameters,
        "gradients": held.gradients,
        "optimizer_states": held.optimizer_states,
    }


def _run(variant: str, steps: int) -> dict:
    from nbaccel.testing import run_on_ranks

    try:
        ranks = run_on_ranks(_rank, 2, args=(variant, steps), timeout=900,
                             env={"DS_ACCELERATOR": "cpu"})  # fmt: skip
    except Exception as exc:  # a peer that does not run here is reported, not fatal
        return {"error": f"{type(exc).__name__}: {str(exc)[-600:]}"}
    return {"ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    variants = ["ddp"] + [f"{k}_zero{s}" for s in range(4) for k in ("nbaccel", "accelerate")]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for round_index in range(args.rounds):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            result = _run(variant, args.steps)
            runs[variant].append(result)
            print(variant, json.dumps(result)[:300], flush=True)
    summary = {}
    for variant, results in runs.items():
        ok = [r for r in results if "ranks" in r]
        if not ok:
            summary[variant] = {"error": results[-1]["error"]}
            continue
        per_rank = list(zip(*(r["ranks"] for r in ok), strict=True))
        summary[variant] = {
            "steps_per_s": statistics.median(
                statistics.mean(rank["steps_per_s"] for rank in r["ranks"]) for r in ok
            ),
            "per_rank": [
                {k: statistics.median(run[k] for run in rank_runs) for k in rank_runs[0]}
                for rank_runs in per_rank
            ],
        }
    base = summary["ddp"]
    for entry in summary.values():
        if "steps_per_s" not in entry or "steps_per_s" not in base:
            continue
        held = entry["per_rank"][0]
        ref = base["per_rank"][0]
        entry["vs_ddp"] = {
            "steps_per_s": entry["steps_per_s"] / base["steps_per_s"],
            "param_plus_optimizer_bytes": (held["parameters"] + held["optimizer_states"])
            / (ref["parameters"] + ref["optimizer_states"]),
            "peak_rss": held["peak_rss_mib"] / ref["peak_rss_mib"],
        }
    for stage in range(4):
        ours, peer = summary[f"nbaccel_zero{stage}"], summary[f"accelerate_zero{stage}"]
        if "steps_per_s" in ours and "steps_per_s" in peer:
            ours["vs_accelerate_steps_per_s"] = ours["steps_per_s"] / peer["steps_per_s"]
    import deepspeed
    import torch
    from provenance import stamp  # the date, commit and machine of this run

    try:
        import accelerate

        peer_version = accelerate.__version__
    except ImportError:
        peer_version = None
    report = {
        "provenance": stamp(),
        "load_average": os.getloadavg()[0],
        "versions": {
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "accelerate": peer_version,
        },  # fmt: skip
        "ranks": 2,
        "steps": args.steps,
        "rounds": args.rounds,
        "model": "TinyLM vocab 1000, width 128, 2 layers, seq 32; AdamW; micro batch 8 per rank",
        "variants": summary,
        "runs": runs,
    }
    out = ROOT / "benchmarks" / "results" / "deepspeed.json"
    out.write_text(json.dumps(report, indent=2))
    for variant, entry in summary.items():
        if "error" in entry:
            print(f"{variant:18s} does not run: {entry['error'][:200]}")
            continue
        r0 = entry["per_rank"][0]
        ratio = entry.get("vs_ddp", {})
        print(f"{variant:18s} {entry['steps_per_s']:7.2f} steps/s "
              f"({ratio.get('steps_per_s', 1):.2f}x DDP)  peak RSS {r0['peak_rss_mib']:7.1f} MiB  "
              f"params+opt {ratio.get('param_plus_optimizer_bytes', 1):.2f}x DDP")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
