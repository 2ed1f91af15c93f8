"""transformers' ``Trainer`` on the tiny Llama of ``_llama`` (no downloads), as ranks run it.

    from _trainer import train_tiny   # tests/ is on sys.path (ranks inherit it)
    results = notebook_launcher(train_tiny, (str(tmp_path),), num_processes=2, cpu=True)

:func:`train_tiny` trains for ``max_steps`` steps (batch 4 per rank, a log every 2 steps, an
evaluation every 3 with ``evaluate``) and returns what the test compares: the rank, the
Trainer's log history, its progress-callback classes, the step it started from and the final
loss. With ``kill_after`` (and a ``marker`` path), rank 1 SIGKILLs itself at the end of the
step after that step's checkpoint (the step's gradients were all-reduced, so rank 0 has written
the checkpoint whole), the first time only; with ``raise_at``, rank 1 raises inside
``trainer.train()`` at that step.
"""

from __future__ import annotations

__all__ = ["train_tiny"]


def train_tiny(
    output_dir: str,
    max_steps: int = 6,
    evaluate: bool = False,
    save_steps: int | None = None,
    kill_after: int | None = None,
    marker: str | None = None,
    raise_at: int | None = None,
) -> dict:
    import os
    import signal

    from _llama import Tokens, tiny_llama
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    rank = int(os.environ.get("RANK", "0"))

    class Misbehave(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            due = kill_after is not None and state.global_step == kill_after + 1
            if rank == 1 and due and marker is not None and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            if state.global_step == raise_at and rank == 1:
                raise ValueError(f"the loss went away at step {state.global_step}")

    args = TrainingArguments(
        output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=2,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=3,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        use_cpu=True,
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=tiny_llama(),
        args=args,
        train_dataset=Tokens(),
        eval_dataset=Tokens(8, seed=7) if evaluate else None,
        callbacks=[Misbehave()],
    )
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    result = trainer.train(resume_from_checkpoint=last)
    return {
        "rank": rank,
        "callbacks": [type(c).__name__ for c in trainer.callback_handler.callbacks],
        "log_history": trainer.state.log_history,
        "resumed_from": last and os.path.basename(last),
        "training_loss": result.training_loss,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }
