"""A run's journal: every renderer call of a detached launch, in order, on disk.

One file of frames (4-byte big-endian length, then a pickled tuple ``(kind, *fields)``),
appended and flushed record by record, so a reader (another kernel, ``nbaccel runs logs``)
sees each one as soon as it is written, and a process killed mid-run loses nothing already
written. The journal is bounded (``NBACCEL_RUN_LOG_MB``, default 512 MB): past the bound,
output lines and events are no longer kept, once announced by a notice; notices and the end of
each launch are always kept, and the dropped lines are counted at the end.
"""

from __future__ import annotations

import os
import pickle
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["JOURNAL_BOUND_VAR", "JournalReader", "JournalWriter", "Record"]

JOURNAL_BOUND_VAR = "NBACCEL_RUN_LOG_MB"
_DEFAULT_BOUND_MB = 512.0
_HEADER = struct.Struct(">I")

#: a journal record: ``(kind, *fields)``
Record = tuple

# kinds that are always kept (they are few and they close what was opened)
_ALWAYS = frozenset({"start", "labels", "notice", "finish", "attempt"})


def _dumps(record: Record) -> bytes:
    try:
        return pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an event payload of a class defined on the fly: by value
        import cloudpickle

        try:
            return cloudpickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # never lose the run over one event: keep what it was
            return pickle.dumps(("notice", f"an event could not be kept: {exc}"))


def _bound() -> int:
    text = os.environ.get(JOURNAL_BOUND_VAR, "")
    try:
        megabytes = float(text) if text else _DEFAULT_BOUND_MB
    except ValueError:
        megabytes = _DEFAULT_BOUND_MB
    return max(1, int(megabytes * 1024 * 1024))


class JournalWriter:
    """Appends records to ``path`` within the bound (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, bound: int | None = None) -> None:
        self.path = Path(path)
        self.bound = _bound() if bound is None else bound
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file: IO[bytes] = os.fdopen(fd, "ab")
        self.size = self._file.tell()
        self.dropped = 0

    def write(self, record: Record) -> None:
        """Append one record (dropped, and counted, past the bound unless always kept)."""
        data = _dumps(record)
        kind = record[0]
        if kind not in _ALWAYS and self.size + len(data) > self.bound:
            if self.dropped == 0:
                self._append(
                    _dumps(
                        (
                            "notice",
                            f"the run's journal reached its bound "
                            f"({self.bound // (1024 * 1024)} MB, {JOURNAL_BOUND_VAR}); "
                            "later output is not kept.",
                        )
                    )  # fmt: skip
                )
            if kind in ("line", "over"):
                self.dropped += 1
            return
        self._append(data)

    def _append(self, data: bytes) -> None:
        self._file.write(_HEADER.pack(len(data)) + data)
        self._file.flush()
        self.size += _HEADER.size + len(data)

    def close(self) -> None:
        """Say how many lines were dropped (if any), and close the file."""
        if self._file.closed:
            return
        if self.dropped:
            self._append(_dumps(("notice", f"{self.dropped} output lines beyond the bound "
                                 "were not kept.")))  # fmt: skip
            self.dropped = 0
        self._file.close()


class JournalReader:
    """Reads the records of a journal that may still be growing; :meth:`read` returns the
    complete records written since the last call."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.offset = 0
        self._pending = b""

    def read(self) -> list[Any]:
        """The records completed since the last read (none when the file does not exist)."""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        buffer = self._pending + data
        records, used = [], 0
        for record, end in _frames(buffer):
            records.append(record)
            used = end
        self._pending = buffer[used:]
        return records


def _frames(buffer: bytes) -> Iterator[tuple[Any, int]]:
    at = 0
    while at + _HEADER.size <= len(buffer):
        (length,) = _HEADER.unpack_from(buffer, at)
        end = at + _HEADER.size + length
        if end > len(buffer):
            return
        try:
            record = pickle.loads(buffer[at + _HEADER.size : end])
        except Exception as exc:  # a record this process cannot load: say so, go on
            record = ("notice", f"a journal record could not be read here: {exc}")
        yield record, end
        at = end
