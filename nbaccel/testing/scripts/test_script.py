"""nbaccel's end-to-end check of a distributed setup (what ``nbaccel test`` launches).

On every rank: the world is consistent, work splits between processes without loss, seeded
randomness agrees, prepared loaders shard a dataset and ``gather_for_metrics`` gives it back
exactly once, the trigger reaches every rank, and data-parallel training gives the same model
as training on one process with the global batch. Any wrong result raises, naming the rank.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from nbaccel.distributed.collectives import gather, gather_object
from nbaccel.distributed.random import set_seed
from nbaccel.distributed.state import AcceleratorState, GradientState, PartialState
from nbaccel.testing.regression import RegressionDataset, RegressionModel
from nbaccel.training.accelerator.core import Accelerator

__all__ = ["main"]


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"[rank {PartialState().process_index}] {what}")


def check_world(state: PartialState) -> None:
    """Every rank knows the same world and its own place in it."""
    ranks = gather_object([(state.process_index, state.num_processes)])
    world = state.num_processes
    _expect(ranks == [(r, world) for r in range(world)], f"ranks reported {ranks}")
    _expect(state.is_main_process == (state.process_index == 0), "is_main_process")


def check_split(state: PartialState) -> None:
    """Splitting a list gives each rank a contiguous share and loses nothing; padding evens it."""
    items = list(range(2 * state.num_processes + 1))
    with state.split_between_processes(items) as mine:
        shares = gather_object([mine])
    _expect(sum(shares, []) == items, f"split lost or repeated items: {shares}")
    with state.split_between_processes(items, apply_padding=True) as mine:
        sizes = gather_object([len(mine)])
    _expect(len(set(sizes)) == 1, f"padded shares differ in size: {sizes}")


def check_seeded_randomness(state: PartialState) -> None:
    """``set_seed`` gives every rank the same stream (and the same as a second seeding)."""
    set_seed(1234)
    first = torch.rand(4)
    set_seed(1234)
    _expect(torch.equal(first, torch.rand(4)), "set_seed does not repeat the stream")
    per_rank = gather(first.to(state.device)[None]).cpu()
    _expect(all(torch.equal(per_rank[0], row) for row in per_rank), "ranks' streams differ")


def _accelerator(**kwargs: object) -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    return Accelerator(**kwargs)


def check_loader_and_metrics(length: int) -> None:
    """A prepared loader shards ``range(length)``; gathering every batch gives it back once."""
    accelerator = _accelerator()
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(length)), batch_size=3))
    seen = [accelerator.gather_for_metrics(batch) for (batch,) in loader]
    values = torch.cat(seen).cpu().tolist() if seen else []
    _expect(sorted(values) == list(range(length)), f"gather_for_metrics gave {values}")


def check_trigger() -> None:
    """A flag set on the last rank is seen by every rank, once."""
    accelerator = _accelerator()
    if accelerator.process_index == accelerator.num_processes - 1:
        accelerator.set_trigger()
    _expect(accelerator.check_trigger(), "trigger not seen")
    _expect(not accelerator.check_trigger(), "trigger not reset")


def _train(model: torch.nn.Module, batches: list[dict], accelerator: Accelerator | None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
    for batch in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        if accelerator is not None:
            accelerator.backward(loss)
        else:
            loss.backward()
        optimizer.step()


def check_training_matches_one_process(batch_size: int = 4, epochs: int = 2) -> None:
    """Data-parallel SGD on the ranks' shards equals SGD on the whole batch on one process."""
    accelerator = _accelerator()
    world = accelerator.num_processes
    dataset = RegressionDataset(length=8 * world * batch_size, seed=7)
    reference = RegressionModel()
    global_loader = DataLoader(dataset, batch_size=batch_size * world)
    _train(reference, [b for _ in range(epochs) for b in global_loader], None)

    shard_loader = accelerator.prepare(DataLoader(dataset, batch_size=batch_size))
    distributed = RegressionModel()
    _train(distributed, [b for _ in range(epochs) for b in shard_loader], accelerator)
    got = accelerator.unwrap_model(distributed)
    for name in ("a", "b"):
        mine, theirs = getattr(got, name).item(), getattr(reference, name).item()
        _expect(abs(mine - theirs) < 1e-4, f"trained {name}={mine:.6f}, one process {theirs:.6f}")


def main() -> None:
    """Run every check on this rank; raise on the first wrong result."""
    state = PartialState()
    state.print(f"Checking {state.num_processes} process(es) on {state.device}.")
    for check in (check_world, check_split, check_seeded_randomness):
        check(state)
        state.print(f"{check.__name__}: ok")
    for length in (24, 25):  # an even split, and one that wraps around
        check_loader_and_metrics(length)
    state.print("check_loader_and_metrics: ok")
    check_trigger()
    state.print("check_trigger: ok")
    check_training_matches_one_process()
    state.print("check_training_matches_one_process: ok")
    state.wait_for_everyone()
    state.print("All checks passed.")


if __name__ == "__main__":
    main()
