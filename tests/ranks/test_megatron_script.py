"""An Accelerate-style Megatron-LM pre-training script (``megatron_lm_gpt_pretraining.py``'s
shape, import swapped to nbaccel) under ``nbaccel launch`` from Accelerate's own Megatron-LM
config file (``distributed_type: MEGATRON_LM``, ``megatron_lm_config:`` tp 2, pp 2, 2
micro-batches, sequence parallelism, recompute, distributed optimizer, clipping 1.0) on 4 CPU
ranks: the script's Megatron branches run (``DistributedType.MEGATRON_LM``,
``MegatronLMDummyScheduler``, ``global_batch_size`` 4 = 2 x 2 micro-batches, not DDP's 16), and
its losses, learning rates and perplexity are those of one process running Megatron-LM's
warm-up + linear-decay schedule on the global batches. The same script with a GPT-2 config
(tied embeddings) from the command-line flags with ``--cpu`` (tp 2, pp 2, 2 micro-batches,
recompute, distributed optimizer) gives its one-process figures too."""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = str(Path(__file__).parent.parent / "fixtures" / "megatron_lm_gpt_pretraining.py")

CONFIG = """compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: MEGATRON_LM
downcast_bf16: 'no'
fsdp_config: {}
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
megatron_lm_config:
  megatron_lm_gradient_clipping: 1.0
  megatron_lm_num_micro_batches: 2
  megatron_lm_pp_degree: 2
  megatron_lm_recompute_activations: true
  megatron_lm_sequence_parallelism: true
  megatron_lm_tp_degree: 2
  megatron_lm_use_distributed_optimizer: true
mixed_precision: 'no'
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
use_cpu: true
"""


def _one_process(name: str = "tiny-llama"):
    """The script's model, data and optimizer in one process: global batches of 4, Megatron-LM's
    schedule (train_iters = the script's 16 planned steps, 1 warm-up step, linear decay, counted
    in samples), clipping 1.0. Returns (losses, lrs, perplexity after the last epoch)."""
    from torch.utils.data import DataLoader

    ns = runpy.run_path(SCRIPT)
    model = ns["make_model"](name, 0)
    train, evaluation = ns["make_datasets"]()
    optimizer = torch.optim.AdamW(ns["param_groups"](model, 0.01), lr=5e-3)
    gbs, warmup, decay = 4, 4, 16 * 4

    def factor(step):
        n = step * gbs
        return n / warmup if n <= warmup else 1.0 - (n - warmup) / (decay - warmup)

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    losses, lrs = [], []
    for _ in range(2):
        for batch in DataLoader(train, batch_size=gbs):
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            lrs.append(schedule.get_last_lr()[0])
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    with torch.no_grad():
        evals = [model(**b).loss.item() for b in DataLoader(evaluation, batch_size=gbs)]
    return losses, lrs, math.exp(sum(evals) / len(evals))


@pytest.mark.timeout(600)
def _check(out: Path, name: str) -> None:
    result = json.loads((out / "all_results.json").read_text())
    assert result["distributed_type"] == "MEGATRON_LM"
    assert result["total_batch_size"] == 4  # dp 1 x micro 2 x 2 micro-batches (DDP: 16)
    assert result["steps"] == 8  # 16 blocks / 4 per step, 2 epochs
    losses, lrs, perplexity = _one_process(name)
    assert result["lrs"] == pytest.approx(lrs, rel=1e-6)
    assert result["losses"] == pytest.approx(losses, rel=1e-3)
    assert result["perplexity"] == pytest.approx(perplexity, rel=1e-3)
    assert (out / "megatron_model_0").is_dir()  # save_state: the stages' shards


def test_script_from_accelerates_megatron_config_gives_one_process_losses(tmp_path):
    from nbaccel.cli import main

    config = tmp_path / "megatron_gpt_config.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "out"
    code = main(["launch", "--config_file", str(config), SCRIPT, "--output_dir", str(out)])
    assert code == 0
    _check(out, "tiny-llama")


@pytest.mark.timeout(600)
def test_script_with_gpt2_from_the_megatron_flags_on_cpu(tmp_path):
    from nbaccel.cli import main

    flags = ["--cpu", "--num_processes", "4", "--use_megatron_lm", "--megatron_lm_tp_degree", "2",
             "--megatron_lm_pp_degree", "2", "--megatron_lm_num_micro_batches", "2",
             "--megatron_lm_recompute_activations", "true",
             "--megatron_lm_use_distributed_optimizer", "true"]  # fmt: skip
    out = tmp_path / "out"
    code = main(["launch", *flags, SCRIPT, "--output_dir", str(out), "--config_name", "tiny-gpt2"])
    assert code == 0
    _check(out, "tiny-gpt2")
