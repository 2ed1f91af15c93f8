"""Low-bit inference on the CPU: weights memory, peak RSS, load time and decode tokens/s of a
Llama-shaped model (random weights saved locally) in fp32, bf16, int8 and nf4, loaded by
nbaccel (bitsandbytes and torchao backends) and by its peers in one run: transformers with
``BitsAndBytesConfig`` (bitsandbytes used directly by transformers) and torchao's ``quantize_``
on the fp32 model (torchao used directly).

Each variant is loaded once in its own child process (load time, peak RSS, weight bytes); then
one process holds every variant and times their greedy decoding round-robin (medians over the
rounds), so every variant sees the same machine load. Ratios: each nbaccel variant's decode time
over the same backend's used directly (the issue's bound: within 1.1x), and every variant's
weights and speed against fp32. Writes ``benchmarks/results/lowbit.json``.

    python benchmarks/bench_lowbit.py [--hidden 1024 --layers 8 --rounds 3 --new-tokens 16]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = (
    "fp32",
    "bf16",
    "nbaccel+bnb int8",
    "transformers+bnb int8",
    "nbaccel+bnb nf4",
    "transformers+bnb nf4",
    "nbaccel+torchao int8",
    "torchao int8 (direct)",
)
PEERS = {
    "nbaccel+bnb int8": "transformers+bnb int8",
    "nbaccel+bnb nf4": "transformers+bnb nf4",
    "nbaccel+torchao int8": "torchao int8 (direct)",
}


def save_model(folder: Path, hidden: int, layers: int) -> None:
    import transformers

    if (folder / "config.json").exists():
        return
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 128 * 128,
        num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64, vocab_size=32000, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def _not_the_head(module: torch.nn.Module, fqn: str) -> bool:
    return isinstance(module, torch.nn.Linear) and fqn != "lm_head"  # as nbaccel's default


def load(variant: str, folder: Path) -> torch.nn.Module:
    """One variant of the saved model, ready for inference on the CPU."""
    import transformers

    from nbaccel.bigmodel import init_empty_weights
    from nbaccel.bigmodel.quantization import (
        BnbQuantizationConfig,
        TorchAoConfig,
        load_and_quantize_model,
    )

    llama = transformers.LlamaForCausalLM
    f32 = torch.float32
    nf4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": f32}
    if variant in ("fp32", "bf16"):
        dtype = f32 if variant == "fp32" else torch.bfloat16
        return llama.from_pretrained(folder, dtype=dtype).eval()
    if variant.startswith("transformers+bnb"):
        options = {"load_in_8bit": True} if variant.endswith("int8") else nf4
        quantization = transformers.BitsAndBytesConfig(**options)
        return llama.from_pretrained(
            folder, quantization_config=quantization, device_map="cpu", dtype=f32
        ).eval()
    if variant == "torchao int8 (direct)":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        model = llama.from_pretrained(folder, dtype=f32).eval()
        quantize_(model, Int8WeightOnlyConfig(), filter_fn=_not_the_head)
        return model
    config = {
        "nbaccel+bnb int8": lambda: BnbQuantizationConfig(load_in_8bit=True, torch_dtype=f32),
        "nbaccel+bnb nf4": lambda: BnbQuantizationConfig(**nf4, torch_dtype=f32),
        "nbaccel+torchao int8": lambda: TorchAoConfig("int8_weight_only", torch_dtype=f32),
    }[variant]()
    with init_empty_weights():
        empty = llama(transformers.LlamaConfig.from_pretrained(folder))
    return load_and_quantize_model(empty, config, str(folder), device_map="cpu").eval()


def weight_bytes(model: torch.nn.Module) -> int:
    total = 0
    for tensor in model.state_dict().values():
        inner = getattr(tensor, "qdata", None)  # torchao tensors: their stored parts
        if inner is not None:
            total += sum(
                getattr(tensor, n).numel() * getattr(tensor, n).element_size()
                for n in tensor.__tensor_flatten__()[0]
            )
        else:
            total += tensor.numel() * tensor.element_size()
    return total


def _memory_kb(field: str) -> int:
    """``VmHWM`` (peak) or ``VmRSS`` of this process, in kB (the peak is this process's own:
    ``ru_maxrss`` would carry the parent's peak across fork and exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def measure_load(variant: str, folder: Path) -> dict:
    """In a fresh process: load time, peak RSS over the load and one forward (imports
    included), weight bytes."""
    import bitsandbytes  # noqa: F401  (every variant pays the same imports before the clock)
    import torchao  # noqa: F401
    import transformers  # noqa: F401

    before = _memory_kb("VmRSS")
    start = time.perf_counter()
    model = load(variant, folder)
    load_s = time.perf_counter() - start
    with torch.no_grad():  # one forward touches every weight (mapped files count once read)
        model(torch.zeros((1, 16), dtype=torch.long))
    peak = _memory_kb("VmHWM")
    return {"load_s": round(load_s, 2), "peak_rss_mb": round(peak / 1024),
            "rss_before_mb": round(before / 1024), "weight_bytes": weight_bytes(model)}  # fmt: skip


def decode_seconds(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False)  # fmt: skip
    return time.perf_counter() - start


def prefill_seconds(model: torch.nn.Module, batch: torch.Tensor) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model(batch)
    return time.perf_counter() - start


def measure_decoding(folder: Path, rounds: int, new_tokens: int) -> dict:
    """variant -> (median, best) seconds of a greedy decode and of a prefill forward (4 x 128
    tokens: the compute-bound case), variants timed round-robin."""
    models = {v: load(v, folder) for v in VARIANTS}
    prompt = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(5))
    for model in models.values():
        decode_seconds(model, prompt, 2)  # warm up (bitsandbytes repacks 4-bit weights once)
    batch = torch.randint(0, 32000, (4, 128), generator=torch.Generator().manual_seed(6))
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    prefill: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant, model in models.items():
            times[variant].append(decode_seconds(model, prompt, new_tokens))
            prefill[variant].append(prefill_seconds(model, batch))
    return {
        v: (statistics.median(t), min(t), statistics.median(prefill[v]), min(prefill[v]))
        for v, t in times.items()
    }


def main() -> None:
    logging.disable(logging.WARNING)
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--folder", default="/tmp/nbaccel-bench-lowbit")
    parser.add_argument("--load-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = Path(args.folder) / f"llama-{args.hidden}x{args.layers}"
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    if args.load_one:
        print(json.dumps(measure_load(args.load_one, folder)))
        return
    save_model(folder, args.hidden, args.layers)
    loads = {}
    for variant in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, "--hidden", str(args.hidden), "--layers",
             str(args.layers), "--folder", args.folder, "--load-one", variant],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        loads[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        print(variant, loads[variant], flush=True)
    gc.collect()
    seconds = measure_decoding(folder, args.rounds, args.new_tokens)
    fp32 = loads["fp32"]["weight_bytes"]
    rows = {}
    for variant in VARIANTS:
        rows[variant] = {
            **loads[variant],
            "weights_vs_fp32": round(loads[variant]["weight_bytes"] / fp32, 3),
            "decode_tokens_per_s": round(args.new_tokens / seconds[variant][0], 2),
            "decode_tokens_per_s_best": round(args.new_tokens / seconds[variant][1], 2),
            "decode_time_vs_fp32": round(seconds[variant][0] / seconds["fp32"][0], 2),
            "prefill_tokens_per_s": round(512 / seconds[variant][2], 1),
            "prefill_time_vs_fp32": round(seconds[variant][2] / seconds["fp32"][2], 2),
        }
        if variant in PEERS:  # median and best round: the machine is shared, rounds vary
            peer = seconds[PEERS[variant]]
            rows[variant]["decode_time_vs_backend_direct"] = round(seconds[variant][0] / peer[0], 3)
            rows[variant]["decode_time_vs_backend_direct_best"] = round(
                seconds[variant][1] / peer[1], 3
            )
            rows[variant]["prefill_time_vs_backend_direct"] = round(
                seconds[variant][2] / peer[2], 3
            )
    import bitsandbytes
    import torchao
    import transformers
    from provenance import stamp

    result = {
        "benchmark": f"Llama-shaped model on the CPU, greedy decode of {args.new_tokens} tokens "
        "after a 16-token prompt, batch 1, and a prefill forward of 4 x 128 tokens; loads each "
        "in a fresh process",
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "vocab": 32000,
            "params": fp32 // 4,
        },  # fmt: skip
        "provenance": stamp(),  # the date, commit and machine of this run
        "versions": {
            "bitsandbytes": bitsandbytes.__version__,
            "torchao": torchao.__version__,
            "transformers": transformers.__version__,
        },  # fmt: skip
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "variants": rows,
    }
    path = ROOT / "benchmarks" / "results" / "lowbit.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"{'variant':24} {'weights':>9} {'vs fp32':>8} {'peak RSS':>9} {'load s':>7} "
          f"{'tok/s':>7} {'prefill':>8} {'vs direct (median/best)':>24}")  # fmt: skip
    for variant, row in rows.items():
        direct = (
            f"{row['decode_time_vs_backend_direct']} / {row['decode_time_vs_backend_direct_best']}"
            if variant in PEERS
            else ""
        )
        print(f"{variant:24} {row['weight_bytes'] / 2**20:8.0f}M {row['weights_vs_fp32']:8.3f} "
              f"{row['peak_rss_mb']:8d}M {row['load_s']:7.2f} {row['decode_tokens_per_s']:7.2f} "
              f"{row['prefill_tokens_per_s']:8.1f} {direct:>24}")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
