"""infer_auto_device_map on MoE-shaped meta models: nbaccel vs accelerate, same models, same run.

    .venv/bin/python benchmarks/bench_device_map.py [--repeats 3]

Three fake GPUs (ids 0, 1, 2) with 0.3x the model size each, plus the CPU with the model size,
given in max_memory (no GPU needed: only sizes are read). Writes benchmarks/results/device_map.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn

SIZES = {  # label: (layers, experts); tensors = layers * (7 + 3 * experts) + 3
    "3k": (16, 64),  # 3,187 tensors
    "37k": (48, 256),  # 37,203 tensors: 12x the tensors of 3k
}
# An MoE model of blocks only: a norm, a router and the experts, nothing kept whole (the shape on
# which accelerate's planning grows faster than the number of tensors).
# tensors = layers * (2 + 3 * experts)
MOE_SIZES = {"moe_3k": (16, 64), "moe_37k": (48, 256)}  # 3,104 and 36,960 tensors


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class Expert(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)


class Attention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)


class SparseMoe(nn.Module):
    def __init__(self, d: int, f: int, experts: int):
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, f) for _ in range(experts))


class DecoderLayer(nn.Module):
    def __init__(self, d: int, f: int, experts: int):
        super().__init__()
        self.input_layernorm = RMSNorm(d)
        self.self_attn = Attention(d)
        self.post_attention_layernorm = RMSNorm(d)
        self.mlp = SparseMoe(d, f, experts)


class MoeModel(nn.Module):
    def __init__(self, layers: int, experts: int, d: int = 1024, f: int = 512, vocab: int = 32000):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(DecoderLayer(d, f, experts) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)


class MoeBlock(nn.Module):
    def __init__(self, d: int, f: int, experts: int):
        super().__init__()
        self.norm = RMSNorm(d)
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, f) for _ in range(experts))


class MoeStack(nn.Module):
    """An MoE model of blocks only (no attention, no embeddings)."""

    def __init__(self, layers: int, experts: int, d: int = 1024, f: int = 512):
        super().__init__()
        self.layers = nn.ModuleList(MoeBlock(d, f, experts) for _ in range(layers))


def build(layers: int, experts: int) -> nn.Module:
    with torch.device("meta"):
        return MoeModel(layers, experts)


def build_moe_blocks(layers: int, experts: int) -> nn.Module:
    with torch.device("meta"):
        return MoeStack(layers, experts)


def bare_walk(model: nn.Module) -> int:
    """Sum of tensor bytes, nothing kept: what touching every module once costs (memory-bound
    on 10^5 modules), for scale against a planner's time."""
    total, stack = 0, [model]
    while stack:
        module = stack.pop()
        for tensor in module._parameters.values():
            if tensor is not None:
                total += tensor.nbytes
        for tensor in module._buffers.values():
            if tensor is not None:
                total += tensor.nbytes
        stack.extend(module._modules.values())
    return total


def timed(fn, repeats: int) -> tuple[float, float, dict]:
    """Best wall time and best CPU time of this process (the CPU time is robust to other jobs
    sharing the machine), and the result."""
    best, best_cpu, result = float("inf"), float("inf"), None
    for _ in range(repeats):
        gc.collect()
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
        best = min(best, time.perf_counter() - start)
    return best, best_cpu, result


def measure(
    label: str,
    layers: int,
    experts: int,
    args: argparse.Namespace,
    whole: bool = True,
    tied: bool = False,
    builder=build,
) -> dict:
    """Plan one model with both libraries (same model object, same budgets). ``whole``: the
    decoder layers are ``no_split_module_classes``; without it the fill splits layers down to
    single experts and tensors where a device fills up (maps of ~800 entries, not ~50).
    ``tied``: the output head shares the embedding's weight, as many LLMs do. ``builder``:
    ``build`` (decoder layers with attention and embeddings) or ``build_moe_blocks``."""
    from accelerate.utils import infer_auto_device_map as acc_infer

    from nbaccel.bigmodel import compute_module_sizes
    from nbaccel.bigmodel import infer_auto_device_map as nb_infer

    model = builder(layers, experts)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    tensors = sum(1 for _ in model.parameters())
    total = compute_module_sizes(model)[""]
    max_memory = {0: int(0.3 * total), 1: int(0.3 * total), 2: int(0.3 * total), "cpu": total}
    kwargs = {"no_split_module_classes": ["DecoderLayer"] if whole else None}
    nb_t, nb_cpu, nb_map = timed(lambda: nb_infer(model, dict(max_memory), **kwargs), args.repeats)
    # The floor of any planner: one bare walk reading each module's tensors and children.
    _, floor_cpu, _ = timed(lambda: bare_walk(model), args.repeats)
    acc_t, acc_cpu, acc_map = timed(
        lambda: acc_infer(model, dict(max_memory), **kwargs), args.accelerate_repeats
    )

    def layers_on(dm: dict) -> dict:
        return dict(Counter(str(dm.get(f"layers.{i}", "?")) for i in range(layers)))

    row = {
        "model": label,
        "no_split_module_classes": kwargs["no_split_module_classes"],
        "tied_embeddings": tied,
        "tensors": tensors,
        "modules": sum(1 for _ in model.modules()),
        "model_gib": round(total / 2**30, 2),
        "nbaccel_s": round(nb_t, 4),
        "accelerate_s": round(acc_t, 4),
        "speedup": round(acc_t / nb_t, 1),
        "nbaccel_cpu_s": round(nb_cpu, 4),
        "accelerate_cpu_s": round(acc_cpu, 4),
        "speedup_cpu": round(acc_cpu / nb_cpu, 1),
        "bare_walk_cpu_s": round(floor_cpu, 4),
        "accelerate_over_bare_walk": round(acc_cpu / floor_cpu, 1),
        "nbaccel_layers_per_device": layers_on(nb_map),
        "accelerate_layers_per_device": layers_on(acc_map),
        "same_map": dict(nb_map) == dict(acc_map),
        "map_entries": len(nb_map),
    }
    print(
        f"{label:>4} {tensors:>6} tensors  wall: nbaccel {nb_t:6.3f} s, accelerate {acc_t:6.3f} s,"
        f" x{acc_t / nb_t:.1f} | cpu: {nb_cpu:6.3f} s vs {acc_cpu:6.3f} s, x{acc_cpu / nb_cpu:.1f}"
        f"\n      bare walk of the model: {floor_cpu:.3f} s CPU (accelerate = "
        f"{acc_cpu / floor_cpu:.1f}x that)"
        f"\n      layers per device: nbaccel {row['nbaccel_layers_per_device']}  "
        f"accelerate {row['accelerate_layers_per_device']}",
        flush=True,
    )
    return row


def measure_balanced(layers: int, experts: int, args: argparse.Namespace) -> dict:
    """``device_map="balanced"``: budgets spread over the GPUs, then the map (accelerate: its
    ``get_balanced_memory`` then ``infer_auto_device_map``; nbaccel: one scan serves both)."""
    from accelerate.utils import get_balanced_memory as acc_balanced
    from accelerate.utils import infer_auto_device_map as acc_infer

    from nbaccel.bigmodel import compute_module_sizes
    from nbaccel.bigmodel.planning.device_map import get_device_map

    model = build(layers, experts)
    total = compute_module_sizes(model)[""]
    max_memory = {0: int(0.5 * total), 1: int(0.5 * total), 2: int(0.5 * total), "cpu": total}
    whole = ["DecoderLayer"]

    def theirs() -> dict:
        budgets = acc_balanced(model, dict(max_memory), no_split_module_classes=whole)
        return acc_infer(model, budgets, no_split_module_classes=whole)

    _, nb_cpu, nb_map = timed(
        lambda: get_device_map(model, "balanced", dict(max_memory), whole), args.repeats
    )
    _, acc_cpu, acc_map = timed(theirs, args.accelerate_repeats)
    print(f"balanced: cpu {nb_cpu:.3f} s vs {acc_cpu:.3f} s, x{acc_cpu / nb_cpu:.1f}", flush=True)
    return {
        "nbaccel_cpu_s": round(nb_cpu, 4),
        "accelerate_cpu_s": round(acc_cpu, 4),
        "same_map": dict(nb_map) == dict(acc_map),
    }


def growth_of(small: dict, large: dict) -> dict:
    """How the tensors, and each library's time, grow from one size to the other."""
    growth = {"tensors": round(large["tensors"] / small["tensors"], 2)}
    for tool in ("nbaccel", "accelerate"):
        growth[f"{tool}_cpu"] = round(large[f"{tool}_cpu_s"] / small[f"{tool}_cpu_s"], 2)
        growth[f"{tool}_wall"] = round(large[f"{tool}_s"] / small[f"{tool}_s"], 2)
        print(
            f"{small['model']} -> {large['model']}, {tool}: {growth['tensors']:.1f}x the tensors"
            f" -> {growth[f'{tool}_cpu']:.1f}x the CPU time"
        )
    return growth


def run(repeats: int = 3, accelerate_repeats: int = 1) -> dict:
    """Both sizes of both models, both libraries; the report (also for benchmarks/gate)."""
    logging.getLogger("accelerate").setLevel(logging.ERROR)  # "Device 0 is not available"
    import accelerate

    args = argparse.Namespace(repeats=repeats, accelerate_repeats=accelerate_repeats)
    rows = [measure(label, layers, experts, args) for label, (layers, experts) in SIZES.items()]
    first, last = rows[0], rows[-1]
    layers, experts = SIZES["37k"]
    split = measure("37k", layers, experts, args, whole=False)
    tied = measure("37k", layers, experts, args, tied=True)
    balanced = measure_balanced(layers, experts, args)
    moe = [
        measure(label, layers, experts, args, whole=False, builder=build_moe_blocks)
        for label, (layers, experts) in MOE_SIZES.items()
    ]
    return {
        "benchmark": "infer_auto_device_map, MoE meta models, 3 fake GPUs at 0.3x + cpu",
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}",
        "accelerate": accelerate.__version__,
        "rows": rows,
        "growth": growth_of(first, last),
        "moe_rows": moe,
        "moe_growth": growth_of(*moe),
        "split": split,
        "tied": tied,
        "balanced": balanced,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accelerate-repeats", type=int, default=1)
    args = parser.parse_args()
    out = run(args.repeats, args.accelerate_repeats)
    path = Path(__file__).parent / "results" / "device_map.json"
    path.parent.mkdir(exist_ok=True)
    from provenance import stamp  # the date, commit and machine of this run

    out["provenance"] = stamp()
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
