"""Sharding of iterable datasets: every process reads the stream and keeps its slice of each batch.

Each process iterates the whole dataset, groups it in global batches (``batch_size`` times the
number of processes, or ``batch_size`` with ``split_batches``) and keeps slice ``process_index``.
The last short global batch is completed with the first samples of the stream unless
``drop_last``; ``last_batch_real_samples`` then tells how many of its samples were real.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

__all__ = ["IterableDatasetShard"]


class IterableDatasetShard(IterableDataset):
    """Process ``process_index``'s share of an iterable ``dataset``.

    Args:
        dataset: the iterable dataset.
        batch_size: batch size per process (global batch size with ``split_batches``).
        drop_last: drop the last incomplete global batch instead of completing it.
        num_processes: number of processes.
        process_index: this process.
        split_batches: ``batch_size`` is the global batch size.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ) -> None:
        if split_batches and batch_size > 1 and batch_size % num_processes != 0:
            raise ValueError(
                f"split_batches=True cuts each batch of {batch_size} into {num_processes} equal "
                f"slices: use a batch size that is a round multiple of {num_processes}."
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.epoch = 0
        self.last_batch_real_samples = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        """Samples this process yields (only for datasets that have a length)."""
        total = len(self.dataset)
        global_batch = (
            self.batch_size if self.split_batches else self.batch_size * self.num_processes
        )
        per_process = global_batch // self.num_processes
        if self.drop_last:
            return (total // global_batch) * per_process
        return -(-total // global_batch) * per_process

    def __iter__(self) -> Iterator[Any]:
        n, i = self.num_processes, self.process_index
        global_batch = self.batch_size if self.split_batches else self.batch_size * n
        per_process = global_batch // n
        lo, hi = i * per_process, (i + 1) * per_process
        first: list[Any] | None = None
        buffer: list[Any] = []
        self.last_batch_real_samples = -1
        for sample in self.dataset:
            buffer.append(sample)
            if len(buffer) == global_batch:
                yield from buffer[lo:hi]
                if first is None:
                    first = buffer
                buffer = []
        if not buffer or self.drop_last:
            return
        self.last_batch_real_samples = len(buffer)
        pool = first if first is not None else list(buffer)
        buffer = buffer + list(itertools.islice(itertools.cycle(pool), global_batch - len(buffer)))
        yield from buffer[lo:hi]
