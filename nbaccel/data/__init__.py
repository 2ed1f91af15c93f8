"""Data sharding across processes: samplers, iterable shards, prepared loaders, resumption."""

from nbaccel.data.iterable import IterableDatasetShard
from nbaccel.data.loaders import DataLoaderDispatcher, DataLoaderShard
from nbaccel.data.prepare import prepare_data_loader, skip_first_batches
from nbaccel.data.samplers import BatchSamplerShard, SeedableRandomSampler, SkipBatchSampler

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "prepare_data_loader",
    "skip_first_batches",
]
