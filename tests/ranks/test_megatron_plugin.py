"""MegatronLMPlugin on torch's engines, 4 gloo ranks (tp_degree=2 x pp_degree=2): the training
loop of Accelerate's Megatron-LM guide as written (``MegatronLMPlugin(lr_decay_style=...)``,
``MegatronLMDummyScheduler(optimizer=..., total_num_steps=..., warmup_num_steps=...)``,
``accelerator.state.megatron_lm_plugin.global_batch_size``, ``DistributedType.MEGATRON_LM``)
trains a tiny transformers Llama to the losses and weights of one process running Megatron-LM's
warm-up + cosine schedule (written out here); the loaders' batches are micro-batches and each
step runs ``num_micro_batches`` of them (1F1B schedule); gradient clipping is by the global norm
across stages; save_state/load_state resumes exactly (schedule included); ``save_pretrained`` /
``save_model`` of the stages write the whole model; with sequence_parallelism=True (and
activation recomputation) the activations between blocks hold half the sequence per rank and the
losses stay the same; pp 2 x dp 2 averages gradients over the data-parallel ranks, and with
``use_distributed_optimizer`` each data-parallel rank keeps the optimizer state of half the
parameters, with the same losses. One launch."""

from __future__ import annotations

import math

import pytest
import torch
from _llama import Tokens, max_diff, reference_run, tiny_llama
from torch.utils.data import DataLoader

from nbaccel.testing import run_on_ranks

STEPS, BATCH, CLIP = 4, 4, 1.0  # BATCH: the global batch (2 micro-batches of 2)
WARMUP = 1


def megatron_cosine(step: int) -> float:
    """Megatron-LM's lr factor after ``step`` steps: linear warm-up over WARMUP steps, cosine
    decay to 0 over the run (counted in samples: BATCH per step)."""
    n, warmup, decay = step * BATCH, WARMUP * BATCH, STEPS * BATCH
    if n <= warmup:
        return n / warmup
    return 0.5 * (math.cos(math.pi * (n - warmup) / (decay - warmup)) + 1.0)


def _guide_loop(root: str):
    from nbaccel import Accelerator, DistributedType
    from nbaccel.utils import MegatronLMDummyScheduler, MegatronLMPlugin

    def train(resume: bool):
        plugin = MegatronLMPlugin(
            tp_degree=2, pp_degree=2, num_micro_batches=2, gradient_clipping=CLIP,
            lr_decay_style="cosine",
        )  # fmt: skip
        accelerator = Accelerator(megatron_lm_plugin=plugin)
        model = tiny_llama()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_dataloader = DataLoader(Tokens(), batch_size=BATCH // 2)  # per_device: micro
        if accelerator.distributed_type == DistributedType.MEGATRON_LM:
            lr_scheduler = MegatronLMDummyScheduler(
                optimizer=optimizer, total_num_steps=STEPS, warmup_num_steps=WARMUP
            )
        model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, lr_scheduler
        )
        total_batch_size = accelerator.state.megatron_lm_plugin.global_batch_size
        if resume:
            accelerator.load_state(root)
        losses, lrs = [], []
        model.train()
        for step, batch in enumerate(train_dataloader):
            if step == STEPS:
                break
            if resume and step < 2:
                continue
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            lrs.append(lr_scheduler.get_last_lr()[0])
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
        if not resume:  # the script's save: every rank calls, the main process writes
            stage.save_pretrained(f"{root}-pretrained", is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save)  # fmt: skip
            accelerator.save_model(model, f"{root}-model")
        return {
            "losses": losses,
            "lrs": lrs,
            "batch": batch["input_ids"].shape[0],
            "total_batch_size": total_batch_size,
            "kind": accelerator.distributed_type.value,
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

    return (train(resume=False), train(resume=True), _sequence_parallel(),
            _data_parallel(False), _data_parallel(True, root + "-zero"))  # fmt: skip


def _data_parallel(distributed_optimizer: bool, root: str | None = None):
    """pp 2 with the other 2 ranks as data parallel (dp 2): gradients averaged over dp; with
    the distributed optimizer each dp rank steps (and keeps the state of) its share, its
    checkpoint resumes exactly, and a batch of another length than seq_length is refused."""
    from nbaccel import Accelerator
    from nbaccel.utils import MegatronLMPlugin

    def run(resume: bool):
        plugin = MegatronLMPlugin(pp_degree=2, num_micro_batches=2, gradient_clipping=CLIP,
                                  use_distributed_optimizer=distributed_optimizer,
                                  seq_length=16)  # fmt: skip
        accelerator = Accelerator(megatron_lm_plugin=plugin)
        model = tiny_llama()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(Tokens(), batch_size=BATCH // 4)  # micro-batch per dp rank
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
        if resume:
            accelerator.load_state(root)
        losses = []
        for step, batch in enumerate(loader):
            if step == STEPS:
                break
            if resume and step < 2:
                continue
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            losses.append(outputs.loss.item())
            if root and not resume and step == 1:
                accelerator.save_state(root)
        return accelerator, model, optimizer, plugin, losses, batch, schedule

    accelerator, model, optimizer, plugin, losses, batch, schedule = run(resume=False)
    try:
        model(input_ids=batch["input_ids"][:, :8], labels=batch["labels"][:, :8])
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    state = accelerator.get_state_dict(model)
    stage_params = len(list(accelerator.unwrap_model(model).parameters()))
    inner = optimizer.optimizer
    return {
        "losses": losses,
        "resumed": run(resume=True)[4] if root else None,
        "refused": refused,
        "scheduler_steps": schedule.scheduler.last_epoch,
        "dp": accelerator.strategy.data_parallel_size,
        "state": state,
        "global_batch": plugin.global_batch_size,
        "stage_params": stage_params,
        "optimizer_params": sum(len(g["params"]) for g in inner.param_groups),
        "optimizer_states": len(inner.state),
    }


def _sequence_parallel():
    """tp 2 x pp 2 with sequence_parallelism=True: the same losses, and between attention/MLP
    blocks each rank holds half of the sequence."""
    from nbaccel import Accelerator
    from nbaccel.utils import MegatronLMPlugin

    plugin = MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=2,
                              gradient_clipping=CLIP, sequence_parallelism=True,
                              recompute_activations=True)  # fmt: skip
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(Tokens(), batch_size=BATCH // 2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    layer = next(iter(accelerator.unwrap_model(model).model.layers.values()))
    layer = getattr(layer, "_checkpoint_wrapped_module", layer)  # recompute_activations
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
    ref_losses, ref_state = reference_run(STEPS, BATCH, clip=CLIP, lr_factor=megatron_cosine)
    plain_losses, plain_state = reference_run(STEPS, BATCH, clip=CLIP)
    first = [r[0] for r in results]
    for r in first:
        assert r["kind"] == "MEGATRON_LM"
        assert r["total_batch_size"] == BATCH and r["batch"] == BATCH  # 2 x 2 micro-batches
        assert r["lrs"] == pytest.approx([1e-2 * megatron_cosine(k) for k in range(STEPS)])
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-3)
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    # the whole model, from every stage: save_pretrained (with its config), save_model (weights)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "ckpt-pretrained")
    assert max_diff(loaded.state_dict(), ref_state) < 1e-4
    assert max_diff(load_file(tmp_path / "ckpt-model" / "model.safetensors"), ref_state) < 1e-4
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
        assert r[2]["losses"] == pytest.approx(plain_losses, abs=2e-5)
    for r in results:  # dp 2 x pp 2: the loss of the global batch on every rank
        for run in (r[3], r[4]):
            assert run["dp"] == 2 and run["global_batch"] == BATCH
            assert run["losses"] == pytest.approx(plain_losses, abs=2e-5)
        assert r[3]["optimizer_params"] == r[3]["stage_params"]
        assert r[3]["scheduler_steps"] == STEPS * 2  # a torch scheduler: once per dp batch
        assert 0 < r[4]["optimizer_params"] < r[4]["stage_params"]  # its share only
        assert r[4]["optimizer_states"] == r[4]["optimizer_params"]
        assert r[4]["resumed"] == pytest.approx(plain_losses[2:], abs=2e-5)
        assert "have 8 tokens, but MegatronLMPlugin(seq_length=16)" in r[3]["refused"]
    for pp in ((0, 1), (2, 3)):  # the two dp ranks of a stage share its parameters out
        assert (
            sum(results[i][4]["optimizer_params"] for i in pp) == results[pp[0]][4]["stage_params"]
        )
    assert max_diff(results[0][3]["state"], plain_state) < 1e-4
    assert max_diff(results[0][4]["state"], plain_state) < 1e-4
    resumed = [r[1] for r in results]
    for r in resumed:
        assert r["losses"] == pytest.approx(ref_losses[2:], abs=2e-5)
    assert max_diff(resumed[0]["state"], ref_state) < 1e-4


def tiny_gpt2(seed: int = 0):
    """A GPT2LMHeadModel (lm_head tied to wte), hidden 64, 2 blocks, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def _gpt2(root: str):
    """GPT-2 at tp 2 x pp 2 (recompute of the attention blocks too): Conv1D split by columns
    and rows, q/k/v kept whole per rank, the tied wte/lm_head synchronised across the stages."""
    from nbaccel import Accelerator
    from nbaccel.utils import MegatronLMPlugin

    plugin = MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=2,
                              gradient_clipping=CLIP,
                              recompute_granularity="selective")  # fmt: skip
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(Tokens(), batch_size=BATCH // 2)
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
    accelerator.unwrap_model(model).save_pretrained(
        root, is_main_process=accelerator.is_main_process
    )
    return {"losses": losses, "state": state}


def test_gpt2_tp2_pp2_matches_one_process(tmp_path):
    from transformers import GPT2LMHeadModel

    results = run_on_ranks(_gpt2, 4, args=(str(tmp_path / "gpt2"),), timeout=600)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = []
    for step, batch in enumerate(DataLoader(Tokens(), batch_size=BATCH)):
        if step == STEPS:
            break
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        ref.append(loss.item())
    for r in results:
        assert r["losses"] == pytest.approx(ref, abs=2e-5)
    expected = model.state_dict()
    assert max_diff({k: results[0]["state"][k] for k in expected}, expected) < 1e-4
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again
    assert max_diff(loaded.state_dict(), expected) < 1e-4
