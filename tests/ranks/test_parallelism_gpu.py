"""GPU lane: the parallel layouts on NCCL ranks (skipped without 2 CUDA GPUs). TP2 equal to one
GPU in fp32 and close in bf16, context parallel (cp_size=2, the CUDA-only layout) close to the
full-sequence loss, prepare_pippy over 2 GPUs equal to the unsplit model, and (4 GPUs) Megatron
tp_degree=2 x pp_degree=2 equal to one GPU. Written to run as-is with `scripts/test-gpu`."""

from __future__ import annotations

import pytest
import torch
from _gpu import need_gpus
from _llama import Tokens, reference_run, tiny_llama
from torch.utils.data import DataLoader

from nbaccel.testing import run_on_ranks

pytestmark = pytest.mark.gpu
STEPS, BATCH = 3, 4


def _tp_losses(precision: str):
    from nbaccel import Accelerator
    from nbaccel.parallelism_config import ParallelismConfig

    acc = Accelerator(mixed_precision=precision, parallelism_config=ParallelismConfig(tp_size=2))
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(Tokens(), batch_size=BATCH // 2)  # micro-batches: 2 per step
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    losses = []
    for i, batch in enumerate(loader):
        if i == STEPS:
            break
        loss = model(**batch).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return str(model.lm_head.weight.device), losses


def test_tensor_parallel_on_nccl_fp32_and_bf16():
    need_gpus(2)
    ref, _ = reference_run(STEPS, BATCH)
    for precision, tol in (("no", 1e-4), ("bf16", 5e-2)):
        results = run_on_ranks(_tp_losses, 2, args=(precision,), cpu=False, timeout=300)
        assert [r[0] for r in results] == ["cuda:0", "cuda:1"]
        for _, losses in results:
            assert losses == pytest.approx(ref, abs=tol)


def _cp_loss():
    import torch.distributed as dist

    from nbaccel import Accelerator
    from nbaccel.parallelism_config import ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(cp_size=2))
    model = acc.prepare(tiny_llama())
    ids = Tokens()[0]["input_ids"][None].to(acc.device)
    shift = torch.cat([ids[:, 1:], torch.full((1, 1), -100, device=acc.device)], dim=1)
    position_ids = torch.arange(ids.shape[1], device=acc.device)[None]
    buffers = [ids, shift, position_ids]
    with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                    no_restore_buffers=set(buffers)):  # fmt: skip
        loss = model(input_ids=ids, labels=ids, shift_labels=shift, position_ids=position_ids).loss
    loss = loss.detach()
    dist.all_reduce(loss)
    return loss.item() / 2, ids.shape[1]


def test_context_parallel_on_cuda_is_close_to_the_full_sequence():
    need_gpus(2)
    results = run_on_ranks(_cp_loss, 2, cpu=False, timeout=300)
    model = tiny_llama()
    with torch.no_grad():
        full = model(**{k: v[None] for k, v in Tokens()[0].items()}).loss.item()
    for loss, local_len in results:
        assert local_len == 8  # each rank holds half the sequence
        assert loss == pytest.approx(full, rel=2e-2)  # per-rank means over 8 and 7 tokens


def _pippy():
    from nbaccel.bigmodel.pipeline import prepare_pippy

    ids = Tokens()[0]["input_ids"].repeat(4, 1)
    example = (ids[:2],)  # one micro-batch, traced whole: the 4 rows run as 2 micro-batches
    model = prepare_pippy(tiny_llama(layers=4).eval(), example_args=example, gather_output=True)
    with torch.no_grad():
        return model(ids.cuda()).logits.cpu()


def test_prepare_pippy_on_two_gpus():
    need_gpus(2)
    results = run_on_ranks(_pippy, 2, cpu=False, timeout=300)
    ids = Tokens()[0]["input_ids"].repeat(4, 1)
    with torch.no_grad():
        ref = tiny_llama(layers=4).eval()(ids).logits
    for logits in results:
        assert torch.allclose(logits, ref, atol=1e-4)


def _megatron():
    from nbaccel import Accelerator
    from nbaccel.utils import MegatronLMPlugin

    plugin = MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=2)
    acc = Accelerator(megatron_lm_plugin=plugin)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(Tokens(), batch_size=BATCH // 2)  # micro-batches: 2 per step
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    losses = []
    for i, batch in enumerate(loader):
        if i == STEPS:
            break
        loss = model(**batch).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_megatron_tp2_pp2_on_four_gpus():
    need_gpus(4)
    ref, _ = reference_run(STEPS, BATCH, clip=1.0)  # Accelerate's default gradient_clipping
    for losses in run_on_ranks(_megatron, 4, cpu=False, timeout=300):
        assert losses == pytest.approx(ref, abs=1e-4)
