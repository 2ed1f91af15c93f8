"""The Trainer workload of ``bench_first_step.py``: transformers' ``Trainer`` on a small Llama,
as each rank runs it, under any launcher.

    notebook_launcher(train, args=(folder, 200), num_processes=2, cpu=True)   # in a notebook
    nbaccel launch --cpu --num_processes 2 benchmarks/trainer_steps.py FOLDER 200

The model and data are the tiny Llama of ``tests/_llama.py`` (hidden 64, 2 layers, a 128-token
vocabulary, built from its config: no download) and its 32 random sequences, 4 per rank and
step. A ``TrainerCallback`` notes the wall clock (``time.time()``, the clock the launching
process notes its launch with) at the end of the first optimizer step; each rank writes
``FOLDER/rank<N>.json``: that time, ``train_runtime`` and the steps it covers, the final loss,
and what the rank ran with (threads, CPU affinity).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1] / "tests")  # _llama: the tiny Llama and its data


def train(folder: str, steps: int = 200) -> None:
    """Train the tiny Llama for ``steps`` optimizer steps with ``Trainer``; write this rank's
    figures to ``folder/rank<N>.json``."""
    if _TESTS not in sys.path:
        sys.path.insert(0, _TESTS)
    import torch
    from _llama import Tokens, tiny_llama
    from transformers import Trainer, TrainerCallback, TrainingArguments

    first: list[float] = []

    class FirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if not first:
                first.append(time.time())

    args = TrainingArguments(
        output_dir=os.path.join(folder, "trainer"),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",
        use_cpu=True,
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=tiny_llama(), args=args, train_dataset=Tokens(), callbacks=[FirstStep()]
    )
    result = trainer.train()
    rank = trainer.args.process_index
    record = {
        "rank": rank,
        "world_size": trainer.args.world_size,
        "first_step": first[0],
        "train_runtime": result.metrics["train_runtime"],
        "steps": result.global_step,
        "training_loss": result.training_loss,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    train(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200)
