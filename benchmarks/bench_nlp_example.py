"""Accelerate's ``nlp_example`` training loop, nbaccel's Accelerator vs accelerate's, wall time.

    .venv/bin/python benchmarks/bench_nlp_example.py [--runs 2]

The same script (this file) runs with either library's ``Accelerator`` on 2 CPU ranks started by
torchrun (the same launcher for both, so only the training library differs): a small text
classifier (embedding + 2-layer transformer encoder) on a synthetic, learnable paired-sentence
task, AdamW with a linear warm-up/decay schedule, gradient accumulation by hand as in the
example, evaluation through ``gather_for_metrics`` after each epoch. Rank 0 reports the loop's
wall time (after ``prepare``) and the accuracy; runs of the two libraries alternate. Writes
benchmarks/results/nlp_example.json. Never run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EPOCHS, TRAIN_BATCHES, EVAL_BATCHES, BATCH, ACCUMULATE = 2, 48, 12, 16, 2
VOCAB, SEQ = 512, 32


def _data(count: int, seed: int):
    """Token pairs; the label says whether the two halves share their most frequent token."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (count, SEQ), generator=gen)
    same = torch.rand(count, generator=gen) < 0.5
    ids[same, SEQ // 2 : SEQ // 2 + 4] = ids[same, :4]
    return [{"input_ids": ids[i], "labels": same[i].long()} for i in range(count)]


def _train(tool: str) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    if tool == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import set_seed
    else:
        from nbaccel import Accelerator, set_seed

    torch.set_num_threads(1)

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 64)
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2)
            self.head = nn.Linear(64, 2)

        def forward(self, input_ids, labels=None):
            logits = self.head(self.encoder(self.embed(input_ids)).mean(1))
            loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
            return loss, logits

    accelerator = Accelerator(cpu=True)
    set_seed(42)
    train = DataLoader(_data(TRAIN_BATCHES * BATCH * 2, 0), batch_size=BATCH, shuffle=True)
    evaluation = DataLoader(_data(EVAL_BATCHES * BATCH * 2, 1), batch_size=BATCH)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    total = EPOCHS * len(train) // ACCUMULATE

    def schedule(step: int) -> float:
        warm = max(1, total // 10)
        return step / warm if step < warm else max(0.0, (total - step) / (total - warm))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model, optimizer, train, evaluation, scheduler = accelerator.prepare(
        model, optimizer, train, evaluation, scheduler
    )
    start = time.perf_counter()
    accuracy = 0.0
    for _ in range(EPOCHS):
        model.train()
        for step, batch in enumerate(train):
            loss, _ = model(**batch)
            accelerator.backward(loss / ACCUMULATE)
            if step % ACCUMULATE == 0:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        correct = seen = 0
        for batch in evaluation:
            with torch.no_grad():
                _, logits = model(**batch)
            predictions, references = accelerator.gather_for_metrics(
                (logits.argmax(-1), batch["labels"])
            )
            correct += int((predictions == references).sum())
            seen += len(references)
        accuracy = correct / seen
    seconds = time.perf_counter() - start
    if accelerator.is_main_process:
        print("RESULT " + json.dumps({"loop_s": seconds, "accuracy": accuracy}), flush=True)
    accelerator.wait_for_everyone()


def _run_once(tool: str) -> dict:
    env = {**os.environ, "BENCH_NLP_TOOL": tool, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", __file__]
    started = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - started
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{tool} run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {**json.loads(line.split(" ", 1)[1]), "process_wall_s": wall}


def measure(runs: int = 2) -> dict:
    """Alternate the two libraries ``runs`` times each; medians and their ratio."""
    results: dict[str, list[dict]] = {"nbaccel": [], "accelerate": []}
    for i in range(runs):
        order = ("nbaccel", "accelerate") if i % 2 == 0 else ("accelerate", "nbaccel")
        for tool in order:
            results[tool].append(_run_once(tool))
    loop = {tool: statistics.median(r["loop_s"] for r in rs) for tool, rs in results.items()}
    return {
        "benchmark": "nlp_example-style loop, 2 CPU ranks (torchrun), loop wall time",
        "runs": results,
        "nbaccel_loop_s": loop["nbaccel"],
        "accelerate_loop_s": loop["accelerate"],
        "ratio_nbaccel_over_accelerate": loop["nbaccel"] / loop["accelerate"],
        "same_accuracy": len({r["accuracy"] for rs in results.values() for r in rs}) == 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    result = measure(args.runs)
    out = ROOT / "benchmarks" / "results" / "nlp_example.json"
    from provenance import stamp  # the date, commit and machine of this run

    result["provenance"] = stamp()
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"loop: nbaccel {result['nbaccel_loop_s']:.2f} s, accelerate "
        f"{result['accelerate_loop_s']:.2f} s, ratio {result['ratio_nbaccel_over_accelerate']:.3f}"
        f", same accuracy: {result['same_accuracy']}"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    if os.environ.get("BENCH_NLP_TOOL") and os.environ.get("RANK"):
        _train(os.environ["BENCH_NLP_TOOL"])
    else:
        main()
