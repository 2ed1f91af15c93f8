"""ParallelismConfig trained on real gloo ranks: TP2 x FSDP2 and HSDP 2x2 on 4 ranks, TP2 on 2,
each equal to one process training the same tiny transformers Llama on the global batch;
save_state/load_state resumes to the uninterrupted result; get_state_dict gathers full tensors
that a plain (unsharded) model loads; a model without a plan trains with the user's plan
(TorchTensorParallelPlugin). One 4-rank and one 2-rank launch."""

from __future__ import annotations

import pytest
import torch
from _llama import Tokens, max_diff, reference_run, tiny_llama
from torch.utils.data import DataLoader

from nbaccel.testing import run_on_ranks

STEPS, PER_RANK = 4, 4


def _train(sizes: dict, root: str | None, clip: float | None = None, sharded: bool = False):
    """Train the tiny Llama under ``sizes``; with ``root``, save after 2 steps, then resume a
    fresh model from it and check it ends where the uninterrupted run ended."""
    from nbaccel import Accelerator
    from nbaccel.training.config.parallelism_config import ParallelismConfig

    def run(resume_from: str | None = None, save_at: int | None = None):
        from nbaccel.utils import FullyShardedDataParallelPlugin

        kind = "SHARDED_STATE_DICT" if sharded else "FULL_STATE_DICT"
        plugin = FullyShardedDataParallelPlugin(state_dict_type=kind)
        accelerator = Accelerator(parallelism_config=ParallelismConfig(**sizes), fsdp_plugin=plugin)
        model = tiny_llama()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(Tokens(), batch_size=PER_RANK)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        start = 0
        if resume_from is not None:
            accelerator.load_state(resume_from)
            start = save_at
        losses = []
        for i, batch in enumerate(loader):
            if i == STEPS:
                break
            if i < start:
                continue
            loss = model(**batch).loss
            accelerator.backward(loss)
            if clip is not None:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if save_at is not None and resume_from is None and i + 1 == save_at:
                accelerator.save_state(root)
        return accelerator, model, losses

    accelerator, model, losses = run(save_at=2 if root else None)
    mesh = accelerator.torch_device_mesh
    out = {
        "losses": losses,
        "mesh": (tuple(mesh.mesh_dim_names), tuple(mesh.shape)),
        "dp": (accelerator.strategy.data_parallel_size, accelerator.strategy.data_parallel_rank),
        "tp_rank": accelerator.tensor_parallel_rank,
        "q_proj": tuple(model.model.layers[0].self_attn.q_proj.weight.to_local().shape),
    }
    full = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        out["state"] = {k: v.clone() for k, v in full.items()}
    if root:
        second, model2, resumed = run(resume_from=root, save_at=2)
        out["resumed"] = resumed
        again = second.get_state_dict(model2)
        if accelerator.is_main_process:
            out["resumed_diff"] = max_diff(again, full)
    return out


def _four_ranks(root: str):
    tp_fsdp = _train({"dp_shard_size": 2, "tp_size": 2}, root + "/tp_fsdp", clip=1.0)
    hsdp = _train({"dp_replicate_size": 2, "dp_shard_size": 2}, None)
    sharded = _train({"dp_shard_size": 2, "tp_size": 2}, root + "/dcp", clip=1.0, sharded=True)
    return tp_fsdp, hsdp, sharded


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _mlp_data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(3)]


def _user_plan():
    """A model without a plan of its own, split by the plan the user passes (torch styles and
    transformers' words mixed), through Accelerate's older TorchTensorParallelPlugin."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from nbaccel import Accelerator
    from nbaccel.utils import TorchTensorParallelPlugin

    plugin = TorchTensorParallelPlugin(tp_size=2, tp_plan={"0": ColwiseParallel(), "2": "rowwise"})
    accelerator = Accelerator(torch_tp_plugin=plugin)
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for x, y in _mlp_data():
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, tuple(model[0].weight.to_local().shape), accelerator.parallelism_config.tp_size


def _two_ranks(root: str):
    return _train({"tp_size": 2}, root + "/tp"), _user_plan()


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_on_ranks(_four_ranks, 4, args=(str(tmp_path_factory.mktemp("mesh4")),), timeout=600)


def _global_losses(results, key):
    """The loss of the global batch: the mean over data-parallel ranks (equal token counts);
    ranks of one tensor-parallel group must agree."""
    by_dp: dict[int, list] = {}
    for r in results:
        by_dp.setdefault(r["dp"][1], []).append(r[key])
    for same in by_dp.values():
        for other in same[1:]:
            assert other == pytest.approx(same[0], abs=1e-6)
    per_dp = [same[0] for same in by_dp.values()]
    return [sum(step) / len(per_dp) for step in zip(*per_dp, strict=True)]


def _check_against_reference(results, global_batch, clip=None, tol=2e-5):
    ref_losses, ref_state = reference_run(STEPS, global_batch, clip=clip)
    assert _global_losses(results, "losses") == pytest.approx(ref_losses, abs=tol)
    main = results[0]
    assert max_diff(main["state"], ref_state) < 1e-4
    plain = tiny_llama(seed=123)
    plain.load_state_dict(main["state"])  # loadable into an unsharded model


def test_tp2_x_fsdp2_on_4_ranks_equals_one_process(four):
    results = [r[0] for r in four]
    assert {r["mesh"] for r in results} == {(("dp_shard", "tp"), (2, 2))}
    assert [r["dp"] for r in results] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert [r["tp_rank"] for r in results] == [0, 1, 0, 1]
    # q_proj (64x64) is split over tp, then its rows over dp_shard: 64 / 2 / 2
    assert {r["q_proj"] for r in results} == {(16, 64)}
    _check_against_reference(results, global_batch=2 * PER_RANK, clip=1.0)
    ref_losses, _ = reference_run(STEPS, 2 * PER_RANK, clip=1.0)
    assert _global_losses(results, "resumed") == pytest.approx(ref_losses[2:], abs=2e-5)
    assert results[0]["resumed_diff"] < 1e-6


def test_tp2_x_fsdp2_resumes_from_a_sharded_dcp_checkpoint(four):
    results = [r[2] for r in four]
    ref_losses, _ = reference_run(STEPS, 2 * PER_RANK, clip=1.0)
    assert _global_losses(results, "resumed") == pytest.approx(ref_losses[2:], abs=2e-5)
    assert results[0]["resumed_diff"] < 1e-6


def test_hsdp_2x2_on_4_ranks_equals_one_process(four):
    results = [r[1] for r in four]
    assert {r["mesh"] for r in results} == {(("dp_replicate", "dp_shard"), (2, 2))}
    assert [r["dp"] for r in results] == [(4, 0), (4, 1), (4, 2), (4, 3)]
    _check_against_reference(results, global_batch=4 * PER_RANK)


def test_tp2_on_2_ranks_equals_one_process_and_resumes(tmp_path):
    both = run_on_ranks(_two_ranks, 2, args=(str(tmp_path),), timeout=400)
    results = [r[0] for r in both]
    assert {r["mesh"] for r in results} == {(("tp",), (2,))}
    assert [r["dp"] for r in results] == [(1, 0), (1, 0)]
    assert {r["q_proj"] for r in results} == {(32, 64)}
    _check_against_reference(results, global_batch=PER_RANK)
    ref_losses, _ = reference_run(STEPS, PER_RANK)
    assert _global_losses(results, "resumed") == pytest.approx(ref_losses[2:], abs=2e-5)
    assert results[0]["resumed_diff"] < 1e-6
    # the user's plan on a plain MLP equals the MLP trained in one process
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for x, y in _mlp_data():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    for losses, shard, tp in (r[1] for r in both):
        assert (shard, tp) == ((16, 8), 2)
        assert losses == pytest.approx(expected, abs=1e-6)
