"""Prepared loaders over a dataset that does not divide by the world, checked on every rank:
``even_batches=True`` gives every rank the same batches (samples repeated from the start),
``even_batches=False`` lets the last ranks have fewer, and both cover every sample.
Run with ``nbaccel launch`` or ``debug_launcher(main)``."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from nbaccel.distributed.collectives import gather_object
from nbaccel.distributed.state import AcceleratorState, GradientState
from nbaccel.training.accelerator.core import Accelerator
from nbaccel.training.config.configuration import DataLoaderConfiguration

__all__ = ["main"]


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"[rank {AcceleratorState().process_index}] {what}")


def _batches(even_batches: bool, length: int) -> list[list[int]]:
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=even_batches))
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(length)), batch_size=1))
    return [batch.tolist() for (batch,) in loader]


def check_even_batches(length: int) -> None:
    """Same number of batches on every rank; every sample appears."""
    per_rank = gather_object([_batches(True, length)])
    _expect(len({len(b) for b in per_rank}) == 1, f"even_batches counts: {per_rank}")
    seen = {v for batches in per_rank for batch in batches for v in batch}
    _expect(seen == set(range(length)), "even_batches lost samples")


def check_uneven_batches(length: int) -> None:
    """No sample repeated; every sample appears exactly once."""
    per_rank = gather_object([_batches(False, length)])
    values = sorted(v for batches in per_rank for batch in batches for v in batch)
    _expect(values == list(range(length)), f"even_batches=False gave {per_rank}")


def main() -> None:
    """Run every check on this rank; raise on the first wrong result."""
    world = AcceleratorState().num_processes
    length = 3 * world + 1
    check_even_batches(length)
    check_uneven_batches(length)
    AcceleratorState().print("distributed data loop: all checks passed")


if __name__ == "__main__":
    main()
