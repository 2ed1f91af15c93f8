"""MegatronLMPlugin on torch's engines, 4 gloo ranks (tp_degree=2 x pp_degree=2): the training
loop of Accelerate's Megatron-LM guide, unchanged, trains a tiny transformers Llama to the losses
and weights of one process; micro-batches run inside the model call (1F1B schedule); gradient
clipping is by the global norm across stages; save_state/load_state resumes exactly; with
sequence_parallelism=True the activations between blocks hold half the sequence per rank and the
losses stay the same; pp 2 x dp 2 averages gradients over the data-parallel ranks. One launch."""

from __future__ import annotations

import pytest
import torch
from _llama import Tokens, max_diff, reference_run, tiny_llama
from torch.utils.data import DataLoader

from nbaccel.testing import run_on_ranks

STEPS, BATCH, CLIP = 4, 4, 1.0


def _guide_loop(root: str):
    from nbaccel import Accelerator
    from nbaccel.utils import MegatronLMPlugin

    def train(resume: bool):
        plugin = MegatronLMPlugin(
            tp_degree=2, pp_degree=2, num_micro_batches=2, gradient_clipping=CLIP
        )
        accelerator = Accelerator(megatron_lm_plugin=plugin)
        model = tiny_llama()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_dataloader = DataLoader(Tokens(), batch_size=BATCH)
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, lr_scheduler
        )
        if resume:
            accelerator.load_state(root)
        losses = []
        model.train()
        for step, batch in enumerate(train_dataloader):
            if step == STEPS:
                break
            if resume and step < 2:
                continue
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if not resume and step == 1:
                accelerator.save_state(root)
        model.eval()
        with torch.no_grad():
            eval_loss = model(**next(iter(train_dataloader))).loss.item()
        state = accelerator.get_state_dict(model)
        stage = accelerator.unwrap_model(model)
        return {
            "losses": losses,
            "eval": eval_loss,
            "pp_rank": accelerator.pipeline_parallel_rank,
            "layers": stage.layer_range,
            "q_proj": None
            if not stage.model.layers
            else tuple(
                next(iter(stage.model.layers.values())).self_attn.q_proj.weight.to_local().shape
            ),  # fmt: skip
            "state": {k: v.clone() for k, v in state.items()},
            "optimizer_params": sum(len(g["params"]) for g in optimizer.optimizer.param_groups),
        }

    return train(resume=False), train(resume=True), _sequence_parallel(), _data_parallel()


def _data_parallel():
    """pp 2 with the other 2 ranks as data parallel (dp 2): gradients averaged over dp."""
    from nbaccel import Accelerator
    from nbaccel.utils import MegatronLMPlugin

    plugin = MegatronLMPlugin(pp_degree=2, num_micro_batches=2, gradient_clipping=CLIP)
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(Tokens(), batch_size=BATCH // 2)  # per data-parallel rank
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        outputs = model(**batch)
        accelerator.backward(outputs.loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(outputs.loss.item())
    state = accelerator.get_state_dict(model)
    return {"losses": losses, "dp": accelerator.strategy.data_parallel_size, "state": state}


def _sequence_parallel():
    """tp 2 x pp 2 with sequence_parallelism=True: the same losses, and between attention/MLP
    blocks each rank holds half of the sequence."""
    from nbaccel import Accelerator
    from nbaccel.utils import MegatronLMPlugin

    plugin = MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=2,
                              gradient_clipping=CLIP, sequence_parallelism=True)  # fmt: skip
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(Tokens(), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    layer = next(iter(accelerator.unwrap_model(model).model.layers.values()))
    shapes = []
    layer.register_forward_hook(lambda m, args, out: shapes.append(tuple(out.shape)))
    losses = []
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        outputs = model(**batch)
        accelerator.backward(outputs.loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(outputs.loss.item())
    return {"losses": losses, "layer_output": shapes[0]}


def test_megatron_guide_loop_tp2_pp2_matches_one_process(tmp_path):
    results = run_on_ranks(_guide_loop, 4, args=(str(tmp_path / "ckpt"),), timeout=600)
    ref_losses, ref_state = reference_run(STEPS, BATCH, clip=CLIP)
    first = [r[0] for r in results]
    assert [r["pp_rank"] for r in first] == [0, 0, 1, 1]
    assert [r["layers"] for r in first] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert {r["q_proj"] for r in first} == {(32, 64)}  # 64 rows split over tp=2
    # each rank's optimizer keeps only its stage's parameters
    assert first[0]["optimizer_params"] < len(ref_state)
    for r in first:
        assert r["losses"] == pytest.approx(ref_losses, abs=2e-5)
    assert max_diff(first[0]["state"], ref_state) < 1e-4
    plain = tiny_llama(seed=9)
    plain.load_state_dict(first[0]["state"])  # the gathered stages load into the full model
    with torch.no_grad():
        batch = next(iter(DataLoader(Tokens(), batch_size=BATCH)))
        expected_eval = plain(**batch).loss.item()
    for r in first:
        assert r["eval"] == pytest.approx(expected_eval, abs=2e-5)
    for r in results:  # sequence parallel: micro-batch of 2, 16 tokens split over tp=2
        assert r[2]["layer_output"] == (2, 8, 64)
        assert r[2]["losses"] == pytest.approx(ref_losses, abs=2e-5)
    for r in results:  # dp 2 x pp 2: the loss of the global batch on every rank
        assert r[3]["dp"] == 2
        assert r[3]["losses"] == pytest.approx(ref_losses, abs=2e-5)
    assert max_diff(results[0][3]["state"], ref_state) < 1e-4
    resumed = [r[1] for r in results]
    for r in resumed:
        assert r["losses"] == pytest.approx(ref_losses[2:], abs=2e-5)
    assert max_diff(resumed[0]["state"], ref_state) < 1e-4
