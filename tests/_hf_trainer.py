"""Transformers' ``Trainer`` (plain, PEFT LoRA, TRL ``SFTTrainer``) on the tiny Llama, a few
steps, recording what each rank's Accelerate ``Accelerator`` ran: precision, engine, losses.

Run as a script under ``accelerate launch`` / ``nbaccel launch`` (``python _hf_trainer.py OUT
CASES``), or call :func:`train` on each rank of ``notebook_launcher``; both write
``OUT.<rank>.json``."""

from __future__ import annotations

import json
import os
import sys
import tempfile

STEPS = 3


def _dataset():
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (8 * STEPS, 16), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def _tokenizer():
    """A word-level tokenizer over the 128 ids, built here (no download)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(128)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="t0", eos_token="t1",
                                   unk_token="t0")  # fmt: skip


def _arguments(kind, output: str, extra: dict):
    return kind(
        output_dir=output,
        per_device_train_batch_size=2,
        max_steps=STEPS,
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        use_cpu=os.environ.get("TRAINER_TEST_ON_GPU") != "1",  # the GPU lane's FSDP case
        **extra,
    )


def _run_case(case: str, output: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                         max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if case == "peft":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    if case == "trl":
        from trl import SFTConfig, SFTTrainer

        args = _arguments(SFTConfig, output, {"max_length": 16, "packing": False})
        trainer = SFTTrainer(model=model, args=args, train_dataset=_dataset(),
                             processing_class=_tokenizer())  # fmt: skip
    else:
        args = _arguments(TrainingArguments, output, {})
        trainer = Trainer(model=model, args=args, train_dataset=_dataset())
    trainer.train()
    accelerator = trainer.accelerator
    return {
        "mixed_precision": str(accelerator.mixed_precision),
        "distributed_type": str(accelerator.distributed_type),
        "num_processes": accelerator.num_processes,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }


def train(out: str, cases: str = "plain") -> dict:
    """Train each case (comma-separated: plain, peft, trl) and write ``out.<rank>.json``."""
    import socket

    import accelerate
    from accelerate.state import AcceleratorState, PartialState

    with tempfile.TemporaryDirectory() as output:
        record = {}
        for case in cases.split(","):
            record[case] = _run_case(case, output)
            AcceleratorState._reset_state(reset_partial_state=False)
    rank = PartialState().process_index
    record["environ"] = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    record["accelerate"] = accelerate.__version__
    record["host"] = socket.gethostname()
    with open(f"{out}.{rank}.json", "w") as handle:
        json.dump(record, handle)
    return record


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "plain")
