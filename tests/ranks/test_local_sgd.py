"""LocalSGD on 2 real gloo ranks: parameters averaged every N steps (equal across ranks right
after a sync, different between syncs), gradients not all-reduced in between."""

import pytest
import torch
from torch import nn

from nbaccel.testing import run_on_ranks


def _train(local_sgd_steps, enabled, steps):
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator, LocalSGD

    accelerator = Accelerator()
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    snapshots = []  # (step, this rank's weights, rank 0's weights)
    with LocalSGD(
        accelerator=accelerator, model=model, local_sgd_steps=local_sgd_steps, enabled=enabled
    ) as local_sgd:
        for step, (xb, yb) in enumerate(loader, start=1):
            if step > steps:
                break
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            local_sgd.step()
            weights = torch.cat([p.detach().flatten() for p in model.parameters()])
            theirs = weights.clone()
            torch.distributed.broadcast(theirs, src=0)
            snapshots.append((step, weights.tolist(), theirs.tolist(), loss.item()))
    final = torch.cat([p.detach().flatten() for p in model.parameters()])
    other = final.clone()
    torch.distributed.broadcast(other, src=0)
    return rank, snapshots, torch.equal(final, other)


def test_parameters_are_averaged_every_n_steps():
    results = run_on_ranks(_train, 2, args=(3, True, 7))
    for rank, snapshots, equal_at_exit in results:
        assert equal_at_exit  # averaged once more when the block exits
        for step, mine, rank0, _ in snapshots:
            if step % 3 == 0:
                assert mine == pytest.approx(rank0, abs=1e-7), step
            elif rank == 1:
                # each rank trained on its own batches since the last sync: models differ
                assert mine != pytest.approx(rank0, abs=1e-6), step
    # the average really is the mean: training still makes progress
    losses = [loss for _, _, _, loss in results[0][1]]
    assert losses[-1] < losses[0]


def test_disabled_is_plain_ddp():
    # enabled=False: plain DDP, gradients all-reduced every step, models always equal.
    for _, snapshots, equal in run_on_ranks(_train, 2, args=(3, False, 5)):
        assert equal
        for _, mine, rank0, _ in snapshots:
            assert mine == pytest.approx(rank0, abs=1e-7)


def _bad_steps():
    from nbaccel import Accelerator, LocalSGD

    accelerator = Accelerator()
    model = accelerator.prepare(nn.Linear(2, 1))
    try:
        LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=0)
    except ValueError as err:
        return str(err)
    return None


def test_bad_step_count_is_a_clear_error():
    assert "local_sgd_steps must be an int >= 1" in run_on_ranks(_bad_steps, 2)[0]
