"""Host-to-device copies of checkpoint tensors through pinned staging buffers.

A tensor of a mapped safetensors file is copied once into a page-locked (pinned) staging buffer,
cast there when its dtype changes, and sent from it to the device by DMA on a side stream while
the next tensor is read into the other buffer: reading the file and the transfer overlap, and no
host copy of a whole shard or tensor is ever made (a tensor larger than a buffer goes in
pieces). On a device without streams (the CPU), the same steps run one after the other through
ordinary buffers: the dry run of the path, which the tests exercise where no GPU is.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["HostToDevice"]

logger = logging.getLogger(__name__)


class HostToDevice:
    """Streams host tensors to ``device`` through ``buffers`` staging buffers of ``buffer_bytes``.

    Call :meth:`copy` per tensor, then :meth:`finish` before the copies are used (it makes the
    device's current stream wait for the transfers) and to release the buffers; :meth:`ready`
    lets work on the current stream use the copies so far while streaming goes on.
    ``tensors`` and ``bytes`` count what went through the staging buffers (``pinned`` says
    whether they are page-locked); :meth:`finish` logs them at debug level.
    """

    def __init__(
        self, device: torch.device | str, buffer_bytes: int = 32 << 20, buffers: int = 2
    ) -> None:
        self.device = torch.device(device)
        self.accelerated = self.device.type == "cuda"
        self.buffer_bytes = buffer_bytes
        self._buffers = [
            torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=self.accelerated)
            for _ in range(buffers)
        ]
        self._done: list[torch.cuda.Event | None] = [None] * buffers
        self._turn = 0
        self._stream = torch.cuda.Stream(self.device) if self.accelerated else None
        self.pinned = self.accelerated
        self.tensors = 0
        self.bytes = 0

    def copy(self, src: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``src`` (on the host, e.g. a view of a mapped file) on the device, as ``dtype``."""
        dtype = dtype or src.dtype
        dst = torch.empty(src.shape, dtype=dtype, device=self.device)
        if self.accelerated:
            dst.record_stream(self._stream)  # written there: not reused before that is done
        flat_src, flat_dst = src.reshape(-1), dst.view(-1)
        per = max(1, self.buffer_bytes // max(dtype.itemsize, src.dtype.itemsize))
        for start in range(0, flat_src.numel(), per):
            stop = min(start + per, flat_src.numel())
            staged = self._take()[: (stop - start) * dtype.itemsize].view(dtype)
            staged.copy_(flat_src[start:stop])  # the read of the file (and the cast) happens here
            self._send(flat_dst[start:stop], staged)
        self.tensors += 1
        self.bytes += dst.numel() * dtype.itemsize
        return dst

    def _take(self) -> torch.Tensor:
        """The next staging buffer, once its previous transfer is done."""
        i = self._turn
        self._turn = (i + 1) % len(self._buffers)
        event = self._done[i]
        if event is not None:
            event.synchronize()
        self._current = i
        return self._buffers[i]

    def _send(self, dst: torch.Tensor, staged: torch.Tensor) -> None:
        if not self.accelerated:
            dst.copy_(staged)
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(staged, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._done[self._current] = event

    def ready(self) -> None:
        """Make the device's current stream wait for the transfers issued so far (the host does
        not wait): work queued on it next may use every tensor :meth:`copy` returned."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def finish(self) -> None:
        """Make the device's current stream wait for every transfer; release the buffers."""
        logger.debug(
            "%d tensors (%.1f MiB) staged to %s through %s buffers",
            self.tensors, self.bytes / 2**20, self.device, "pinned" if self.pinned else "host",
        )  # fmt: skip
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            self._stream.synchronize()  # the pinned buffers are freed next
        self._buffers, self._done = [], []
