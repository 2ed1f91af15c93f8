"""GPU lane: QLoRA with transformers' Trainer under ``notebook_launcher``, the recipe of
docs/transformers.md made small. A tiny Llama built from a config is saved, each rank loads it in
4 bits (bitsandbytes nf4) on its own GPU (``device_map={"": local_rank}``), PEFT adds LoRA
adapters and the Trainer trains them with DDP. One GPU runs one rank with gradient accumulation 2:
the same two ranks' worth of work per step.

Run it with ``scripts/test-gpu -k qlora`` (it skips on a machine without CUDA).
"""

from __future__ import annotations

import math

import pytest
from _gpu import ranks
from recorder import Recorder

from nbaccel import notebook_launcher
from nbaccel.notebook.events import ProgressUpdate

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _qlora(base: str, output_dir: str, accumulation: int) -> dict:
    import torch
    from _llama import Tokens
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import (
        AutoModelForCausalLM,
        BitsAndBytesConfig,
        Trainer,
        TrainingArguments,
    )

    from nbaccel import PartialState

    local_rank = PartialState().local_process_index
    bf16 = torch.cuda.is_bf16_supported()
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16 if bf16 else torch.float16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=quantization, device_map={"": local_rank}
    )
    model = prepare_model_for_kbit_training(model)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(model, lora)
    args = TrainingArguments(
        output_dir,
        max_steps=12,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=bf16,
        fp16=not bf16,
        ddp_find_unused_parameters=False,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64))
    trainer.train()
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    return {
        "rank": local_rank,
        "world": trainer.args.world_size,
        "device": str(next(p for p in model.parameters() if p.requires_grad).device),
        "base_layer": type(q_proj.base_layer).__name__,
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }


def test_qlora_trainer_on_the_gpus(tmp_path):
    from _llama import tiny_llama

    base = tmp_path / "base"
    tiny_llama().save_pretrained(base)
    n = ranks()
    rec = Recorder()
    results = notebook_launcher(
        _qlora, (str(base), str(tmp_path / "out"), 2 // n), num_processes=n, renderer=rec
    )
    assert [r["rank"] for r in results] == list(range(n))
    for r in results:
        assert r["world"] == n and r["device"] == f"cuda:{r['rank']}"
        assert r["base_layer"] == "Linear4bit"  # the base is nf4, the adapters train
        assert 0 < r["trainable"] < 20_000
    losses = results[0]["losses"]
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]  # the adapters learn
    bars = [p for _, rank, _, p in rec.events if isinstance(p, ProgressUpdate) and rank == 0]
    assert bars and bars[-1].final and bars[-1].n == 12  # the Trainer's bar reached the notebook
