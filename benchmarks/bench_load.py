"""Loading a big model: time of the load call, of load + first forward, and peak RSS, for
nbaccel beside transformers' ``from_pretrained`` and Accelerate's recipe (``init_empty_weights``
+ ``load_checkpoint_and_dispatch``), each load in a fresh process, medians of ``--repeats``.

The checkpoint is a Llama built from its config with seeded random weights on first use and
cached (``--cache-dir``, default ``~/.cache/nbaccel-bench``), saved by ``save_pretrained`` in 4
safetensors shards. It is read once before the runs, so every run finds it in the page cache.

Modes: ``fp32`` and ``bf16`` (the fp32 files cast while loading), ``nf4`` and ``int8``
(bitsandbytes on the CPU, fp32 compute: transformers' ``BitsAndBytesConfig`` path beside
``nbaccel.load_and_quantize_model``), ``int8-torchao`` (torchao int8 weight-only:
transformers' ``TorchAoConfig`` beside nbaccel's) and ``disk`` (half the decoder layers mapped
to disk).
Every run's logits (and, quantized, a digest of every quantized weight) are compared with
transformers' in the same run. ``--gpu`` loads onto ``cuda:0`` (fp32, bf16, and nf4 / int8
quantized there, every tensor streamed through pinned staging) and adds the peak host RSS of the
streamed load; without CUDA it is a dry run of the staging path on the CPU, which also quantizes
nf4 from the staged copies and checks the bits against quantizing the mapped tensors.

    python benchmarks/bench_load.py --size 0.25b --modes fp32,nf4      # a quick look
    python benchmarks/bench_load.py                                     # 1B, every mode
    python benchmarks/bench_load.py --gpu --size 0.5b --modes fp32      # the GPU lane
    python benchmarks/bench_load.py --gpu --size tiny                   # no CUDA: a dry run

Writes ``benchmarks/results/load.json`` (``load_gpu.json`` with ``--gpu``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# hidden, layers, shard size: 1b is 0.95B parameters (3.8 GB fp32), the checkpoint
SIZES = {
    "1b": (2048, 16, "1GB"),
    "0.5b": (1536, 14, "600MB"),
    "0.25b": (1024, 14, "300MB"),
    "tiny": (256, 2, "4MB"),
}
LIBS = ("transformers", "accelerate", "nbaccel")
MODES = ("fp32", "bf16", "nf4", "int8", "int8-torchao", "disk")
QUANTIZED = ("nf4", "int8", "int8-torchao")
GPU_MODES = ("fp32", "bf16", "nf4", "int8")  # bitsandbytes quantizes on the GPU
PROMPT = [[1, 306, 4658, 278, 6593, 310, 2834, 338, 263, 1243, 29889, 13, 450, 1234, 338, 29871]]


def checkpoint(cache: Path, size: str) -> Path:
    """The cached checkpoint of ``size``, written once (seeded random weights)."""
    hidden, layers, shard = SIZES[size]
    folder = cache / f"llama-{size}"
    if (folder / "model.safetensors.index.json").exists() or (
        folder / "model.safetensors"
    ).exists():
        return folder
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 128 * 128,
        num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64, vocab_size=32000, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    tmp = folder.with_name(folder.name + ".partial")
    model.save_pretrained(tmp, max_shard_size=shard)
    tmp.rename(folder)
    return folder


def warm_page_cache(folder: Path) -> None:
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def _memory_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _disk_map(layers: int) -> dict[str, str]:
    dmap = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu"}
    dmap["lm_head"] = "cpu"
    for i in range(layers):
        dmap[f"model.layers.{i}"] = "cpu" if i < layers // 2 else "disk"
    return dmap


def _load(lib: str, mode: str, folder: Path, device: str, offload: str):
    import torch
    import transformers

    f32 = torch.float32
    dtype = torch.bfloat16 if mode == "bf16" else f32
    config = transformers.AutoConfig.from_pretrained(folder)
    device_map = _disk_map(config.num_hidden_layers) if mode == "disk" else device
    if lib == "transformers":
        kwargs: dict = {"dtype": dtype, "device_map": device_map}
        if mode == "int8-torchao":
            from torchao.quantization import Int8WeightOnlyConfig

            kwargs["quantization_config"] = transformers.TorchAoConfig(Int8WeightOnlyConfig())
        elif mode in QUANTIZED:
            options = (
                {"load_in_8bit": True}
                if mode == "int8"
                else {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
            )
            kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
                **options, bnb_4bit_compute_dtype=f32
            )
        if mode == "disk":
            kwargs["offload_folder"] = offload
        return transformers.LlamaForCausalLM.from_pretrained(folder, **kwargs)
    if lib == "accelerate":
        import accelerate as front
    else:
        import nbaccel as front
    if mode == "int8-torchao":
        from nbaccel.bigmodel.quantization import TorchAoConfig, load_and_quantize_model

        with front.init_empty_weights():
            empty = transformers.LlamaForCausalLM(config)
        return load_and_quantize_model(
            empty, TorchAoConfig("int8_weight_only"), str(folder), device_map=device
        )
    if mode in QUANTIZED:
        if lib == "accelerate":
            from accelerate.utils import BnbQuantizationConfig, load_and_quantize_model
        else:
            from nbaccel.bigmodel.quantization import (
                BnbQuantizationConfig,
                load_and_quantize_model,
            )
        options = (
            {"load_in_8bit": True}
            if mode == "int8"
            else {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": f32}
        )
        with front.init_empty_weights():
            empty = transformers.LlamaForCausalLM(config)
        quantization = BnbQuantizationConfig(**options, torch_dtype=f32)
        return load_and_quantize_model(empty, quantization, str(folder), device_map=device)
    with front.init_empty_weights():
        empty = transformers.LlamaForCausalLM(config)
    return front.load_checkpoint_and_dispatch(
        empty,
        str(folder),
        device_map=device_map if isinstance(device_map, dict) else {"": device_map},
        dtype=dtype,
        offload_folder=offload,
        no_split_module_classes=["LlamaDecoderLayer"],
    )


def _quantized_digest(model) -> dict[str, str]:
    """A digest of every quantized weight (its bytes and its scales)."""
    out = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        kind = type(module).__name__
        if hasattr(weight, "__tensor_flatten__") and type(weight.data).__name__ != "Tensor":
            h = hashlib.sha256()  # torchao: its quantized data and scales
            for inner in weight.__tensor_flatten__()[0]:
                part = getattr(weight, inner).contiguous().view(-1).view(dtype=_u8())
                h.update(part.numpy().tobytes())
            out[name] = h.hexdigest()[:16]
            continue
        if kind not in ("Linear4bit", "Linear8bitLt") or weight is None:
            continue
        h = hashlib.sha256(weight.data.contiguous().view(-1).view(dtype=_u8()).numpy().tobytes())
        state = getattr(weight, "quant_state", None)
        scale = state.absmax if state is not None else getattr(weight, "SCB", None)
        if scale is not None:
            h.update(scale.contiguous().view(-1).view(dtype=_u8()).numpy().tobytes())
        out[name] = h.hexdigest()[:16]
    return out


def _u8():
    import torch

    return torch.uint8


def child(lib: str, mode: str, folder: Path, device: str, out: Path) -> None:
    """One load in this fresh process: the figures as JSON, the logits into ``out``."""
    import logging

    import torch
    import transformers  # imports before the clock, for every library
    from transformers import LlamaForCausalLM  # noqa: F401  (a lazy import: seconds)

    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()
    if lib == "accelerate":
        import accelerate  # noqa: F401
    elif lib == "nbaccel":
        import nbaccel  # noqa: F401
    if mode == "int8-torchao":
        import torchao.quantization  # noqa: F401
    elif mode in QUANTIZED:
        import bitsandbytes.nn  # noqa: F401
    rss_before = _memory_kb("VmRSS")
    offload = tempfile.mkdtemp(prefix="bench-load-")
    start = time.perf_counter()
    model = _load(lib, mode, folder, device, offload).eval()  # as from_pretrained leaves it
    load_s = time.perf_counter() - start
    with torch.no_grad():
        logits = model(torch.tensor(PROMPT, device=device if mode != "disk" else "cpu")).logits
        logits = logits.float().cpu()
    total_s = time.perf_counter() - start
    figures = {
        "load_s": load_s,
        "load_forward_s": total_s,
        "peak_rss_mb": _memory_kb("VmHWM") / 1024,
        "rss_before_mb": rss_before / 1024,
    }
    torch.save(logits, out)
    if mode in QUANTIZED:
        figures["digest"] = _quantized_digest(model)
        if os.environ.get("BENCH_LOAD_DUMP"):
            torch.save(model.state_dict(), os.environ["BENCH_LOAD_DUMP"])
    print("RESULT " + json.dumps(figures), flush=True)
    shutil.rmtree(offload, ignore_errors=True)


def run_child(lib: str, mode: str, folder: Path, device: str, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, __file__, "--child", lib, mode, str(folder), device, str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(lines[-1][len("RESULT ") :])


def measure(size: str, modes: list[str], repeats: int, cache: Path, device: str = "cpu") -> dict:
    """Every library and mode, ``repeats`` fresh processes each (interleaved), medians."""
    import torch

    folder = checkpoint(cache, size)
    warm_page_cache(folder)
    rows: dict = {}
    tmp = Path(tempfile.mkdtemp(prefix="bench-load-logits-"))
    for mode in modes:
        libs = [lib for lib in LIBS if not (mode in QUANTIZED and lib == "accelerate")]
        runs: dict[str, list[dict]] = {lib: [] for lib in libs}
        for r in range(repeats):
            for lib in libs:
                runs[lib].append(run_child(lib, mode, folder, device, tmp / f"{lib}-{mode}-{r}.pt"))
        reference = tmp / f"transformers-{mode}-0.pt"
        row = {}
        for lib in libs:
            good = [x for x in runs[lib] if "error" not in x]
            if not good:
                row[lib] = {"error": runs[lib][0]["error"]}
                continue
            med = {
                k: round(statistics.median(x[k] for x in good), 3)
                for k in ("load_s", "load_forward_s", "peak_rss_mb")
            }
            med["runs"] = len(good)
            med["load_forward_each_s"] = [round(x["load_forward_s"], 3) for x in good]
            if reference.exists() and (tmp / f"{lib}-{mode}-0.pt").exists():
                ours = torch.load(tmp / f"{lib}-{mode}-0.pt")
                med["logits_equal"] = bool(torch.equal(ours, torch.load(reference)))
                med["logits_max_diff"] = float((ours - torch.load(reference)).abs().max())
            peer_digest = runs["transformers"][0].get("digest")
            if mode in QUANTIZED and "digest" in good[0] and peer_digest is not None:
                med["weights_bitwise_equal"] = good[0]["digest"] == peer_digest
            row[lib] = med
        peer = row.get("transformers", {})
        ours = row.get("nbaccel", {})
        if "load_s" in peer and "load_s" in ours:
            row["ratios_vs_transformers"] = {
                k: round(ours[k] / peer[k], 3) for k in ("load_s", "load_forward_s", "peak_rss_mb")
            }
        rows[mode] = row
        print(f"[bench_load] {mode}: {json.dumps(row)}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return {"size": size, "device": device, "repeats": repeats, "modes": rows}


def dry_run(cache: Path, size: str) -> dict:
    """Without CUDA: the GPU path's staging steps onto the CPU (every tensor of the checkpoint
    through :class:`HostToDevice`'s buffers), checked against the file; a smoke run, no figures
    to quote."""
    import torch

    from nbaccel.bigmodel.loading.host_to_device import HostToDevice
    from nbaccel.storage.safetensors_file import SafetensorsFile

    folder = checkpoint(cache, size)
    warm_page_cache(folder)
    stream, moved, start = HostToDevice("cpu"), 0, time.perf_counter()
    for path in sorted(folder.glob("*.safetensors")):
        handle = SafetensorsFile(path)
        for name in handle.entries:
            src = handle.view(name)
            if not torch.equal(stream.copy(src), src):
                raise RuntimeError(f"{path}: {name} differs after staging")
            moved += src.numel() * src.element_size()
    stream.finish()
    seconds = time.perf_counter() - start
    return {
        "dry_run": True,
        "bytes": moved,
        "seconds": round(seconds, 3),
        "nf4_from_staging_bitwise_equal": _nf4_dry_run(folder),
    }


def _nf4_dry_run(folder: Path) -> bool:
    """The quantized GPU path's steps on the CPU: each linear weight staged through the load's
    stream, then quantized to nf4 from the staged copy; True when every weight has the bits of
    quantizing the mapped tensor directly."""
    import torch
    import transformers

    from nbaccel import init_empty_weights
    from nbaccel.bigmodel.loading.tensor_copies import TensorCopies
    from nbaccel.bigmodel.quantization import BnbQuantizationConfig
    from nbaccel.bigmodel.quantization.bnb_layers import (
        is_quantized_layer,
        quantize_weight,
        replace_with_bnb_layers,
    )
    from nbaccel.storage.safetensors_file import SafetensorsFile

    config = BnbQuantizationConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(folder))
    replace_with_bnb_layers(model, config, ["lm_head"])
    where = {}
    for path in sorted(folder.glob("*.safetensors")):
        handle = SafetensorsFile(path)
        where.update(dict.fromkeys(handle.entries, handle))
    copies, cpu = TensorCopies(), torch.device("cpu")
    stream = copies.stream(cpu)
    for name, module in model.named_modules():
        if not is_quantized_layer(module):
            continue
        view = where[f"{name}.weight"].view(f"{name}.weight")
        staged = stream.copy(view, torch.float32)
        stream.ready()
        ours, direct = quantize_weight(module, staged, cpu), quantize_weight(module, view, cpu)
        if not (
            torch.equal(ours.data, direct.data)
            and torch.equal(ours.quant_state.absmax, direct.quant_state.absmax)
        ):
            return False
    copies.finish()
    return True


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        lib, mode, folder, device, out = sys.argv[2:7]
        child(lib, mode, Path(folder), device, Path(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(SIZES), default="1b")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "nbaccel-bench"))
    parser.add_argument(
        "--gpu", action="store_true", help=f"load onto cuda:0 ({', '.join(GPU_MODES)})"
    )
    parser.add_argument("--out", help="the results file (default benchmarks/results/load.json)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}")
    device = "cuda:0" if args.gpu else "cpu"
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: a dry run of the staging path on the CPU (nothing written)")
            print(json.dumps(dry_run(Path(args.cache_dir), args.size)))
            return
        modes = [m for m in modes if m in GPU_MODES] or ["fp32"]
    result = measure(args.size, modes, args.repeats, Path(args.cache_dir), device)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from provenance import stamp

    result["provenance"] = stamp()
    name = "load_gpu.json" if args.gpu else "load.json"
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / name
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
