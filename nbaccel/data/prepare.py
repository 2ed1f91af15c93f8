"""Turn a user's ``DataLoader`` into a prepared one, and resume one mid-epoch.

``prepare_data_loader`` rebuilds the loader (torch does not let a batch sampler be swapped) with
the same options, a sharded batch sampler (or an ``IterableDatasetShard``, or a dispatcher), a
shuffling generator every rank can synchronise, and the device placement options; on an XLA
device the result is wrapped in torch-xla's background loader (:mod:`nbaccel.data.xla_loader`).
``skip_first_batches`` gives a loader that starts ``num_batches`` into the current epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from nbaccel.data.iterable import IterableDatasetShard
from nbaccel.data.loaders import DataLoaderDispatcher, DataLoaderShard
from nbaccel.data.samplers import BatchSamplerShard, SeedableRandomSampler, SkipBatchSampler
from nbaccel.data.xla_loader import wrap_for_device
from nbaccel.distributed.collectives import broadcast_object_list
from nbaccel.distributed.state import PartialState

__all__ = ["prepare_data_loader", "skip_first_batches"]

_LOADER_OPTIONS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def _loader_options(loader: DataLoader) -> dict[str, Any]:
    options = {k: getattr(loader, k) for k in _LOADER_OPTIONS if hasattr(loader, k)}
    if not options.get("num_workers"):
        options.pop("prefetch_factor", None)
        options.pop("persistent_workers", None)
    return options


def _shared_seed(seed: int | None = None) -> int:
    """``seed`` (default: one drawn) as rank 0 has it, given to every rank."""
    # the draw Accelerate makes for a sampler's generator: the same seeds shuffle alike
    box = [int(torch.empty((), dtype=torch.int64).random_().item()) if seed is None else int(seed)]
    if PartialState().num_processes > 1:
        broadcast_object_list(box, from_process=0)
    return box[0]


def _reshuffler(sampler: Any, use_seedable: bool, data_seed: int | None) -> tuple[Any, Any]:
    """A copy of a ``RandomSampler`` whose generator every rank can synchronise."""
    if not isinstance(sampler, RandomSampler):
        return sampler, None
    options = {"replacement": sampler.replacement, "num_samples": sampler._num_samples}
    if use_seedable:
        if data_seed is None:  # the seed set_seed() gave rank 0, so every rank agrees
            data_seed = _shared_seed(torch.random.initial_seed())
        generator = sampler.generator if sampler.generator is not None else torch.Generator()
        seedable = SeedableRandomSampler(
            sampler.data_source, data_seed=data_seed, generator=generator, **options
        )
        return seedable, None
    if isinstance(sampler, SeedableRandomSampler):
        # already reseeded from its seed + epoch at each iteration: kept as it is, so a prepared
        # loader draws the orders a plain loop over the user's loader draws
        if sampler.generator is None:
            sampler.generator = torch.Generator()
        return sampler, sampler.generator
    generator = sampler.generator
    if generator is None:
        generator = torch.Generator()
        generator.manual_seed(_shared_seed())
    return RandomSampler(sampler.data_source, generator=generator, **options), generator


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list[str] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Any = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
) -> DataLoader:
    """Return ``dataloader`` prepared for this process (see the module docstring)."""
    state = PartialState()
    n = state.num_processes if num_processes is None else num_processes
    i = state.process_index if process_index is None else process_index
    device = (device or state.device) if put_on_device else None
    dataset = dataloader.dataset
    iterable = isinstance(dataset, IterableDataset)
    if dataloader.batch_size is None and dataloader.batch_sampler is None:
        return _prepare_unbatched(dataloader, device, n, i, even_batches, non_blocking, state)
    if dispatch_batches is None:
        dispatch_batches = iterable and n > 1
    options = _loader_options(dataloader)
    rng_types = [str(getattr(r, "value", r)) for r in (rng_types or [])]
    if dispatch_batches:
        loader = _dispatcher(
            dataloader,
            n,
            split_batches,
            options,
            device=device,
            even_batches=even_batches,
            non_blocking=non_blocking,
            slice_fn=slice_fn_for_dispatch,
            use_stateful_dataloader=use_stateful_dataloader,
        )
        return wrap_for_device(loader, state.device)

    if iterable:
        shard = _iterable_source(dataloader, n, i, split_batches)
    else:
        shard = _map_style_source(
            dataloader, n, i, split_batches, even_batches, use_seedable_sampler, data_seed
        )
    if n <= 1:
        rng_types = []
    elif shard.generator is None:
        rng_types = [r for r in rng_types if r != "generator"]
    loader = DataLoaderShard(
        shard.dataset,
        device=device,
        rng_types=rng_types,
        synchronized_generator=shard.generator,
        non_blocking=non_blocking,
        remainder=shard.remainder,
        total_batch_size=shard.total_batch_size,
        use_stateful_dataloader=use_stateful_dataloader,
        **shard.source,
        **options,
    )
    return wrap_for_device(loader, state.device)


def _dispatcher(
    dataloader: DataLoader,
    n: int,
    split_batches: bool,
    options: dict[str, Any],
    **dispatch: Any,
) -> DataLoaderDispatcher:
    """Rank 0 reads whole global batches and sends each rank its slice (``dispatch``: the
    ``DataLoaderDispatcher`` options: device, even_batches, non_blocking, slice_fn, ...)."""
    batch_size, drop_last = dataloader.batch_size, dataloader.drop_last
    global_batch = batch_size if split_batches else (batch_size or 1) * n
    if split_batches and batch_size is not None and batch_size % n:
        raise ValueError(
            f"split_batches=True needs a batch size that divides by {n}, not {batch_size}."
        )
    if isinstance(dataloader.dataset, IterableDataset):
        source: dict[str, Any] = {"batch_size": global_batch, "drop_last": drop_last}
    else:
        sampler = dataloader.batch_sampler.sampler
        source = {"batch_sampler": BatchSampler(sampler, global_batch, drop_last)}
    loader = DataLoaderDispatcher(
        dataloader.dataset, split_batches=split_batches, **dispatch, **source, **options
    )
    loader.total_batch_size = global_batch
    return loader


@dataclass
class _Shard:
    """What a rank's ``DataLoaderShard`` is built from."""

    dataset: Any
    source: dict[str, Any]  # batch_size/drop_last or batch_sampler
    total_batch_size: int | None = None
    generator: torch.Generator | None = None  # the shuffling generator kept in step
    remainder: int = -1  # samples in the last, short global batch (even_batches)


def _iterable_source(dataloader: DataLoader, n: int, i: int, split_batches: bool) -> _Shard:
    """An iterable dataset: native shards when it has enough files, else every n-th batch."""
    dataset, batch_size, drop_last = dataloader.dataset, dataloader.batch_size, dataloader.drop_last
    if n > 1 and not split_batches and _natively_shardable(dataset, n):
        # A Hugging Face streaming dataset with enough shards: each rank reads its own files.
        source = {"batch_size": batch_size, "drop_last": drop_last}
        return _Shard(dataset.shard(num_shards=n, index=i), source, batch_size * n)
    shard = IterableDatasetShard(dataset, batch_size, drop_last, n, i, split_batches)
    per_process = batch_size // n if split_batches else batch_size
    source = {"batch_size": per_process, "drop_last": drop_last}
    total = batch_size if split_batches else batch_size * n
    return _Shard(shard if n > 1 else dataset, source, total)


def _map_style_source(
    dataloader: DataLoader,
    n: int,
    i: int,
    split_batches: bool,
    even_batches: bool,
    use_seedable_sampler: bool,
    data_seed: int | None,
) -> _Shard:
    """A map-style dataset: its batch sampler (re-seeded when it shuffles) split across ranks."""
    original = dataloader.batch_sampler
    if type(original) is BatchSampler:
        sampler, generator = _reshuffler(original.sampler, use_seedable_sampler, data_seed)
        batch_sampler: Any = BatchSampler(sampler, original.batch_size, original.drop_last)
    else:
        batch_sampler = original  # a custom batch sampler: sharded as it is
        generator = getattr(getattr(original, "sampler", None), "generator", None)
    if n > 1:
        batch_sampler = BatchSamplerShard(batch_sampler, n, i, split_batches, even_batches)
    shard = _Shard(dataloader.dataset, {"batch_sampler": batch_sampler}, generator=generator)
    size = getattr(batch_sampler, "batch_size", None)
    if size is not None:
        shard.total_batch_size = size if split_batches or n == 1 else size * n
    if n > 1 and even_batches and not getattr(batch_sampler, "drop_last", False):
        try:
            total = shard.total_batch_size
            shard.remainder = len(dataloader.dataset) % total if total else -1
        except TypeError:
            shard.remainder = -1
    return shard


def _natively_shardable(dataset: Any, num_processes: int) -> bool:
    """A ``datasets.IterableDataset`` with at least one shard (file) per process."""
    if not type(dataset).__module__.startswith("datasets."):
        return False
    try:
        from datasets import IterableDataset as HFIterableDataset
    except ImportError:
        return False
    return isinstance(dataset, HFIterableDataset) and dataset.n_shards >= num_processes


class _OneSample:
    """Collate for an unbatched loader read through one-sample batches: the sample itself."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, batch: list[Any]) -> Any:
        return self.collate(batch[0])


def _prepare_unbatched(
    dataloader: DataLoader,
    device: torch.device | None,
    n: int,
    i: int,
    even_batches: bool,
    non_blocking: bool,
    state: PartialState,
) -> DataLoader:
    """``DataLoader(batch_size=None)``: every item is a batch; each process reads its share of
    the items (in turn, the last round completed from the start with ``even_batches``)."""
    options = _loader_options(dataloader)
    iterable = isinstance(dataloader.dataset, IterableDataset)
    if n <= 1:
        source: dict[str, Any] = {"batch_size": None}
        if not iterable:
            source["sampler"] = dataloader.sampler
        dataset: Any = dataloader.dataset
    elif iterable:
        dataset = IterableDatasetShard(dataloader.dataset, 1, not even_batches, n, i)
        source = {"batch_size": None}
    else:
        single = BatchSampler(dataloader.sampler, 1, False)
        source = {"batch_sampler": BatchSamplerShard(single, n, i, False, even_batches)}
        options["collate_fn"] = _OneSample(dataloader.collate_fn)
        dataset = dataloader.dataset
    loader = DataLoaderShard(dataset, device=device, non_blocking=non_blocking, **source, **options)
    return wrap_for_device(loader, state.device)


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A loader that starts ``num_batches`` into the current epoch of ``dataloader``.

    Use it for the first epoch after resuming; iterate ``dataloader`` itself afterwards (the
    skipping copy moves the original's epoch counter on when it finishes).
    """
    if num_batches < 0:
        raise ValueError(f"num_batches must be >= 0, not {num_batches}.")
    prepared = isinstance(dataloader, DataLoaderShard | DataLoaderDispatcher)
    options = _loader_options(dataloader)
    map_style = not isinstance(dataloader.dataset, IterableDataset)
    skip = 0
    if map_style and not isinstance(dataloader, DataLoaderDispatcher):
        source: dict[str, Any] = {
            "batch_sampler": SkipBatchSampler(dataloader.batch_sampler, num_batches)
        }
    else:
        skip = num_batches
        if isinstance(dataloader, DataLoaderDispatcher) and map_style:
            source = {"batch_sampler": dataloader.batch_sampler}
        else:
            source = {"batch_size": dataloader.batch_size, "drop_last": dataloader.drop_last}
    if isinstance(dataloader, DataLoaderDispatcher):
        new: Any = DataLoaderDispatcher(
            dataloader.dataset,
            device=dataloader.device,
            split_batches=dataloader.split_batches,
            even_batches=dataloader.even_batches,
            skip_batches=skip,
            non_blocking=dataloader.non_blocking,
            slice_fn=dataloader.slice_fn,
            **source,
            **options,
        )
    elif prepared:
        new = DataLoaderShard(
            dataloader.dataset,
            device=dataloader.device,
            rng_types=dataloader.rng_types,
            synchronized_generator=dataloader.synchronized_generator,
            skip_batches=skip,
            non_blocking=dataloader.non_blocking,
            remainder=dataloader.remainder,
            total_batch_size=dataloader.total_batch_size,
            **source,
            **options,
        )
    else:
        new = DataLoaderShard(dataloader.dataset, skip_batches=skip, **source, **options)
    if prepared:
        new.iteration = dataloader.iteration
        new.total_batch_size = dataloader.total_batch_size
        new._parent = dataloader
        new._mid_epoch_start = num_batches > 0
    return new
