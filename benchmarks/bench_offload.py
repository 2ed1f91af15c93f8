"""Disk-offloaded inference of a 0.6B-parameter fp32 model: nbaccel vs accelerate vs in memory.

    .venv/bin/python benchmarks/bench_offload.py            # 48 blocks, d=1024, 2.3 GB checkpoint
    .venv/bin/python benchmarks/bench_offload.py --small    # 8 blocks, d=512: a quick check

The checkpoint (safetensors, ~500 MB shards, with an index) is written once to --dir. Every
variant runs in a fresh subprocess (clean peak RSS): preparation time (empty init + load +
dispatch), peak RSS while preparing, and forward time for 64 tokens (batch 1). Blocks go to
"disk", the embedding, final norm and head stay in memory. Writes benchmarks/results/offload.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).parent
VOCAB = 1024


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.heads = max(1, d // 64)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Net(nn.Module):
    def __init__(self, blocks: int, d: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def shape(small: bool) -> tuple[int, int]:
    return (8, 512) if small else (48, 1024)


def write_checkpoint(folder: Path, blocks: int, d: int, shard_bytes: int) -> None:
    """Random fp32 weights, saved block by block into ~shard_bytes safetensors shards."""
    from safetensors.torch import save_file

    if (folder / "model.safetensors.index.json").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        skeleton = Net(blocks, d)
    weight_map, shard, shard_size, n = {}, {}, 0, 0

    def flush():
        nonlocal shard, shard_size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(folder / name))
            weight_map.update(dict.fromkeys(shard, name))
            shard, shard_size, n = {}, 0, n + 1

    for name, p in skeleton.named_parameters():
        if name.endswith("weight") and p.dim() == 2:
            t = torch.randn(p.shape) / math.sqrt(p.shape[1])
        elif "ln" in name and name.endswith("weight"):
            t = torch.ones(p.shape)
        else:
            t = torch.randn(p.shape) * 0.02
        if shard_size + t.nbytes > shard_bytes:
            flush()
        shard[name] = t
        shard_size += t.nbytes
    flush()
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def device_map(blocks: int) -> dict[str, str]:
    dm = {"embed": "cpu"}
    dm.update({f"blocks.{i}": "disk" for i in range(blocks)})
    dm.update({"ln_f": "cpu", "head": "cpu"})
    return dm


class PeakRSS:
    """Samples this process's RSS every 5 ms on a thread (peak of one phase, not the lifetime)."""

    def __init__(self):
        import psutil

        self.proc = psutil.Process()
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def evict_page_cache(folder: Path) -> None:
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prepare(variant: str, folder: Path, blocks: int, d: int) -> tuple[nn.Module, float]:
    """Empty init + load + dispatch for one variant; returns the model and the seconds taken."""
    dm = device_map(blocks)
    if variant.startswith("accelerate"):
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    else:
        from nbaccel import init_empty_weights, load_checkpoint_and_dispatch
    start = time.perf_counter()
    with init_empty_weights():
        model = Net(blocks, d)
    if variant.startswith("accelerate"):
        offload_dir = tempfile.mkdtemp(prefix="offload-")
        model = load_checkpoint_and_dispatch(
            model, str(folder), device_map=dm, offload_folder=offload_dir
        )
        model._bench_offload_dir = offload_dir
    else:
        target = {"memory": {"": "cpu"}, "nbaccel_all_disk": {"": "disk"}}.get(variant, dm)
        model = load_checkpoint_and_dispatch(model, str(folder), device_map=target)
        if variant == "nbaccel_no_prefetch":
            model._nbaccel_prefetcher.enabled = False
        if variant == "nbaccel_disk_keep_mapped":  # pages stay mapped between forwards
            model._nbaccel_weights_map.release_after_use = False
    return model.eval(), time.perf_counter() - start


def run_prepare(variant: str, folder: Path, blocks: int, d: int) -> dict:
    """Fresh process: preparation time, peak RSS while preparing and during one forward."""
    ids = torch.randint(0, VOCAB, (1, 64))
    rss_start = PeakRSS().proc.memory_info().rss
    with PeakRSS() as load_rss:
        model, seconds = prepare(variant, folder, blocks, d)
    with PeakRSS() as forward_rss, torch.inference_mode():
        model(ids)
    offload_dir = Path(getattr(model, "_bench_offload_dir", tempfile.mkdtemp()))
    return {
        "variant": variant,
        "prepare_s": round(seconds, 3),
        "rss_before_mb": round(rss_start / 2**20),
        "load_peak_rss_mb": round(load_rss.peak / 2**20),
        "forward_peak_rss_mb": round(forward_rss.peak / 2**20),
        "offload_dir_mb": round(
            sum(f.stat().st_size for f in offload_dir.rglob("*") if f.is_file()) / 2**20
        ),
        "load_average": [round(x, 1) for x in os.getloadavg()],
    }


def run_forwards(variants: list[str], folder: Path, blocks: int, d: int, rounds: int) -> dict:
    """One process holds every variant; forwards are interleaved round by round so machine
    load affects all alike; best and median per variant."""
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, 64))
    models = {v: prepare(v, folder, blocks, d)[0] for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    outs = {}
    with torch.inference_mode():
        for v in variants:  # warm-up (first forward of each)
            outs[v] = models[v](ids)
        for r in range(rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order:
                start = time.perf_counter()
                models[v](ids)
                times[v].append(time.perf_counter() - start)
        cold = {}
        for v in ("memory", "nbaccel_disk"):
            if v in models:
                evict_page_cache(folder)
                start = time.perf_counter()
                models[v](ids)
                cold[v] = round(time.perf_counter() - start, 3)
    ref = outs[variants[0]]
    return {
        v: {
            "forward_s": [round(t, 3) for t in times[v]],
            "forward_best_s": round(min(times[v]), 3),
            "forward_median_s": round(sorted(times[v])[len(times[v]) // 2], 3),
            "max_abs_diff_vs_first": float((outs[v] - ref).abs().max()),
            **({"forward_cold_cache_s": cold[v]} if v in cold else {}),
        }
        for v in variants
    } | {"load_average": [round(x, 1) for x in os.getloadavg()]}


def measure(
    small: bool, directory: str | Path, rounds: int, variants: list[str], threads: int = 1
) -> dict:
    """Write the checkpoint once, prepare each variant in a fresh process, then time forwards
    of all variants interleaved in one process. Returns the report (also for benchmarks/gate)."""
    blocks, d = shape(small)
    folder = Path(directory) / ("small" if small else "full")
    start = time.perf_counter()
    write_checkpoint(folder, blocks, d, shard_bytes=(100 if small else 500) * 2**20)
    files = sorted(folder.glob("*.safetensors"))
    sizes = [f.stat().st_size for f in files]
    print(
        f"checkpoint: {len(files)} shards, {sum(sizes) / 1e9:.2f} GB "
        f"(largest {max(sizes) / 1e6:.0f} MB), ready in {time.perf_counter() - start:.1f} s"
    )
    base = [sys.executable, __file__, "--dir", str(directory), "--rounds", str(rounds)]
    base += ["--threads", str(threads)]
    base += ["--small"] if small else []

    def child(*extra: str) -> dict:
        proc = subprocess.run(base + list(extra), capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{extra} failed:\n{proc.stderr[-3000:]}")
            return {"error": proc.stderr[-500:]}
        return json.loads(proc.stdout.strip().splitlines()[-1])

    prepared = {}
    for variant in variants:
        prepared[variant] = child("--prepare", variant)
        print(json.dumps(prepared[variant]), flush=True)
    forwards = child("--forwards", ",".join(variants))
    print(json.dumps(forwards), flush=True)
    summary = {}
    if "memory" in forwards:
        base_t = forwards["memory"]["forward_best_s"]
        for v in variants:
            if v in forwards:
                summary[f"{v}_forward_vs_memory"] = round(forwards[v]["forward_best_s"] / base_t, 2)
    if "nbaccel_disk" in forwards and "accelerate_disk" in forwards:
        nb, acc = forwards["nbaccel_disk"], forwards["accelerate_disk"]
        summary["forward_speedup_vs_accelerate"] = round(
            acc["forward_best_s"] / nb["forward_best_s"], 1
        )
    if "prepare_s" in prepared.get("accelerate_disk", {}) and "prepare_s" in prepared.get(
        "nbaccel_disk", {}
    ):
        summary["prepare_speedup_vs_accelerate"] = round(
            prepared["accelerate_disk"]["prepare_s"] / prepared["nbaccel_disk"]["prepare_s"], 1
        )
    for key, value in summary.items():
        print(f"{key}: {value}")
    out = {
        "benchmark": "disk-offloaded forward, 64 tokens, batch 1, fp32; blocks on disk",
        "model": {
            "blocks": blocks,
            "d": d,
            "params": sum(sizes) // 4,
            "checkpoint_bytes": sum(sizes),
            "shards": len(files),
            "largest_shard_bytes": max(sizes),
        },
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}",
        "torch_threads": threads,
        "prepare": prepared,
        "forwards": forwards,
        "summary": summary,
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "nbaccel-bench"))
    parser.add_argument("--prepare")
    parser.add_argument("--forwards")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--variants",
        default="memory,nbaccel_disk,nbaccel_no_prefetch,nbaccel_disk_keep_mapped,"
        "nbaccel_all_disk,accelerate_disk",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: robust timings)")
    args = parser.parse_args()
    blocks, d = shape(args.small)
    folder = Path(args.dir) / ("small" if args.small else "full")
    torch.set_num_threads(args.threads)
    if args.prepare:
        print(json.dumps(run_prepare(args.prepare, folder, blocks, d)))
        return
    if args.forwards:
        variants = args.forwards.split(",")
        print(json.dumps(run_forwards(variants, folder, blocks, d, args.rounds)))
        return
    out = measure(args.small, args.dir, args.rounds, args.variants.split(","), args.threads)
    name = "offload_small.json" if args.small else "offload.json"
    path = HERE / "results" / name
    from provenance import stamp  # the date, commit and machine of this run

    out["provenance"] = stamp()
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
