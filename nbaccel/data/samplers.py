"""Sharding of map-style data: which batches (or batch slices) each process reads.

``BatchSamplerShard`` turns one batch sampler into N per-process ones:

- by default each process reads whole batches in turn (process i gets batches i, i+N, ...), so the
  loader's batch size is per process;
- with ``split_batches`` every batch is cut into N equal slices, so the batch size is global;
- with ``even_batches`` (default) every process gets the same number of full batches: the last,
  short round is completed with samples from the start of the data (whole first batches when the
  batch sampler has no ``batch_size``: variable-size batches). ``gather_for_metrics`` knows
  how many to drop again (see ``DataLoaderShard.remainder``);
- over a ``drop_last`` batch sampler an incomplete last round is dropped by every process.

``SeedableRandomSampler`` shuffles from ``seed + epoch``, ``SkipBatchSampler`` skips batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler

__all__ = ["BatchSamplerShard", "SeedableRandomSampler", "SkipBatchSampler"]


def _fill_cyclic(samples: list[Any], pool: list[Any], size: int) -> list[Any]:
    """``samples`` extended with ``pool`` repeated until it holds ``size`` items."""
    if len(samples) >= size or not pool:
        return samples[:size]
    needed = size - len(samples)
    return samples + list(itertools.islice(itertools.cycle(pool), needed))


class BatchSamplerShard(BatchSampler):
    """The share of ``batch_sampler`` that process ``process_index`` of ``num_processes`` reads.

    Args:
        batch_sampler: the batch sampler to shard (any iterable of index lists).
        num_processes: number of processes.
        process_index: this process.
        split_batches: cut each batch into ``num_processes`` slices instead of dealing whole
            batches out; the batch size must divide by ``num_processes``.
        even_batches: complete the last round with samples from the start of the data, so that
            every process gets the same number of equally sized batches.
    """

    def __init__(
        self,
        batch_sampler: Any,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        if not 0 <= process_index < num_processes:
            raise ValueError(f"process_index {process_index} outside 0..{num_processes - 1}.")
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        if split_batches:
            if self.batch_size is None:
                raise ValueError(
                    "split_batches=True needs a batch sampler with a batch_size attribute."
                )
            if self.batch_size % num_processes != 0:
                raise ValueError(
                    f"split_batches=True cuts each batch of {self.batch_size} into "
                    f"{num_processes} equal slices: use a batch size that is a round multiple "
                    f"of {num_processes}."
                )

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    def set_epoch(self, epoch: int) -> None:
        for target in (self.batch_sampler, self.sampler):
            if hasattr(target, "set_epoch"):
                target.set_epoch(epoch)

    # -- length -------------------------------------------------------------------------------
    def _num_samples(self) -> int | None:
        try:
            return len(self.sampler)
        except TypeError:
            return None

    def __len__(self) -> int:
        total = len(self.batch_sampler)
        n, i = self.num_processes, self.process_index
        if self.split_batches:
            samples = self._num_samples()
            short = 0 if samples is None or self.drop_last else samples % self.batch_size
            if short == 0 or self.even_batches:
                return total
            return total - 1 + (1 if short > i * (self.batch_size // n) else 0)
        if self.drop_last:
            return total // n  # an incomplete last round is dropped by every process
        if self.even_batches:
            return -(-total // n)
        return total // n + (1 if i < total % n else 0)

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[Any]]:
        if self.split_batches:
            return self._iter_split()
        return self._iter_dealt()

    def _iter_split(self) -> Iterator[list[Any]]:
        size = self.batch_size // self.num_processes
        lo, hi = self.process_index * size, (self.process_index + 1) * size
        first: list[Any] = []
        for batch in self.batch_sampler:
            batch = list(batch)
            if not first:
                first = batch
            if len(batch) < self.batch_size:  # the short last batch
                if self.drop_last:
                    return
                if self.even_batches:
                    batch = _fill_cyclic(batch, first, self.batch_size)
                elif not batch[lo:hi]:
                    return
            yield batch[lo:hi]

    def _iter_dealt(self) -> Iterator[list[Any]]:
        n, i, size = self.num_processes, self.process_index, self.batch_size
        pool: list[Any] = []  # the first samples of the data, to complete the last round
        pool_size = 0 if size is None else size * n
        first_batches: list[list[Any]] = []  # without a batch size, whole batches complete it
        round_: list[list[Any]] = []
        for batch in self.batch_sampler:
            batch = list(batch)
            if len(pool) < pool_size:
                pool.extend(batch[: pool_size - len(pool)])
            if size is None and len(first_batches) < n:
                first_batches.append(batch)
            round_.append(batch)
            if len(round_) == n and (size is None or len(batch) == size):
                yield round_[i]
                round_ = []
        if not round_ or self.drop_last:
            return  # every process drops the incomplete round alike
        if not self.even_batches:
            if i < len(round_):
                yield round_[i]
            return
        if size is None:  # variable batch sizes: the first batches again, in turn
            extra = itertools.cycle(first_batches)
            while len(round_) < n:
                round_.append(next(extra))
            yield round_[i]
            return
        flat = _fill_cyclic([s for b in round_ for s in b], pool, size * n)
        yield flat[i * size : (i + 1) * size]


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order is a function of a seed and the epoch only.

    Each iteration reseeds the generator with ``initial_seed + epoch`` and moves to the next
    epoch when it finishes, so a plain loop over a ``DataLoader`` and a prepared loader (which
    calls ``set_epoch`` at each epoch start) draw the same orders on every process. The seed is
    ``data_seed`` (``seed`` also accepted), else ``torch.random.initial_seed()`` at creation
    (what ``set_seed`` set).
    """

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        seed = kwargs.pop("seed", None)
        super().__init__(*args, **kwargs)
        if data_seed is None:
            data_seed = seed
        self.initial_seed = int(data_seed if data_seed is not None else torch.random.initial_seed())
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


class SkipBatchSampler(Sampler):
    """``batch_sampler`` without its first ``skip_batches`` batches."""

    def __init__(self, batch_sampler: Any, skip_batches: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches

    @property
    def batch_size(self) -> int | None:
        return getattr(self.batch_sampler, "batch_size", None)

    @property
    def drop_last(self) -> bool:
        return getattr(self.batch_sampler, "drop_last", False)

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.batch_sampler), self.skip_batches, None)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip_batches, 0)
