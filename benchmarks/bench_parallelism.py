"""Model-parallel layouts side by side on 4 gloo ranks: per-rank memory and step time.

Run: .venv/bin/python benchmarks/bench_parallelism.py   (accelerate installed for its rows).
One launch of 4 CPU ranks trains the same Llama (transformers, built from a config: hidden 256,
4 layers, vocab 2048, sequences of 64, global batch 8, AdamW) under each layout in turn:
DDP, FSDP2, HSDP 2x2, TP 4, TP 2 x FSDP2 2, pipeline (MegatronLMPlugin pp_degree=4, 4
micro-batches) and Megatron tp 2 x pp 2; and Accelerate's DDP as the peer, and Accelerate's
own ParallelismConfig path (recorded as what it says on CPU ranks). Two rounds, the order of
the layouts reversed in the second; step times are the median over both.

Per layout and rank: the model state it holds (parameters + gradients + optimizer state, local
shards only), the peak RSS growth while it trains (sampled every 5 ms, over the RSS before
its first step) and the median step time. Ratios are against nbaccel's DDP on the same run.
Results: benchmarks/results/parallelism.json. Never run in CI.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RANKS, GLOBAL_BATCH, SEQ, VOCAB = 4, 8, 64, 2048
WARMUP, STEPS, ROUNDS = 2, 6, 2


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ,
        tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _data():
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH * (WARMUP + STEPS), SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


class _PeakRss:
    """Peak RSS growth of this process over its value at start, sampled in a thread."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.start = self.peak = self.proc.memory_info().rss
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> _PeakRss:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.start


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _state_bytes(model, optimizer) -> dict[str, int]:
    inner = getattr(optimizer, "optimizer", optimizer)
    params = [p for g in inner.param_groups for p in g["params"]]
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for s in inner.state.values() for v in s.values() if hasattr(v, "numel")]
    return {
        "params": _local_bytes(params),
        "grads": _local_bytes(grads),
        "optimizer": _local_bytes(states),
    }


def _layouts():
    from nbaccel.parallelism_config import ParallelismConfig
    from nbaccel.utils import FullyShardedDataParallelPlugin, MegatronLMPlugin

    def fsdp():
        return FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["LlamaDecoderLayer"])

    return {
        "ddp": {},
        "fsdp2": {"fsdp_plugin": fsdp()},
        "hsdp_2x2": {
            "parallelism_config": ParallelismConfig(dp_replicate_size=2, dp_shard_size=2),
            "fsdp_plugin": fsdp(),
        },  # fmt: skip
        "tp_4": {"parallelism_config": ParallelismConfig(tp_size=4)},
        "tp_2_x_fsdp2_2": {
            "parallelism_config": ParallelismConfig(tp_size=2, dp_shard_size=2),
            "fsdp_plugin": fsdp(),
        },  # fmt: skip
        "pp_4": {"megatron_lm_plugin": MegatronLMPlugin(pp_degree=4, num_micro_batches=4)},
        "megatron_tp2_pp2": {
            "megatron_lm_plugin": MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=2)
        },
    }


def _train(accelerator, model, optimizer, loader) -> tuple[list[float], dict, int, float]:
    import torch.distributed as dist

    times, losses = [], []
    batches = iter(loader)
    for _warm in range(WARMUP):
        batch = next(batches)
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    with _PeakRss() as rss:
        for i in range(STEPS):
            batch = next(batches)
            dist.barrier()
            start = time.perf_counter()
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            dist.barrier()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
            if i != STEPS - 1:
                optimizer.zero_grad()
    state = _state_bytes(model, optimizer)
    optimizer.zero_grad()
    return times, state, rss.growth, losses[-1]


def _one_layout(name: str, options: dict, data: list) -> dict:
    import torch
    from torch.utils.data import DataLoader

    import nbaccel

    if name == "accelerate_ddp":
        import accelerate

        accelerator, dp = accelerate.Accelerator(cpu=True), RANKS
    else:
        accelerator = nbaccel.Accelerator(**options)
        dp = accelerator.strategy.data_parallel_size or RANKS
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // dp)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    times, state, rss, loss = _train(accelerator, model, optimizer, loader)
    return {"step_s": times, "state_bytes": state, "rss_growth": rss, "last_loss": loss}


def _rank_main(rounds: int) -> dict:
    """Every layout once per round, the order reversed every other round (load from other
    processes on the machine then hits early and late layouts alike)."""
    import gc

    import torch

    import nbaccel

    torch.set_num_threads(1)
    data = _data()
    out: dict = {"layouts": {}, "rank": nbaccel.PartialState().process_index}
    out["accelerate"] = _accelerate_refusals()
    layouts = _layouts()
    if "absent" not in out["accelerate"]:
        layouts = {"ddp": layouts.pop("ddp"), "accelerate_ddp": {}, **layouts}
    names = list(layouts)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            result = _one_layout(name, layouts[name], data)
            seen = out["layouts"].setdefault(name, {**result, "step_s": []})
            seen["step_s"] += result["step_s"]
            seen["rss_growth"] = max(seen["rss_growth"], result["rss_growth"])
            gc.collect()
    return out


def _accelerate_refusals() -> dict:
    """What Accelerate's own ParallelismConfig path does on these CPU ranks, as it says it."""
    try:
        import accelerate
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.state import AcceleratorState
    except ImportError:
        return {"absent": "accelerate is not installed"}
    rows: dict = {}
    for name, sizes in (("tp_2_x_fsdp2_2", {"tp_size": 2, "dp_shard_size": 2}),
                        ("hsdp_2x2", {"dp_replicate_size": 2, "dp_shard_size": 2})):  # fmt: skip
        try:
            accelerate.Accelerator(cpu=True, parallelism_config=ParallelismConfig(**sizes))
            rows[name] = {"constructed": True}
        except Exception as exc:  # recorded as it is
            rows[name] = {"refused": f"{type(exc).__name__}: {str(exc)[:300]}"}
        AcceleratorState._reset_state(True)
    return rows


def measure() -> dict:
    """Run every layout on 4 ranks; per layout: median step time and memory per rank, ratios to
    nbaccel's DDP (and to Accelerate's DDP for the step time)."""

    from nbaccel.testing import run_on_ranks

    ranks = run_on_ranks(_rank_main, RANKS, args=(ROUNDS,), timeout=2400)
    from provenance import stamp  # the date, commit and machine of this run

    report: dict = {
        "provenance": stamp(),
        "ranks": f"{RANKS} gloo ranks (1 thread each)",
        "model": "LlamaForCausalLM hidden 256, 4 layers, 8 heads, vocab 2048, seq 64",
        "global_batch": GLOBAL_BATCH,
        "steps_timed": STEPS * ROUNDS,
        "layouts": {},
    }
    base = None
    for name in ranks[0]["layouts"]:
        per_rank = [r["layouts"][name] for r in ranks]
        step = statistics.median(statistics.median(r["step_s"]) for r in per_rank)
        state = [sum(r["state_bytes"].values()) for r in per_rank]
        entry = {
            "median_step_s": step,
            "model_state_bytes_per_rank": state,
            "peak_rss_growth_bytes_per_rank": [r["rss_growth"] for r in per_rank],
            "state_bytes_detail_rank0": per_rank[0]["state_bytes"],
            "last_loss_per_rank": [r["last_loss"] for r in per_rank],
        }
        if name == "ddp":
            base = entry
        entry["step_time_over_ddp"] = step / base["median_step_s"]
        entry["max_state_over_ddp"] = max(state) / max(base["model_state_bytes_per_rank"])
        report["layouts"][name] = entry
    peer = report["layouts"].get("accelerate_ddp")
    if peer is not None:
        for entry in report["layouts"].values():
            entry["step_time_over_accelerate_ddp"] = entry["median_step_s"] / peer["median_step_s"]
    report["accelerate_parallelism_config"] = ranks[0]["accelerate"]
    return report


def main() -> None:
    report = measure()
    out = ROOT / "benchmarks" / "results" / "parallelism.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"{'layout':18s} {'step s':>8s} {'x DDP':>6s} {'state MiB/rank (max)':>21s} "
          f"{'x DDP':>6s} {'RSS growth MiB (max)':>21s}")  # fmt: skip
    for name, e in report["layouts"].items():
        print(
            f"{name:18s} {e['median_step_s']:8.3f} {e['step_time_over_ddp']:6.2f} "
            f"{max(e['model_state_bytes_per_rank']) / 2**20:21.1f} {e['max_state_over_ddp']:6.2f} "
            f"{max(e['peak_rss_growth_bytes_per_rank']) / 2**20:21.1f}"
        )
    print("accelerate's ParallelismConfig on CPU ranks:", report["accelerate_parallelism_config"])
    print(f"written {out}")


if __name__ == "__main__":
    main()
