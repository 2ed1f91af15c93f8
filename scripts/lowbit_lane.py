"""The low-bit lane: a Llama-shaped model of about 1B parameters (hidden 2048, 16 layers, 32k
vocabulary, random weights saved locally once) loaded with ``load_and_quantize_model`` on the
CPU in 8-bit and nf4 4-bit, each compared with transformers' own ``BitsAndBytesConfig`` path
(bitwise equal logits and greedy tokens) and with the fp32 model (logit cosine per position,
top-1 agreement over a fixed prompt set), its weight bytes against fp32's, ``generate()``, and
the 8-bit model split over cpu + disk against the in-memory one. One model in memory at a time.
Prints a summary and writes ``benchmarks/results/lowbit_1b.json``; exits non-zero on a failed
check (4-bit <= 0.3x and 8-bit <= 0.4x of the fp32 weight bytes, bitwise equality).

``NBACCEL_LOWBIT_SIZE=small`` (CI) runs the same checks on a small Llama of the same shape family
(hidden 512, 4 layers, 1k vocabulary: ~14M parameters, a minute) saved under its own folder, and
writes no result file: the committed figures stay the ~1B model's."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 1024,
        "tie_word_embeddings": False,
    },
}
SIZE = os.environ.get("NBACCEL_LOWBIT_SIZE", "1b")
if SIZE not in SIZES:
    sys.exit(f"NBACCEL_LOWBIT_SIZE={SIZE!r}: use one of {', '.join(SIZES)}")
CONFIG = SIZES[SIZE]
LAYERS = CONFIG["num_hidden_layers"]
PROMPTS = torch.randint(
    0, CONFIG["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(11)
)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPTS).logits.float()


def agreement(got: torch.Tensor, want: torch.Tensor) -> dict:
    cos = torch.nn.functional.cosine_similarity(got.flatten(0, 1), want.flatten(0, 1), dim=-1)
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    return {"cosine_mean": round(cos.mean().item(), 5), "cosine_min": round(cos.min().item(), 5),
            "top1_agreement": round(top1, 4)}  # fmt: skip


def saved_model(folder: Path) -> Path:
    import transformers

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.save_pretrained(folder)
    del model
    gc.collect()
    return folder


def check_mode(name, options, limit, empty, folder, want, fp32_bytes, failures) -> dict:
    """Load one mode with nbaccel and with transformers; the row of figures, failures appended."""
    import transformers

    from nbaccel.bigmodel.quantization import BnbQuantizationConfig, load_and_quantize_model

    start = time.perf_counter()
    ours = load_and_quantize_model(
        empty(), BnbQuantizationConfig(**options, torch_dtype=torch.float32), folder,
        device_map="cpu",
    ).eval()  # fmt: skip
    load_s = time.perf_counter() - start
    ratio = weight_bytes(ours) / fp32_bytes
    got = logits(ours)
    tokens = ours.generate(PROMPTS[:1, :8], max_new_tokens=8, do_sample=False)
    in_memory = got
    del ours
    gc.collect()
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        folder, quantization_config=transformers.BitsAndBytesConfig(**options),
        device_map="cpu", dtype=torch.float32,
    ).eval()  # fmt: skip
    same = torch.equal(got, logits(theirs))
    same_tokens = torch.equal(
        tokens, theirs.generate(PROMPTS[:1, :8], max_new_tokens=8, do_sample=False)
    )
    del theirs
    gc.collect()
    row = {"load_s": round(load_s, 1), "weight_bytes_ratio": round(ratio, 4),
           "bitwise_equal_to_transformers": same, "generate_equal": same_tokens,
           **agreement(got, want)}  # fmt: skip
    if name == "int8":
        with tempfile.TemporaryDirectory() as offload:
            split = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk",
                     "model.norm": "disk"}  # fmt: skip
            split.update(
                {f"model.layers.{i}": "cpu" if i < LAYERS // 2 else "disk" for i in range(LAYERS)}
            )
            offloaded = load_and_quantize_model(
                empty(), BnbQuantizationConfig(**options, torch_dtype=torch.float32), folder,
                device_map=split, offload_folder=offload,
            ).eval()  # fmt: skip
            row["cpu_disk_offload_equal"] = torch.equal(logits(offloaded), in_memory)
            del offloaded
            gc.collect()
        if not row["cpu_disk_offload_equal"]:
            failures.append("int8 cpu+disk offload logits differ from in-memory")
    if ratio > limit:
        failures.append(f"{name}: {ratio:.3f}x of fp32 weight bytes > {limit}x")
    if not (same and same_tokens):
        failures.append(f"{name}: not bitwise equal to transformers' path")
    return row


def main() -> int:
    import transformers

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from provenance import stamp

    from nbaccel.bigmodel import init_empty_weights

    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    default_dir = f"/tmp/nbaccel-lowbit-{SIZE}"
    folder = saved_model(Path(os.environ.get("NBACCEL_LOWBIT_DIR", default_dir)))
    config = transformers.LlamaConfig.from_pretrained(folder)

    def empty():
        with init_empty_weights():
            return transformers.LlamaForCausalLM(config)

    fp32 = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    fp32_bytes, params = weight_bytes(fp32), sum(p.numel() for p in fp32.parameters())
    want = logits(fp32)
    del fp32
    gc.collect()
    results: dict = {"params": params, "fp32_weight_bytes": fp32_bytes, "modes": {}}
    failures = []
    modes = {
        "int8": ({"load_in_8bit": True}, 0.4),
        "nf4": ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                 "bnb_4bit_compute_dtype": torch.float32}, 0.3),
    }  # fmt: skip
    for name, (options, limit) in modes.items():
        row = check_mode(name, options, limit, empty, folder, want, fp32_bytes, failures)
        results["modes"][name] = row
        print(name, json.dumps(row), flush=True)
    results.update({
        "provenance": stamp(),  # the date, commit and machine of this run
        "prompts": list(PROMPTS.shape),
        "failures": failures,
    })  # fmt: skip
    verdict = "FAILED: " + "; ".join(failures) if failures else "all checks passed"
    if SIZE == "1b":
        out = ROOT / "benchmarks" / "results" / "lowbit_1b.json"
        out.write_text(json.dumps(results, indent=1))
        print(f"wrote {out}")
    print(f"low-bit lane ({SIZE}, {params / 1e6:.0f}M parameters): {verdict}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
