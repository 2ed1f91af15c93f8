"""Collective operations checked on every rank: gather, gather_object, broadcast, reduce,
padding and nested structures. Run with ``nbaccel launch`` or ``debug_launcher(main)``."""

from __future__ import annotations

import torch

from nbaccel.distributed.collectives import (
    broadcast,
    broadcast_object_list,
    concatenate,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from nbaccel.distributed.state import PartialState

__all__ = ["main"]


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"[rank {PartialState().process_index}] {what}")


def check_gather(state: PartialState) -> None:
    """Each rank's two values land in rank order on every rank."""
    rank, world = state.process_index, state.num_processes
    mine = torch.tensor([2.0 * rank + 1, 2.0 * rank + 2], device=state.device)
    got = gather(mine).cpu()
    _expect(torch.equal(got, torch.arange(1.0, 2 * world + 1)), f"gather gave {got.tolist()}")
    nested = gather({"a": mine, "b": (mine * 10,)})
    _expect(torch.equal(nested["b"][0].cpu(), got * 10), "gather of a dict of tuples")


def check_gather_object(state: PartialState) -> None:
    """Python objects of every rank, in rank order, on every rank."""
    got = gather_object([{"rank": state.process_index}])
    _expect(got == [{"rank": r} for r in range(state.num_processes)], f"gather_object: {got}")


def check_broadcast(state: PartialState) -> None:
    """Rank 0's tensor and objects reach every rank."""
    mine = torch.full((3,), float(state.process_index), device=state.device)
    _expect(broadcast(mine).sum().item() == 0.0, "broadcast from rank 0")
    objects = [f"from {state.process_index}", state.process_index]
    broadcast_object_list(objects)
    _expect(objects == ["from 0", 0], f"broadcast_object_list gave {objects}")


def check_reduce(state: PartialState) -> None:
    """Sum and mean over the ranks."""
    world = state.num_processes
    mine = torch.tensor([float(state.process_index + 1)], device=state.device)
    total = world * (world + 1) / 2
    _expect(reduce(mine.clone(), "sum").item() == total, "reduce sum")
    _expect(abs(reduce(mine.clone(), "mean").item() - total / world) < 1e-6, "reduce mean")


def check_padding(state: PartialState) -> None:
    """Rank r holds r + 1 values; padding makes every rank hold ``world`` values."""
    rank, world = state.process_index, state.num_processes
    mine = torch.arange(1.0, rank + 2, device=state.device)
    padded = pad_across_processes(mine, dim=0, pad_index=0)
    _expect(padded.shape[0] == world, f"padded to {padded.shape[0]}, expected {world}")
    _expect(padded[: rank + 1].tolist() == mine.tolist(), "values kept first")
    _expect(padded[rank + 1 :].sum().item() == 0, "pad value at the end")
    first = pad_across_processes(mine, dim=0, pad_index=-1, pad_first=True)
    _expect(first[world - rank - 1 :].tolist() == mine.tolist(), "pad_first keeps values last")


def check_concatenate() -> None:
    """Nested lists of tensors concatenate leaf by leaf."""
    parts = [{"x": torch.ones(2)}, {"x": torch.zeros(1)}]
    _expect(concatenate(parts)["x"].tolist() == [1.0, 1.0, 0.0], "concatenate of dicts")


def main() -> None:
    """Run every check on this rank; raise on the first wrong result."""
    state = PartialState()
    for check in (check_gather, check_gather_object, check_broadcast, check_reduce,
                  check_padding):  # fmt: skip
        check(state)
        state.wait_for_everyone()
        state.print(f"{check.__name__}: ok")
    check_concatenate()
    state.print("collective operations: all checks passed")


if __name__ == "__main__":
    main()
