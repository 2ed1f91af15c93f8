"""One safetensors file read in place: the header on open, tensor bytes only when asked.

Tensors are zero-copy views of a private memory map (``view``) or exact-size ``pread`` copies
(``read``), so a safetensors checkpoint is never rewritten to be offloaded or loaded. The format
of weight files, indexes and tied names is :mod:`nbaccel.storage.weights`.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading

import torch

__all__ = ["CorruptCheckpointError", "SafetensorsFile"]

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


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


class CorruptCheckpointError(ValueError):
    """A weight file that cannot be what its header says: truncated, a corrupt header, a tensor
    whose bytes do not match its shape, or a file changed since it was opened."""


def _fingerprint(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class SafetensorsFile:
    """One safetensors file, read lazily: the header on open, tensor bytes only when asked.

    The header is checked against the file on open (every tensor's bytes inside the file and of
    the size its dtype and shape need), and the file's identity, size and modification time are
    kept: mapping it, or :meth:`check_unchanged`, refuses a file replaced or rewritten since.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            self.fingerprint = _fingerprint(st)
            header = self._read_header(f, st.st_size)
        base = 8 + self._header_len
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            self.entries[name] = self._entry(name, info, base, st.st_size)
        self._mm: mmap.mmap | None = None
        self._lock = threading.Lock()

    def _read_header(self, f, size: int) -> dict:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpointError(
                f"{self.path}: {size} bytes, too short for a safetensors file (truncated?)."
            )
        (self._header_len,) = struct.unpack("<Q", head)
        if self._header_len > size - 8:
            raise CorruptCheckpointError(
                f"{self.path}: its header claims {self._header_len} bytes but the file has "
                f"{size}: not a safetensors file, or a truncated one."
            )
        try:
            header = json.loads(f.read(self._header_len))
        except ValueError as err:
            raise CorruptCheckpointError(
                f"{self.path}: the safetensors header is not valid JSON ({err}): the file is "
                "corrupt; write it again."
            ) from None
        if not isinstance(header, dict):
            raise CorruptCheckpointError(f"{self.path}: the safetensors header is not a table.")
        header.pop("__metadata__", None)
        return header

    def _entry(self, name: str, info, base: int, size: int):
        try:
            kind, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(
                f"{self.path}: tensor {name!r} has a malformed header entry {info!r}."
            ) from None
        if kind not in _ST_DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {kind}.")
        dtype = _ST_DTYPES[kind]
        ok_shape = isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
        need = math.prod(shape) * _itemsize(dtype) if ok_shape else -1
        if not (isinstance(begin, int) and isinstance(end, int)) or need != end - begin >= 0:
            raise CorruptCheckpointError(
                f"{self.path}: tensor {name!r} ({kind}, shape {shape}) needs {need} bytes but "
                f"its header gives bytes {begin}..{end}: the file is corrupt."
            )
        if base + end > size:
            raise CorruptCheckpointError(
                f"{self.path}: tensor {name!r} ends at byte {base + end} but the file has "
                f"{size} bytes: the file is truncated (an interrupted download or copy?); "
                "fetch or write it again."
            )
        return dtype, tuple(shape), base + begin, base + end

    def check_unchanged(self) -> None:
        """Raise :class:`CorruptCheckpointError` when the file on disk is no longer the one
        whose header was read (replaced, rewritten, truncated or touched)."""
        try:
            now = _fingerprint(os.stat(self.path))
        except FileNotFoundError:
            now = None
        if now != self.fingerprint:
            raise CorruptCheckpointError(
                f"{self.path} changed while it was being loaded (size, time or file replaced): "
                "load it again once it is no longer being written."
            )

    def keys(self) -> list[str]:
        return list(self.entries)

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            with self._lock:
                if self._mm is None:
                    with open(self.path, "rb") as f:
                        if _fingerprint(os.fstat(f.fileno())) != self.fingerprint:
                            self.check_unchanged()  # raises: not the file whose header was read
                        # Private copy-on-write mapping: writable views for torch, file untouched.
                        self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._mm

    def view(self, name: str) -> torch.Tensor:
        """Zero-copy tensor over the mapped file (pages are read when touched)."""
        dtype, shape, begin, end = self.entries[name]
        itemsize = _itemsize(dtype)
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
