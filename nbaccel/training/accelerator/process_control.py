"""The Accelerator's process control: collectives, process decorators, early-stop triggers,
trackers and profiling. Each :class:`~nbaccel.Accelerator` holds one; its methods are the
Accelerator's (``accelerator.gather`` is ``accelerator._control.gather``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from nbaccel.data import skip_first_batches as _skip_first_batches
from nbaccel.distributed import collectives as ops
from nbaccel.distributed.state import AcceleratorState, GradientState
from nbaccel.training.config.kwargs_handlers import ProfileKwargs
from nbaccel.training.constants import PROFILE_PATTERN_NAME
from nbaccel.training.tracking.tracker_set import TrackerSet
from nbaccel.values.booleans import env_flag

__all__ = ["ProcessControl"]


class ProcessControl:
    """What needs only the process state, the gradient state, the trackers and the profiler
    settings; it owns the early-stop flag."""

    def __init__(
        self,
        state: AcceleratorState,
        gradient_state: GradientState,
        trackers: TrackerSet,
        profile_handler: ProfileKwargs | None,
    ) -> None:
        self.state = state
        self.gradient_state = gradient_state
        self.trackers = trackers
        self.profile_handler = profile_handler
        self.flag_tensor: torch.Tensor | None = None

    def gather(self, tensor: Any) -> Any:
        """Gather (nested) tensors from all processes, concatenated on the first dimension."""
        return ops.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``gather``, minus the samples repeated to even out the last batch."""
        has_tensors = bool(ops._leaves(input_data))
        if use_gather_object or not has_tensors:
            data = ops.gather_object(input_data)
        else:
            data = ops.gather(input_data)
        state = self.gradient_state
        remainder = state.remainder
        if not state.end_of_dataloader or remainder <= 0:
            return data
        if isinstance(data, list):
            return data[:remainder]
        return ops.recursively_apply(lambda t: t[:remainder], data)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """All-reduce (nested) tensors: ``sum``, ``mean`` or ``none``."""
        return ops.reduce(tensor, reduction=reduction, scale=scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Pad (nested) tensors on ``dim`` to the largest size on any process."""
        return ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per node."""
        self.state.print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """Barrier across all processes."""
        self.state.wait_for_everyone()

    def main_process_first(self) -> Any:
        """A context in which the main process runs first, then the others."""
        return self.state.main_process_first()

    def local_main_process_first(self) -> Any:
        """A context in which each node's main process runs first, then the node's others."""
        return self.state.local_main_process_first()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Any:
        """A context that gives each process its share of ``inputs``."""
        return self.state.split_between_processes(inputs, apply_padding=apply_padding)

    def on_main_process(self, function: Callable) -> Callable:
        """Decorate ``function`` to run on the main process only."""
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable) -> Callable:
        """Decorate ``function`` to run on each node's main process only."""
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        """Decorate ``function`` to run on the last process only."""
        return self.state.on_last_process(function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None):
        """Decorate ``function`` to run on process ``process_index`` only."""
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index=None):
        """Decorate ``function`` to run on local process ``local_process_index`` only."""
        return self.state.on_local_process(function, local_process_index=local_process_index)

    def set_trigger(self) -> None:
        """Raise this process's flag; ``check_trigger`` on every process will see it."""
        self.flag_tensor = torch.tensor(1, device=self.state.device)

    def check_trigger(self) -> bool:
        """True on every process when any process called ``set_trigger`` (then reset)."""
        if self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self.state.device)
        if int(ops.reduce(self.flag_tensor, "sum").item()) >= 1:
            self.flag_tensor = torch.tensor(0, device=self.state.device)
            return True
        return False

    def skip_first_batches(self, dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
        """A loader that starts ``num_batches`` into the current epoch (for resumption)."""
        return _skip_first_batches(dataloader, num_batches)

    # -- trackers, profiling ------------------------------------------------------------------
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs=None):
        """Start the trackers of ``log_with`` (main process) and record ``config``."""
        self.trackers.init(project_name, config, init_kwargs)

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs=None) -> None:
        """Log ``values`` to every tracker (main process)."""
        self.trackers.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """A started tracker by name (a do-nothing tracker on other processes)."""
        return self.trackers.get(name, unwrap)

    def end_training(self) -> None:
        """Finish the trackers, wait for every process and destroy the process group (as
        Accelerate does: call it last; a ``%%distributed`` pool's group is kept for the next
        cells)."""
        self.trackers.finish()
        self.wait_for_everyone()
        if not env_flag("NBACCEL_PERSISTENT_GROUP"):  # a %%distributed pool keeps it
            self.state.destroy_process_group()

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
        """Profile the block with ``torch.profiler`` (Chrome trace per rank if asked)."""
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as prof:
            yield prof
        if handler.output_trace_dir:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            name = PROFILE_PATTERN_NAME.format(suffix=self.state.process_index)
            prof.export_chrome_trace(os.path.join(handler.output_trace_dir, name))
            self.wait_for_everyone()
