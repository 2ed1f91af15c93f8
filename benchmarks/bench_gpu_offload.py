"""Greedy generation with most of a Llama-shaped fp16 model off the GPU: nbaccel vs accelerate.

    python benchmarks/bench_gpu_offload.py              # on a CUDA machine (scripts/test-gpu)
    python benchmarks/bench_gpu_offload.py --dry-run    # the same code on CPU, a tiny model

A Llama-70B-shaped model (hidden 8192, MLP 28672, 64 heads, 8 KV heads, vocab 32000, fp16,
random weights) sized to about twice the GPU's memory, capped by what this host can hold (60% of
the available RAM for the pinned CPU blocks, 60% of the free disk for the disk blocks; the JSON
says when a cap applied). Device map: embeddings, final norm, head and the first blocks on
cuda:0 (45% of its memory), most of the rest on the CPU (pinned) and the last ones on disk (raw
``.dat`` files, the format both libraries read). Both libraries run the same map over the same
pinned CPU tensors and the same files (page cache dropped before each run); the model is
dispatched with each library's ``dispatch_model``.

Measured in one run: tokens/s of greedy generation (batch 1, 16-token prompt, no KV cache: one
forward per new token, the first one untimed), the pinned host-to-device bandwidth of this
machine, and the bandwidth nbaccel's streaming reaches (offloaded bytes per token x tokens/s).
Writes ``benchmarks/results/gpu-<device>-<date>.json``. ``--dry-run`` runs on the CPU (blocks on
"cpu" stay resident there, the disk blocks stream) and prints the same keys; without accelerate
installed the peer is marked absent.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).parent
FULL = {
    "hidden": 8192,
    "mlp": 28672,
    "heads": 64,
    "kv_heads": 8,
    "vocab": 32000,
    "dtype": "float16",
}
# float32 on the CPU: its float16 matmuls are a slow fallback that would only time themselves
TINY = {"hidden": 64, "mlp": 160, "heads": 4, "kv_heads": 2, "vocab": 256, "layers": 6,
        "dtype": "float32"}  # fmt: skip
PROMPT = 16


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.heads, self.kv_heads = c["heads"], c["kv_heads"]
        self.head_dim = c["hidden"] // c["heads"]
        kv = self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(c["hidden"], c["hidden"], bias=False)
        self.k_proj = nn.Linear(c["hidden"], kv, bias=False)
        self.v_proj = nn.Linear(c["hidden"], kv, bias=False)
        self.o_proj = nn.Linear(c["hidden"], c["hidden"], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.gate_proj = nn.Linear(c["hidden"], c["mlp"], bias=False)
        self.up_proj = nn.Linear(c["hidden"], c["mlp"], bias=False)
        self.down_proj = nn.Linear(c["mlp"], c["hidden"], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden"])
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab"], c["hidden"])
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["hidden"])


class LlamaShaped(nn.Module):
    """Llama's module tree and tensor shapes (names as in transformers), no rotary/KV cache."""

    def __init__(self, c: dict):
        super().__init__()
        self.model = Body(c)
        self.lm_head = nn.Linear(c["hidden"], c["vocab"], bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def meta_model(c: dict) -> LlamaShaped:
    from nbaccel.bigmodel import init_empty_weights

    with init_empty_weights():
        return LlamaShaped(c).to(getattr(torch, c["dtype"]))


def tensor_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


# ----------------------------------------------------------------------------- the plan
def plan(c: dict, dry_run: bool, folder: Path, multiple: float = 2.0) -> dict:
    """How many blocks go where: ``{"layers", "gpu", "cpu", "disk", "capped_by", ...}``."""
    probe = meta_model({**c, "layers": 1})
    layer = tensor_bytes(probe.model.layers[0])
    fixed = tensor_bytes(probe) - layer
    if dry_run:
        n = c["layers"]
        return {"layers": n, "gpu": 2, "cpu": n - 4, "disk": 2, "layer_bytes": layer,
                "fixed_bytes": fixed, "gpu_total": 0, "capped_by": []}  # fmt: skip
    gpu_total = torch.cuda.get_device_properties(0).total_memory
    wanted = max(4, round((multiple * gpu_total - fixed) / layer))
    on_gpu = max(1, int((0.45 * gpu_total - fixed) // layer))
    disk = max(1, round(0.15 * (wanted - on_gpu)))
    cpu = wanted - on_gpu - disk
    capped = []
    cpu_cap = int(0.6 * psutil.virtual_memory().available // layer)
    if cpu > cpu_cap:
        cpu, capped = cpu_cap, [*capped, "host RAM"]
    disk_cap = int(0.6 * shutil.disk_usage(folder).free // layer)
    if disk > disk_cap:
        disk, capped = max(1, disk_cap), [*capped, "free disk"]
    return {"layers": on_gpu + cpu + disk, "gpu": on_gpu, "cpu": cpu, "disk": disk,
            "layer_bytes": layer, "fixed_bytes": fixed, "gpu_total": gpu_total,
            "capped_by": capped}  # fmt: skip


def device_map(p: dict, main: int | str) -> dict[str, int | str]:
    m: dict[str, int | str] = {"model.embed_tokens": main}
    for i in range(p["layers"]):
        m[f"model.layers.{i}"] = (
            main if i < p["gpu"] else "cpu" if i < p["gpu"] + p["cpu"] else "disk"
        )
    m["model.norm"] = main
    m["lm_head"] = main
    return m


def _random_(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if tensor.dim() == 1:
        return tensor.fill_(1.0)  # norms
    return tensor.normal_(0.0, tensor.shape[-1] ** -0.5, generator=generator)


def materialise(c: dict, p: dict, dmap: dict, main: torch.device, folder: Path) -> tuple:
    """Random weights, made once: main-device tensors, pinned CPU tensors, disk ``.dat`` files."""
    from nbaccel.bigmodel.loading.weight_files import offload_weight
    from nbaccel.bigmodel.offload import save_offload_index

    model = meta_model(c)
    maker = main if main.type == "cuda" else torch.device("cpu")
    generator = torch.Generator(maker).manual_seed(0)
    resident, cpu_state, index = {}, {}, {}
    pin = main.type == "cuda"
    for name, meta in model.state_dict().items():
        owner = next(k for k in dmap if name == k or name.startswith(k + "."))
        value = _random_(torch.empty(meta.shape, dtype=meta.dtype, device=maker), generator)
        where = dmap[owner]
        if where == "disk":
            offload_weight(value, name, folder, index)
        elif where == "cpu" and pin:
            host = torch.empty(meta.shape, dtype=meta.dtype, pin_memory=True)
            cpu_state[name] = host.copy_(value)
        else:
            resident[name] = value
    save_offload_index(index, folder)
    return resident, cpu_state


def drop_page_cache(folder: Path) -> None:
    """Evict the disk blocks from the page cache so each run reads them from disk first."""
    for path in folder.glob("*.dat"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------- the runs
def generate(model: nn.Module, prompt: torch.Tensor, new_tokens: int, sync) -> tuple:
    """Greedy tokens (one forward per token over the whole sequence); the first is untimed."""
    ids = prompt
    with torch.no_grad():
        for step in range(new_tokens + 1):
            if step == 1:
                sync()
                start = time.perf_counter()
            logits = model(ids)[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True).to(ids.device)], dim=1)
        sync()
    seconds = time.perf_counter() - start
    return ids[0, PROMPT:].tolist(), seconds


@dataclass
class Prepared:
    """What both libraries run on: the model's shape, its device map and its weights."""

    config: dict
    dmap: dict
    main: torch.device
    resident: dict  # tensors on the main device
    cpu_state: dict  # pinned CPU tensors (cuda) of the "cpu" blocks
    folder: Path  # the disk blocks (.dat files + index.json)
    prompt: torch.Tensor


def run_library(lib: str, prepared: Prepared, tokens: int) -> dict:
    """Dispatch a fresh meta model with ``lib`` and time greedy generation."""
    c, dmap, main, folder = prepared.config, prepared.dmap, prepared.main, prepared.folder
    cpu_state, prompt = prepared.cpu_state, prepared.prompt
    if lib == "nbaccel":
        from nbaccel.bigmodel import dispatch_model
    else:
        from accelerate import dispatch_model
    model = meta_model(c)
    model.load_state_dict(prepared.resident, strict=False, assign=True)
    drop_page_cache(folder)
    start = time.perf_counter()
    model = dispatch_model(
        model, dmap, main_device=dmap["lm_head"], state_dict=cpu_state, offload_dir=str(folder)
    )
    prepare = time.perf_counter() - start

    def sync() -> None:
        if main.type == "cuda":
            torch.cuda.synchronize(main)

    if main.type == "cuda":
        torch.cuda.reset_peak_memory_stats(main)
    got, seconds = generate(model, prompt.to(main), tokens, sync)
    peak = torch.cuda.max_memory_allocated(main) if main.type == "cuda" else None
    prefetcher = getattr(model, "_nbaccel_prefetcher", None)
    if prefetcher is not None:
        prefetcher.close()
    # dropped, not un-hooked: removing the hooks would load every offloaded block into RAM
    del model, prefetcher
    gc.collect()
    if main.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "prepare_s": prepare,
        "gpu_peak_bytes": peak,
        "tokens": got,
    }


def pinned_bandwidth(main: torch.device, size: int = 1 << 30, repeats: int = 8) -> float | None:
    """Host-to-device bytes per second from a pinned buffer (None on the CPU)."""
    if main.type != "cuda":
        return None
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(size, dtype=torch.uint8, device=main)
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize(main)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        device.copy_(host, non_blocking=True)
    end.record()
    torch.cuda.synchronize(main)
    return size * repeats / (start.elapsed_time(end) / 1000)


def _peer_version() -> str | None:
    try:
        import accelerate
    except ImportError:
        return None
    return accelerate.__version__


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, print the JSON")
    parser.add_argument("--new-tokens", type=int, default=4, help="timed tokens per library")
    parser.add_argument(
        "--gpu-multiple", type=float, default=2.0, help="model size over GPU memory (default 2)"
    )
    parser.add_argument("--dir", default=None, help="folder for the disk blocks (default: tmp)")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/)")
    args = parser.parse_args(argv)
    if args.new_tokens < 1:
        parser.error("--new-tokens must be at least 1")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU machine, or pass --dry-run")
    main_device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    config = dict(TINY) if args.dry_run else dict(FULL)
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-gpu-offload-", dir=args.dir))
    try:
        p = plan(config, args.dry_run, folder, args.gpu_multiple)
        config["layers"] = p["layers"]
        main_key: int | str = "cpu" if args.dry_run else 0
        dmap = device_map(p, main_key)
        resident, cpu_state = materialise(config, p, dmap, main_device, folder)
        prompt = torch.randint(
            0, config["vocab"], (1, PROMPT), generator=torch.Generator().manual_seed(1)
        )
        bandwidth = pinned_bandwidth(main_device)
        common = Prepared(config, dmap, main_device, resident, cpu_state, folder, prompt)
        ours = run_library("nbaccel", common, args.new_tokens)
        version = _peer_version()
        peer = (
            run_library("accelerate", common, args.new_tokens)
            if version
            else {"absent": "accelerate is not installed (pip install accelerate)"}
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    # what streams per token: the blocks not resident on the main device
    streamed = p["layer_bytes"] * (p["disk"] + (p["cpu"] if main_device.type == "cuda" else 0))
    stream_rate = streamed * ours["tokens_per_s"]
    model_bytes = p["fixed_bytes"] + p["layers"] * p["layer_bytes"]
    device_name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    result = {
        "device": device_name,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dry_run": args.dry_run,
        "model": {**config, "bytes": model_bytes},
        "gpu_total_bytes": p["gpu_total"],
        "model_over_gpu": model_bytes / p["gpu_total"] if p["gpu_total"] else None,
        "blocks": {"gpu": p["gpu"], "cpu_pinned": p["cpu"], "disk": p["disk"]},
        "capped_by": p["capped_by"],
        "new_tokens": args.new_tokens,
        "tokens_per_s": ours["tokens_per_s"],
        "nbaccel": ours,
        "accelerate": peer,
        "accelerate_version": version,
        "ratio_vs_accelerate": ours["tokens_per_s"] / peer["tokens_per_s"] if version else None,
        "same_tokens": ours["tokens"] == peer["tokens"] if version else None,
        "pinned_h2d_bytes_per_s": bandwidth,
        "streamed_bytes_per_token": streamed,
        "nbaccel_stream_bytes_per_s": stream_rate,
        "fraction_of_pinned_bandwidth": stream_rate / bandwidth if bandwidth else None,
    }  # fmt: skip
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by path, not from its folder
    from provenance import stamp  # the date, commit and machine of this run

    result["provenance"] = stamp()
    text = json.dumps(result, indent=1)
    print(text)
    out = args.out
    if out is None and not args.dry_run:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-")
        out = HERE / "results" / f"gpu-{slug}-{result['date']}.json"
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
        print(f"written to {out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
