"""Training configuration passed to ``Accelerator``: data loading, project layout, accumulation.

Plain dataclasses with Accelerate's names and fields, so ``from nbaccel.utils import
ProjectConfiguration`` works where ``from accelerate.utils import ...`` did. They hold options
only; the modules that use them (``nbaccel.data``, ``nbaccel.training.checkpointing.state``,
``nbaccel.training.accelerator.core``) own the behaviour.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "accumulation_plugin",
    "DataLoaderConfiguration",
    "GradientAccumulationPlugin",
    "PrecisionType",
    "ProjectConfiguration",
    "RNGType",
]


class PrecisionType(str, Enum):
    """Mixed-precision modes nbaccel supports (``fp8``: torchao or Transformer Engine layers)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"


class RNGType(str, Enum):
    """Random number generators a prepared dataloader can synchronise from rank 0."""

    TORCH = "torch"
    CUDA = "cuda"
    XLA = "xla"
    GENERATOR = "generator"


@dataclass
class DataLoaderConfiguration:
    """How prepared dataloaders shard, order and place their batches.

    Args:
        split_batches: the loader's batch size is the *global* batch; each process gets a slice
            (the batch size must divide by the number of processes). Otherwise the batch size is
            per process and each process reads its own batches.
        dispatch_batches: rank 0 reads every batch and sends each process its slice. ``None``
            means: on for iterable datasets, off for map-style datasets.
        even_batches: every process gets the same number of batches of the same size, by
            repeating samples from the start of the dataset (``gather_for_metrics`` drops them).
        use_seedable_sampler: shuffle with a sampler seeded by ``data_seed`` plus the epoch, so
            the order is reproducible across runs and resumptions.
        data_seed: seed for ``use_seedable_sampler`` (default: rank 0's
            ``torch.random.initial_seed()``, the seed ``set_seed`` gave, as in Accelerate).
        non_blocking: copy batches to the device with ``non_blocking=True`` (use with
            ``pin_memory=True``).
        use_stateful_dataloader: ``load_state`` resumes a restored dataloader mid-epoch by itself,
            at the batch where ``save_state`` was called.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class ProjectConfiguration:
    """Where checkpoints and logs go, and how checkpoints are named and pruned.

    Args:
        project_dir: base directory for checkpoints (``project_dir/checkpoints``) and logs.
        logging_dir: directory for trackers' files (defaults to ``project_dir``).
        automatic_checkpoint_naming: ``save_state()`` writes ``checkpoint_<iteration>`` folders.
        total_limit: keep at most this many automatic checkpoints (oldest removed first).
        iteration: number of the next automatic checkpoint.
        save_on_each_node: write checkpoints once per node instead of once overall (nodes
            without a shared file system).
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.project_dir is not None:
            self.project_dir = os.fspath(self.project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        else:
            self.logging_dir = os.fspath(self.logging_dir)
        if self.total_limit is not None and self.total_limit < 1:
            raise ValueError(f"total_limit must be at least 1 (or None), not {self.total_limit}.")

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set ``project_dir`` (and ``logging_dir`` when it was not chosen separately)."""
        self.project_dir = None if project_dir is None else os.fspath(project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


@dataclass
class GradientAccumulationPlugin:
    """How ``Accelerator.accumulate`` accumulates gradients.

    Args:
        num_steps: batches per optimizer step.
        adjust_scheduler: count the skipped steps in the scheduler, so a schedule written in
            optimizer steps still ends where it should.
        sync_with_dataloader: always synchronise and step at the end of a dataloader, even
            mid-accumulation.
        sync_each_batch: synchronise gradients on every batch (no ``no_sync``): more
            communication, less memory (FSDP).
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        if self.num_steps is not None and (
            not isinstance(self.num_steps, int) or self.num_steps < 1
        ):
            raise ValueError(f"num_steps must be a positive int, not {self.num_steps!r}.")

    def to_kwargs(self) -> dict[str, Any]:
        """The options as the dict ``GradientState`` reads."""
        return {
            "num_steps": self.num_steps or 1,
            "adjust_scheduler": self.adjust_scheduler,
            "sync_with_dataloader": self.sync_with_dataloader,
            "sync_each_batch": self.sync_each_batch,
        }


def accumulation_plugin(
    plugin: GradientAccumulationPlugin | None, steps: int
) -> GradientAccumulationPlugin:
    """The Accelerator's accumulation settings: the plugin, or ``steps`` (or the launcher's
    ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS`` when left at 1); both at once is refused."""
    if plugin is not None:
        if steps != 1:
            raise ValueError(
                "Pass either gradient_accumulation_steps or gradient_accumulation_plugin, not "
                "both (set num_steps on the plugin)."
            )
        return plugin
    env_steps = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if steps == 1 and env_steps:
        steps = int(env_steps)
    return GradientAccumulationPlugin(num_steps=steps)
