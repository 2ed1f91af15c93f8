"""What a checkpoint tensor becomes on its device: the mapped bytes themselves, or the one copy
that has to be made (a cast onto the CPU, run on a few threads; a copy to a GPU, streamed through
pinned staging buffers by :class:`HostToDevice`). Copied tensors' mapped pages are released."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from nbaccel.bigmodel.loading.host_to_device import HostToDevice
from nbaccel.bigmodel.placement import to_torch_device
from nbaccel.storage.safetensors_file import SafetensorsFile

__all__ = ["TensorCopies", "load_threads"]


def load_threads() -> int:
    """Tensors cast or quantized at once while loading: one per core, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, cores or 1))


class TensorCopies:
    """The copies of one load: casts in flight on their threads, streams to each GPU."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, HostToDevice] = {}
        self.casts: ThreadPoolExecutor | None = None
        self.pending: deque[Future] = deque()

    def value(self, key: str, handle: Any, device: int | str, target: torch.dtype):
        """The tensor ``key`` on ``device`` as ``target``: the mapped bytes themselves when they
        can be used as stored (CPU, same dtype), else a cast or a streamed copy. ``handle`` is a
        :class:`SafetensorsFile` or a memory-mapped torch file (name -> tensor)."""
        mapped = isinstance(handle, SafetensorsFile)
        src = handle.view(key) if mapped else handle[key]
        value = self.place(src, device, target)
        if mapped and value is not src:
            handle.advise(key, populate=False)  # copied: its mapped pages leave this process
        return value

    def place(self, src: torch.Tensor, device: int | str | torch.device, target: torch.dtype):
        """``src`` (a host tensor, e.g. a view of a mapped file) on ``device`` as ``target``:
        ``src`` itself on the CPU in its own dtype, a cast onto the CPU, or a copy streamed to
        an accelerator through its :class:`HostToDevice` (one per device, kept for the load)."""
        torch_device = to_torch_device(device)
        if torch_device.type == "cpu":
            return src if src.dtype == target else src.to(target)
        return self.stream(torch_device).copy(src, target)

    def stream(self, device: torch.device) -> HostToDevice:
        """This load's pinned stream to ``device`` (made on first use)."""
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = HostToDevice(device)
        return stream

    def cast_later(
        self, path: str, key: str, handle: Any, target: torch.dtype, put: Callable[[Any], None]
    ) -> None:
        """A cast onto the CPU, run on :func:`load_threads` threads (a cast is memory-bound and
        torch runs one on few cores); a few in flight per thread."""
        if self.casts is None:
            self.casts = ThreadPoolExecutor(load_threads(), thread_name_prefix="nbaccel-cast")

        def cast() -> None:
            try:
                put(self.value(key, handle, "cpu", target))
            except Exception as err:
                raise RuntimeError(f"Loading {key!r} from {path} failed ({err}).") from err

        self.pending.append(self.casts.submit(cast))
        while len(self.pending) > 2 * load_threads():
            self.pending.popleft().result()

    def drain(self) -> None:
        """Wait for the casts in flight (the first failure is raised)."""
        while self.pending:
            self.pending.popleft().result()

    def finish(self) -> None:
        """Wait for the casts and the streamed copies (the model may be used once this
        returns)."""
        try:
            self.drain()
        finally:
            for future in self.pending:
                future.cancel()
            if self.casts is not None:
                self.casts.shutdown(wait=True)
                self.casts = None
            for stream in self.streams.values():
                stream.finish()
            self.streams.clear()
