"""DataLoaders whose batches are ``num_micro_batches`` micro-batches (a Megatron run's step).

As in Accelerate's Megatron-LM integration, a loader's ``batch_size`` is the micro-batch; the
run's loaders are rebuilt to yield ``micro x num_micro_batches`` samples per batch, each batch
one training step through the pipeline.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["with_batch_size"]

logger = logging.getLogger(__name__)


def with_batch_size(loader: Any, batch_size: int) -> Any:
    """``loader`` rebuilt to yield full batches of ``batch_size`` (same dataset, sampler,
    collate): the pipeline's stages exchange activations of one shape, so a last batch too
    small for ``num_micro_batches`` full micro-batches is dropped, as Megatron-LM's samplers do
    (with a warning)."""
    from torch.utils.data import BatchSampler, DataLoader

    if loader.batch_size is None:
        raise ValueError(
            "MegatronLMPlugin needs DataLoaders built with batch_size (not a batch_sampler): "
            "it groups num_micro_batches micro-batches per training step."
        )
    left = len(loader.dataset) % batch_size if hasattr(loader.dataset, "__len__") else 0
    if left:
        logger.warning(
            "MegatronLMPlugin: %d samples of %d do not fill a last batch of %d (micro-batch x "
            "num_micro_batches); they are left out, as Megatron-LM's samplers do.",
            left,
            len(loader.dataset),
            batch_size,
        )
    elif loader.batch_size == batch_size:
        return loader
    sampler = BatchSampler(loader.sampler, batch_size, drop_last=True)
    return DataLoader(
        loader.dataset,
        batch_sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
