"""One safetensors file read in place: the header on open, tensor bytes only when asked.

Tensors are zero-copy views of a private memory map (``view``) or exact-size ``pread`` copies
(``read``), so a safetensors checkpoint is never rewritten to be offloaded or loaded. The format
of weight files, indexes and tied names is :mod:`nbaccel.storage.weights`.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading

import torch

__all__ = ["SafetensorsFile"]

_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = 22  # Linux >= 5.14: fault the pages in without touching them from Python
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFile:
    """One safetensors file, read lazily: the header on open, tensor bytes only when asked."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        base = 8 + header_len
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            if info["dtype"] not in _ST_DTYPES:
                raise ValueError(
                    f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}."
                )
            begin, end = info["data_offsets"]
            self.entries[name] = (
                _ST_DTYPES[info["dtype"]],
                tuple(info["shape"]),
                base + begin,
                base + end,
            )
        self._mm: mmap.mmap | None = None
        self._lock = threading.Lock()

    def keys(self) -> list[str]:
        return list(self.entries)

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            with self._lock:
                if self._mm is None:
                    with open(self.path, "rb") as f:
                        # Private copy-on-write mapping: writable views for torch, file untouched.
                        self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._mm

    def view(self, name: str) -> torch.Tensor:
        """Zero-copy tensor over the mapped file (pages are read when touched)."""
        dtype, shape, begin, end = self.entries[name]
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = (end - begin) // itemsize
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        if begin % itemsize:
            return self.read(name)
        return torch.frombuffer(self._map(), dtype=dtype, count=count, offset=begin).view(shape)

    def read(self, name: str) -> torch.Tensor:
        """A fresh in-memory copy, read with ``pread`` straight into the tensor (no mapping)."""
        dtype, shape, begin, end = self.entries[name]
        buf = torch.empty(end - begin, dtype=torch.uint8)
        if end > begin:
            view = memoryview(buf.numpy())
            done = 0
            with open(self.path, "rb", buffering=0) as f:
                fd = f.fileno()
                while done < end - begin:
                    n = os.preadv(fd, [view[done:]], begin + done)
                    if n <= 0:
                        raise OSError(f"{self.path}: file ends inside tensor {name!r}.")
                    done += n
        return buf.view(dtype).view(shape)

    def advise(self, name: str, populate: bool) -> None:
        """Page the tensor's bytes in (``populate``) or drop them from this process's mapping."""
        if self._mm is None:
            return
        _, _, begin, end = self.entries[name]
        start = begin - begin % _PAGE
        length = end - start
        if length <= 0:
            return
        try:
            if populate:
                try:
                    self._mm.madvise(_MADV_POPULATE_READ, start, length)
                except OSError:
                    self._mm.madvise(mmap.MADV_WILLNEED, start, length)
            else:
                self._mm.madvise(mmap.MADV_DONTNEED, start, length)
        except (OSError, ValueError):
            pass
