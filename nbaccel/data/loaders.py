"""Prepared dataloaders: ``DataLoaderShard`` (each process reads its shard) and
``DataLoaderDispatcher`` (rank 0 reads, every process gets its slice).

Both are ``torch.utils.data.DataLoader`` subclasses that add, per epoch: synchronised shuffling
(rank 0's generator state), device placement of batches, ``end_of_dataloader`` (set before the
last batch is yielded, by reading one batch ahead) and ``remainder`` (how many samples of the
last global batch are real) for ``gather_for_metrics`` and gradient accumulation, and a position
(epoch, batches yielded, shuffling state) that checkpoints save and restore.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from nbaccel.data.stateful import attach_stateful_base, is_torchdata_state
from nbaccel.distributed.collectives import (
    broadcast_object_list,
    find_batch_size,
    recursively_apply,
    send_to_device,
)
from nbaccel.distributed.random import synchronize_rng_states
from nbaccel.distributed.state import GradientState, PartialState

__all__ = ["DataLoaderDispatcher", "DataLoaderShard"]

_END = object()


def _global_rng_states() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_global_rng_states(states: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state_all(states[1])


class _BaseLoader:
    """``loader.base_dataloader``: the inner torchdata loader of a stateful loader, else the
    loader itself (a prepared loader *is* a DataLoader); on the class it raises AttributeError,
    as an instance field."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            raise AttributeError("base_dataloader is set on loader instances, not on the class.")
        return obj.__dict__.get("_stateful_base", obj)


class _PreparedLoader:
    """Epoch bookkeeping shared by both prepared loader kinds."""

    base_dataloader = _BaseLoader()
    # The next iteration continues an epoch a checkpoint interrupted (a skip_first_batches copy,
    # a restored stateful position). The interrupted run drew from the process's generators when
    # that epoch began (DataLoader's worker base seed, rng_types synchronisation), before its
    # checkpoint captured them: the continuation leaves them as restored, so the resumed run
    # equals the uninterrupted one step for step.
    _mid_epoch_start = False

    device: torch.device | None
    non_blocking: bool
    synchronized_generator: torch.Generator | None

    def _setup(
        self,
        device: torch.device | None,
        non_blocking: bool,
        remainder: int,
        total_batch_size: int | None,
        skip_batches: int,
        stateful: bool,
    ) -> None:
        self.device = device if device is None or device.type != "cpu" else None
        self.non_blocking = non_blocking
        self.remainder = remainder
        self.total_batch_size = total_batch_size
        self.skip_batches = skip_batches
        self.use_stateful_dataloader = stateful
        self.gradient_state = GradientState()
        self.end_of_dataloader = False
        self.iteration = 0
        self._batches_yielded = 0
        self._resume_batches = 0
        self._in_epoch = False
        self._epoch_generator_state: torch.Tensor | None = None
        self._parent: _PreparedLoader | None = None

    def __len__(self) -> int:
        """The DataLoader's batches less those skipped at the start of each iteration."""
        return max(super().__len__() - self.skip_batches, 0)  # type: ignore[misc]

    # -- reading ------------------------------------------------------------------------------
    def _raw_batches(self) -> Iterator[Any]:
        """The batches before placement: from the inner torchdata loader when stateful."""
        inner = self.__dict__.get("_stateful_base")
        return iter(inner) if inner is not None else DataLoader.__iter__(self)  # type: ignore[arg-type]

    def _snapshot(self) -> None:
        """Record the inner torchdata state now (called right after a batch is read, before
        the read-ahead), so ``state_dict`` describes the batches really yielded."""
        inner = self.__dict__.get("_stateful_base")
        if inner is not None:
            self._stateful_snapshot = inner.state_dict()

    # -- epoch --------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (shuffling of seedable samplers and datasets that have ``set_epoch``)."""
        self.iteration = epoch
        for target in (
            getattr(self, "batch_sampler", None),
            getattr(getattr(self, "batch_sampler", None), "sampler", None),
            getattr(self, "sampler", None),
            getattr(self, "dataset", None),
        ):
            if target is not None and hasattr(target, "set_epoch"):
                target.set_epoch(epoch)

    def _begin_epoch(self) -> None:
        generator = self.synchronized_generator
        if generator is not None:
            self._epoch_generator_state = generator.get_state()
        self.set_epoch(self.iteration)
        self.end_of_dataloader = False
        self._batches_yielded = 0
        self._in_epoch = True
        if self in self.gradient_state.dataloader_references:
            self.gradient_state._remove_dataloader(self)  # left active by an early close
        self.gradient_state._add_dataloader(self)

    def _open(self, read: Any) -> Any:
        """Synchronise shuffling, begin the epoch and ``read()`` the raw batch iterator."""
        kept = _global_rng_states() if self._mid_epoch_start else None
        self._mid_epoch_start = False
        if getattr(self, "rng_types", None):
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self._begin_epoch()
        iterator = read()
        if kept is not None:
            _set_global_rng_states(kept)
        return iterator

    def _end_epoch(self, completed: bool) -> None:
        """Leave the epoch. A loader closed early right after its last batch (``next(iter(dl))``
        on a one-batch loader) stays active, so ``gather_for_metrics`` still sees the end."""
        self._in_epoch = False
        if completed or not self.end_of_dataloader:
            self.gradient_state._remove_dataloader(self)
        if completed or self.end_of_dataloader:
            self.iteration += 1
            self._batches_yielded = 0
            if self._parent is not None:  # a skip_first_batches copy finished its parent's epoch
                self._parent.iteration = max(self._parent.iteration, self.iteration)

    def _place(self, batch: Any) -> Any:
        if self.device is None:
            return batch
        return send_to_device(batch, self.device, non_blocking=self.non_blocking)

    @property
    def total_dataset_length(self) -> int:
        dataset = getattr(self, "dataset", None)
        return len(getattr(dataset, "dataset", dataset))

    # -- position, for checkpoints ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: epoch, batches yielded in it, shuffling state at its start
        (torchdata's state dict for a stateful loader, see :mod:`nbaccel.data.stateful`)."""
        if "_stateful_base" in self.__dict__:
            state = dict(self._stateful_snapshot)
            # After the epoch's last batch the epoch is over: loading starts the next one.
            state["_iterator_finished"] = bool(state.get("_iterator_finished")) or bool(
                self.end_of_dataloader
            )
            # torchdata replays the epoch's batch order only if the shuffling generator and
            # the epoch number are back as they were: record them when there are any.
            if self.synchronized_generator is not None or self.iteration:
                state["nbaccel_position"] = self._position()
            return state
        return self._position()

    def _position(self) -> dict[str, Any]:
        generator = self.synchronized_generator
        if self._in_epoch:
            gen_state = self._epoch_generator_state
        else:
            gen_state = None if generator is None else generator.get_state()
        return {
            "iteration": self.iteration,
            "batches_yielded": self._batches_yielded if self._in_epoch else 0,
            "generator_state": gen_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position: the next iteration replays the saved epoch's order.

        With ``use_stateful_dataloader`` it also starts at the saved batch; otherwise call
        ``skip_first_batches(loader, state["batches_yielded"])`` for the first epoch.
        """
        if "_stateful_base" in self.__dict__ and is_torchdata_state(state):
            state = dict(state)
            position = state.pop("nbaccel_position", None)
            if position is not None:
                self._restore_position(position)
            self._stateful_base.load_state_dict(state)
            self._stateful_snapshot = state
            self._resume_batches = 0  # torchdata resumes mid-epoch by itself
            self._mid_epoch_start = bool(position and position.get("batches_yielded"))
            return
        self._restore_position(state)

    def _restore_position(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        generator = self.synchronized_generator
        if generator is not None and state.get("generator_state") is not None:
            generator.set_state(state["generator_state"])
        self.resume_batches = int(state.get("batches_yielded", 0))
        self._resume_batches = self.resume_batches if self.use_stateful_dataloader else 0
        self._mid_epoch_start = bool(self._resume_batches)


class DataLoaderShard(_PreparedLoader, DataLoader):
    """A dataloader over this process's shard, with device placement and synchronised shuffling.

    Args:
        dataset: the dataset (an ``IterableDatasetShard`` for iterable data).
        device: where batches go (None: leave them where they are).
        rng_types: generators synchronised from rank 0 at each epoch start.
        synchronized_generator: the sampler's generator (for ``"generator"`` in ``rng_types``).
        skip_batches: batches to skip at the start of each iteration.
        non_blocking: copy batches with ``non_blocking=True``.
        remainder: real samples in the last global batch (-1: nothing to drop).
        total_batch_size: samples per step across all processes.
        use_stateful_dataloader: restored positions resume mid-epoch by themselves.
        **kwargs: ``DataLoader`` arguments.
    """

    def __init__(
        self,
        dataset: Any,
        device: torch.device | None = None,
        rng_types: list[str] | None = None,
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        non_blocking: bool = False,
        remainder: int = -1,
        total_batch_size: int | None = None,
        use_stateful_dataloader: bool = False,
        **kwargs: Any,
    ) -> None:
        DataLoader.__init__(self, dataset, **kwargs)
        self.rng_types = rng_types
        self.synchronized_generator = synchronized_generator
        self._setup(
            device, non_blocking, remainder, total_batch_size, skip_batches,
            use_stateful_dataloader,
        )  # fmt: skip
        if use_stateful_dataloader:
            attach_stateful_base(self, dataset, kwargs)

    def __iter__(self) -> Iterator[Any]:
        iterator = self._open(self._raw_batches)
        skip = self.skip_batches + self._resume_batches
        self._resume_batches = 0
        finished = False
        try:
            current = next(iterator, _END)
            index = 0
            while current is not _END:
                self._snapshot()
                upcoming = next(iterator, _END)
                if upcoming is _END:
                    self.end_of_dataloader = True
                    self._read_iterable_remainder()
                self._batches_yielded = index + 1
                if index >= skip:
                    yield self._place(current)
                current = upcoming
                index += 1
            finished = True
        finally:
            self._end_epoch(finished)

    def _read_iterable_remainder(self) -> None:
        real = getattr(self.dataset, "last_batch_real_samples", None)
        if real is not None and self.num_workers == 0:
            self.remainder = real


class DataLoaderDispatcher(_PreparedLoader, DataLoader):
    """Rank 0 reads each global batch and every process receives its slice.

    Use for data only rank 0 can read, or streams that must be read once. The wrapped loader's
    batch size is the global one. A short last batch is completed from the first batch when
    ``even_batches`` (``remainder`` then tells ``gather_for_metrics`` how many are real).
    """

    def __init__(
        self,
        dataset: Any,
        device: torch.device | None = None,
        split_batches: bool = False,
        even_batches: bool = True,
        skip_batches: int = 0,
        non_blocking: bool = False,
        slice_fn: Any = None,
        use_stateful_dataloader: bool = False,
        **kwargs: Any,
    ) -> None:
        DataLoader.__init__(self, dataset, **kwargs)
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.slice_fn = slice_fn
        self.synchronized_generator = None
        self._partial = PartialState()
        self._setup(
            device, non_blocking, -1, None, skip_batches, use_stateful_dataloader,
        )  # fmt: skip
        if use_stateful_dataloader:
            attach_stateful_base(self, dataset, kwargs)

    def _fetch(self, iterator: Iterator[Any] | None) -> Any:
        box = [next(iterator, _END) if iterator is not None else None]
        if self._partial.num_processes > 1:
            if box[0] is _END:
                box[0] = "__nbaccel_end__"
            broadcast_object_list(box, from_process=0)
            if isinstance(box[0], str) and box[0] == "__nbaccel_end__":
                box[0] = _END
        return box[0]

    def _my_slice(self, batch: Any, first: Any) -> Any:
        n, i = self._partial.num_processes, self._partial.process_index
        observed = find_batch_size(batch) or 0
        full = observed if first is None else (find_batch_size(first) or observed)
        if observed < full and self.even_batches:
            batch = _pad_batch(batch, first, full)
            self.remainder = observed
            observed = full
        per = -(-observed // n)
        lo, hi = i * per, min((i + 1) * per, observed)
        if self.slice_fn is not None:
            return self.slice_fn(batch, slice(lo, hi), process_index=i, num_processes=n)
        return recursively_apply(lambda t: t[lo:hi], batch)

    def __iter__(self) -> Iterator[Any]:
        main = self._partial.is_main_process
        iterator = self._open(self._raw_batches if main else lambda: None)
        self.remainder = -1
        skip = self.skip_batches + self._resume_batches
        self._resume_batches = 0
        finished = False
        try:
            current = self._fetch(iterator)
            first = current if current is not _END else None
            index = 0
            while current is not _END:
                self._snapshot()
                upcoming = self._fetch(iterator)
                if upcoming is _END:
                    self.end_of_dataloader = True
                self._batches_yielded = index + 1
                if index >= skip:
                    share = self._my_slice(current, first)
                    if find_batch_size(share) != 0:
                        yield self._place(share)
                current = upcoming
                index += 1
            finished = True
        finally:
            self._end_epoch(finished)


def _pad_batch(batch: Any, first: Any, size: int) -> Any:
    """Complete each tensor of ``batch`` to ``size`` rows with rows of ``first``, cyclically."""
    if isinstance(batch, Mapping):
        return type(batch)({k: _pad_batch(v, first[k], size) for k, v in batch.items()})
    if isinstance(batch, list | tuple) and not isinstance(batch, str):
        padded = [_pad_batch(b, f, size) for b, f in zip(batch, first)]
        return type(batch)(*padded) if hasattr(batch, "_fields") else type(batch)(padded)
    if isinstance(batch, torch.Tensor) and batch.ndim > 0:
        missing = size - batch.shape[0]
        rows = list(itertools.islice(itertools.cycle(range(first.shape[0])), missing))
        return torch.cat([batch, first[rows]], dim=0)
    return batch
