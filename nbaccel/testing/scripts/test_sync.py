"""Gradient synchronisation checked on every rank: ``no_sync`` keeps gradients local,
a normal backward averages them, ``accumulate`` syncs on the last micro-step of each group and
on the last batch of the loader. Run with ``nbaccel launch`` or ``debug_launcher(main)``."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from nbaccel.distributed.collectives import gather
from nbaccel.distributed.state import AcceleratorState, GradientState
from nbaccel.testing.regression import RegressionModel
from nbaccel.training.accelerator.core import Accelerator

__all__ = ["main"]


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"[rank {AcceleratorState().process_index}] {what}")


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.stack([p.grad.detach().clone().reshape(()) for p in model.parameters()])


def _all_equal(per_rank: torch.Tensor) -> bool:
    return all(torch.allclose(per_rank[0], row) for row in per_rank)


def _fresh(**kwargs: object) -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    return Accelerator(cpu=True, **kwargs)


def check_no_sync_then_sync() -> None:
    """Local gradients differ by rank under ``no_sync``; a synced backward gives their mean."""
    accelerator = _fresh()
    model = accelerator.prepare(RegressionModel(a=1.0, b=1.0))
    rank, world = accelerator.process_index, accelerator.num_processes
    x = torch.tensor([float(rank + 1)])
    with accelerator.no_sync(model):
        accelerator.backward(model(x).sum())
    local = gather(_grads(model)[None])
    if world > 1:
        _expect(not _all_equal(local), f"no_sync gradients were synced: {local.tolist()}")
    model.zero_grad(set_to_none=True)
    accelerator.backward(model(x).sum())
    synced = gather(_grads(model)[None])
    _expect(_all_equal(synced), f"synced gradients differ: {synced.tolist()}")
    _expect(torch.allclose(synced[0], local.mean(0)), "synced gradient is not the mean")


def check_accumulate(batches_per_rank: int, expected: list[bool]) -> None:
    """``sync_gradients`` per micro-step with 2 accumulation steps, the loader's end included;
    the gradients are equal on every rank exactly when they were synced."""
    accelerator = _fresh(gradient_accumulation_steps=2)
    world = accelerator.num_processes
    data = TensorDataset(torch.arange(1.0, world * batches_per_rank + 1))
    model, loader = accelerator.prepare(RegressionModel(a=1.0), DataLoader(data, batch_size=1))
    seen = []
    for (x,) in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).sum())
            seen.append(accelerator.sync_gradients)
            per_rank = gather(_grads(model)[None])
            if world > 1:
                _expect(_all_equal(per_rank) == seen[-1], f"step {len(seen)}: sync mismatch")
            if accelerator.sync_gradients:
                model.zero_grad(set_to_none=True)
    _expect(seen == expected, f"sync_gradients per step {seen}, expected {expected}")


def main() -> None:
    """Run every check on this rank; raise on the first wrong result."""
    check_no_sync_then_sync()
    check_accumulate(4, [False, True, False, True])
    check_accumulate(3, [False, True, True])
    state = AcceleratorState()
    state.print("gradient synchronisation: all checks passed")


if __name__ == "__main__":
    main()
