"""Loader building blocks Accelerate exposes: the end-of-epoch bookkeeping mixin, a plain
loader that skips its first batches, and ``get_sampler``.

``DataLoaderStateMixin`` keeps ``end_of_dataloader`` and ``remainder`` (samples in the last,
partial global batch) and registers the loader with ``GradientState`` while it is iterated, so
gradient accumulation syncs at the end of the epoch. nbaccel's prepared loaders
(``DataLoaderShard``/``DataLoaderDispatcher``) do the same bookkeeping themselves.
"""

from __future__ import annotations

from abc import ABCMeta
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader

from nbaccel.data.loaders import DataLoaderDispatcher, DataLoaderShard
from nbaccel.data.stateful import stateful_base_class, stateful_variant
from nbaccel.distributed.state import GradientState

__all__ = ["DataLoaderAdapter", "DataLoaderStateMixin", "SkipDataLoader", "get_sampler"]


class DataLoaderStateMixin(metaclass=ABCMeta):  # noqa: B024 - an ABC for register() only
    """Adds ``end_of_dataloader``/``remainder`` and ``begin``/``end``/``reset``; subclasses
    create ``self.gradient_state = GradientState()``. nbaccel's prepared loaders keep the same
    state themselves and count as instances (registered below)."""

    end_of_dataloader = False
    remainder = -1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.end_of_dataloader = False
        cls.remainder = -1

    def reset(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> None:
        """Start of an epoch: reset, compute the remainder, register with GradientState."""
        self.reset()
        total = getattr(self, "total_batch_size", None) or getattr(self, "batch_size", None)
        if not getattr(self, "drop_last", False) and total:
            try:
                length = getattr(self.dataset, "total_dataset_length", len(self.dataset))
                self.remainder = length % total
            except TypeError:  # an iterable dataset without a length
                pass
        self.gradient_state._add_dataloader(self)

    def end(self) -> None:
        """End of an epoch: unregister from GradientState."""
        self.gradient_state._remove_dataloader(self)


DataLoaderStateMixin.register(DataLoaderShard)
DataLoaderStateMixin.register(DataLoaderDispatcher)


class DataLoaderAdapter(DataLoader):
    """A ``DataLoader`` (or torchdata ``StatefulDataLoader`` with ``use_stateful_dataloader``)
    with ``state_dict``/``load_state_dict`` for resuming mid-epoch."""

    def __init__(
        self,
        dataset: Any,
        use_stateful_dataloader: bool = False,
        batch_sampler: Any = None,
        **kwargs: Any,
    ):
        self.use_stateful_dataloader = use_stateful_dataloader
        inner = None
        if use_stateful_dataloader:
            inner = stateful_base_class()(dataset, batch_sampler=batch_sampler, **kwargs)
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self.base_dataloader = self if inner is None else inner
        if inner is not None:  # is a StatefulDataLoader for isinstance (see nbaccel.data.stateful)
            self.__class__ = stateful_variant(type(self))

    def _base_iter(self) -> Iterator[Any]:
        if self.base_dataloader is self:
            return DataLoader.__iter__(self)
        return iter(self.base_dataloader)

    def state_dict(self) -> dict[str, Any]:
        if self.base_dataloader is self:
            raise NotImplementedError("state_dict needs use_stateful_dataloader=True (torchdata).")
        return self.base_dataloader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.base_dataloader is self:
            raise NotImplementedError(
                "load_state_dict needs use_stateful_dataloader=True (torchdata)."
            )
        self.base_dataloader.load_state_dict(state_dict)


class SkipDataLoader(DataLoaderAdapter, DataLoaderStateMixin):
    """A ``DataLoader`` whose iteration skips the first ``skip_batches`` batches (every epoch)."""

    def __init__(
        self,
        dataset: Any,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        **kwargs: Any,
    ):
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, not {skip_batches}.")
        super().__init__(dataset, use_stateful_dataloader=use_stateful_dataloader, **kwargs)
        self.skip_batches = skip_batches
        self.gradient_state = GradientState()

    def __iter__(self) -> Iterator[Any]:
        self.begin()
        try:
            for index, batch in enumerate(self._base_iter()):
                if index >= self.skip_batches:
                    yield batch
        finally:
            self.end()

    def __len__(self) -> int:
        return max(0, DataLoader.__len__(self) - self.skip_batches)


def get_sampler(dataloader: DataLoader) -> Any:
    """The index sampler under ``dataloader`` (inside its batch sampler when it has one)."""
    if isinstance(dataloader.sampler, BatchSampler):
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)
