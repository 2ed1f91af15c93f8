"""Move a function and its arguments from the notebook to the ranks.

Code is serialised with cloudpickle, so functions, lambdas, closures and classes defined in the
notebook travel by value. Large CPU tensors (model weights, datasets) do not travel inside the
pickle: they are written once into a shared-memory file that every rank maps *copy-on-write*
(``MAP_PRIVATE``). Eight ranks reading one 1 GB model share the same physical pages, exactly as
after a ``fork``, and a rank that trains its copy gets private pages for what it writes.

Tensors travel as views of their storages, as torch's own multiprocessing does: ``(a, a[:512])``
arrive as a tensor and a view of it, and a transposed tensor keeps its strides. The price is the
same as torch's: a small slice of a large tensor carries the whole storage (``.clone()`` it first
to send only the slice).

A segment outlives nobody: its owner (the kernel) holds a shared ``flock`` on it from creation
until it unlinks it, and every launch and every new fork server sweeps the segments whose lock
is free, i.e. whose owner died (SIGKILL, OOM) before it could unlink them. Segments are named
``nbaccel-<owner pid>-<random>``.

Objects multiprocessing shares only by inheritance (a ``multiprocessing.Queue``, ``Lock``,
``Event``, ``Value``...) cannot travel in a pickle: forked ranks (``start_method="fork"``) inherit
them as they are, and any other launch refuses them before it starts, naming the fix.
"""

from __future__ import annotations

import fcntl
import io
import mmap
import os
import pickle
import re
import secrets
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from nbaccel.launch.host.processes import pid_alive
from nbaccel.launch.wire.pickling import Pickler, is_plain, plain_class
from nbaccel.launch.wire.unpicklable import (
    InheritanceOnly,
    inheritance_only_refused,
    inheritance_only_types,
    unpicklable_refused,
)

__all__ = [
    "Packed",
    "SharedTensors",
    "Wire",
    "discard",
    "on_the_wire",
    "pack",
    "shm_dir",
    "sweep_segments",
    "take",
    "unpack",
]

_SHARE_THRESHOLD = 64 * 1024  # bytes; smaller tensors are cheaper inline
_ALIGN = 64
_EMPTY = torch.empty(0, dtype=torch.uint8)
# nbaccel-<owner pid>-<random>, and ``.new`` while it is created (then renamed, once locked)
_SEGMENT_NAME = re.compile(r"nbaccel-(\d+)-[0-9a-f]{16}(\.new)?")


class _InheritedObjects:
    """Objects forked ranks inherit from the driver instead of unpickling them, by id: held
    while a packed call refers to them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[int, Any] = {}

    def keep(self, obj: Any) -> int:
        with self._lock:
            self._by_id[id(obj)] = obj
        return id(obj)

    def forget(self, key: int) -> None:
        with self._lock:
            self._by_id.pop(key, None)

    def get(self, key: int) -> Any:
        """The object of ``key``; UnpicklingError when this process does not hold it."""
        with self._lock:
            if key not in self._by_id:
                raise pickle.UnpicklingError(
                    "an inherited multiprocessing object is missing: this process was not "
                    "forked from the one that packed it."
                )
            return self._by_id[key]


_INHERITED = _InheritedObjects()


@dataclass
class _StorageRecord:
    """One storage's bytes: at ``offset`` in the shared file, or inline when small."""

    offset: int
    nbytes: int
    inline: bytes | None = None


@dataclass
class _TensorRecord:
    """One tensor as a view of a shared storage: views of one storage stay views of one
    storage in the rank, and a transposed or sliced tensor keeps its strides."""

    storage: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    parameter: bool
    requires_grad: bool


@plain_class(whole=True)  # bytes, a path, records of importable types, ints
@dataclass
class Packed:
    """What a rank needs to rebuild the objects: the pickle and the shared tensor file."""

    data: bytes
    segment: str | None = None
    records: list[_TensorRecord] = field(default_factory=list)
    storages: list[_StorageRecord] = field(default_factory=list)
    inherited: list[int] = field(default_factory=list)  # keys of _INHERITED it refers to

    def forget_inherited(self) -> None:
        """Drop the driver's references to the objects the forked ranks inherited."""
        for key in self.inherited:
            _INHERITED.forget(key)
        self.inherited = []


def shm_dir() -> str:
    """Where shared tensor files go: ``$NBACCEL_SHM_DIR`` (a folder on a tmpfs), else
    ``/dev/shm``, else the temp folder."""
    chosen = os.environ.get("NBACCEL_SHM_DIR")
    if chosen:
        return chosen
    return (
        "/dev/shm"
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        else (tempfile.gettempdir())
    )


def sweep_segments() -> list[str]:
    """Unlink the shared tensor files whose owner died before unlinking them; their paths."""
    folder = shm_dir()
    try:
        names = [m for m in map(_SEGMENT_NAME.fullmatch, os.listdir(folder)) if m]
    except OSError:
        return []
    swept = []
    for match in names:
        if match.group(2) and pid_alive(int(match.group(1))):
            continue  # being created: not locked yet, but its owner lives
        path = os.path.join(folder, match.group(0))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if not _is_segment(fd):
                continue
            try:  # the owner holds a shared lock for as long as the file is its to remove
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue
            os.unlink(path)
            swept.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return swept


def _is_segment(fd: int) -> bool:
    """A regular file of this user (never another user's, nor a folder such as a channel's)."""
    info = os.fstat(fd)
    return info.st_uid == os.getuid() and (info.st_mode & 0o170000) == 0o100000


class SharedTensors:
    """Owner of one shared-memory file; ``release()`` unlinks it (mappings stay valid)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.records: list[_TensorRecord] = []
        self.storages: list[_StorageRecord] = []
        bases: list[torch.Tensor] = []
        index: dict[int, int] = {}
        offset = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in index:
                index[key] = len(bases)
                base = torch.empty(0, dtype=torch.uint8).set_(storage)
                if storage.nbytes() < _SHARE_THRESHOLD:  # cheaper inside the pickle
                    self.storages.append(
                        _StorageRecord(0, storage.nbytes(), base.numpy().tobytes())
                    )
                    base = None
                else:
                    self.storages.append(_StorageRecord(offset, storage.nbytes()))
                    offset += -(-storage.nbytes() // _ALIGN) * _ALIGN
                bases.append(base)
            self.records.append(
                _TensorRecord(
                    index[key],
                    t.dtype,
                    tuple(t.shape),
                    tuple(t.stride()),
                    t.storage_offset(),
                    isinstance(t, torch.nn.Parameter),
                    t.requires_grad,
                )
            )
        self.path: str | None = None
        self._lock_fd: int | None = None
        if offset == 0:
            return  # every storage is small: nothing to share
        sweep_segments()
        path = os.path.join(shm_dir(), f"nbaccel-{os.getpid()}-{secrets.token_hex(8)}")
        # created under a name a sweep skips while this process lives, locked (until release():
        # a sweep leaves a locked file alone), then given its name
        fd = os.open(path + ".new", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.rename(path + ".new", path)
        self.path = path
        self._lock_fd = fd
        try:
            os.ftruncate(fd, max(offset, 1))
            with mmap.mmap(fd, max(offset, 1)) as mm:
                flat = torch.frombuffer(mm, dtype=torch.uint8)
                for base, rec in zip(bases, self.storages):
                    if base is not None and rec.nbytes:
                        flat[rec.offset : rec.offset + rec.nbytes].copy_(base)
                del flat
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __del__(self) -> None:
        if hasattr(self, "_lock_fd"):
            self.release()


class _Pickler(Pickler):
    def __init__(self, buffer: io.BytesIO, inherit: bool = False, share: bool = True) -> None:
        super().__init__(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        self.shared: list[torch.Tensor] = []
        self._ids: dict[int, int] = {}
        self._inherit = inherit
        self._inheritance_only = inheritance_only_types()
        self.inherited: list[int] = []
        self._share = share

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, self._inheritance_only):
            if not self._inherit:
                raise InheritanceOnly(obj)
            self.inherited.append(_INHERITED.keep(obj))
            return ("nbaccel-inherited", id(obj))
        if (
            self._share
            and type(obj) in (torch.Tensor, torch.nn.Parameter)
            and obj.device.type == "cpu"
            and obj.layout == torch.strided
            and not obj.is_quantized
            and not obj.is_conj()
            and not obj.is_neg()
            and obj.grad_fn is None
        ):
            key = id(obj)
            if key not in self._ids:
                self._ids[key] = len(self.shared)
                self.shared.append(obj)
            return ("nbaccel-tensor", self._ids[key])
        return None


def pack(
    obj: Any,
    name: str = "args",
    element_names: tuple[str, ...] | None = None,
    inherit: bool = False,
    share: bool = True,
    toward: str = "ranks",
) -> tuple[Packed, SharedTensors | None]:
    """Serialise ``obj``; large CPU tensors go to a shared file. Raises UnpicklableError.

    ``element_names`` names the items of a top-level tuple in error messages (for example
    ``("function", "args", "kwargs")``), so the path printed is the one the user typed.
    ``inherit``: the ranks are forked from this process after packing, so multiprocessing's
    inheritance-only objects stay here and the ranks inherit them (``Packed.forget_inherited``
    when the launch is over).
    ``share=False`` keeps every tensor inside the pickle (a reader on another host cannot map
    this host's files). ``toward``: "ranks" or "notebook", for the error's words.
    """
    if is_plain(obj):  # builtins, protocol classes, engine functions: the C pickler alone
        return Packed(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)), None
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, inherit=inherit, share=share)
    try:
        pickler.dump(obj)
    except InheritanceOnly as exc:
        raise inheritance_only_refused(exc, obj, name, element_names) from None
    except Exception as exc:
        raise unpicklable_refused(exc, obj, name, element_names, toward) from exc
    shared = SharedTensors(pickler.shared) if pickler.shared else None
    packed = Packed(buffer.getvalue(), shared.path if shared else None)
    packed.inherited = pickler.inherited
    if shared:
        packed.records, packed.storages = shared.records, shared.storages
    return packed, shared


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tensors: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        tag, index = pid
        if tag == "nbaccel-inherited":
            return _INHERITED.get(index)
        if tag != "nbaccel-tensor":
            raise pickle.UnpicklingError(f"unknown persistent id {tag!r}")
        return self._tensors[index]


def _map_segment(packed: Packed, take: bool = False) -> list[torch.Tensor]:
    if not packed.records:
        return []
    flat = None
    if packed.segment is not None:
        if take:  # the only reader: map the pages themselves, then the name is not needed
            fd = os.open(packed.segment, os.O_RDWR)
            try:
                os.unlink(packed.segment)
                mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
        else:
            fd = os.open(packed.segment, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(
                    fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
                )
            finally:
                os.close(fd)
        flat = torch.frombuffer(mm, dtype=torch.uint8)
    storages = [
        (torch.frombuffer(bytearray(rec.inline), dtype=torch.uint8) if rec.nbytes else _EMPTY)
        if rec.inline is not None
        else flat[rec.offset : rec.offset + rec.nbytes]  # type: ignore[index]
        for rec in packed.storages
    ]
    tensors: list[torch.Tensor] = []
    for rec in packed.records:
        typed = storages[rec.storage].view(rec.dtype)
        # as_strided counts from the start of the whole mapping, not from ``typed``
        t = typed.as_strided(rec.shape, rec.stride, typed.storage_offset() + rec.storage_offset)
        if rec.parameter:
            t = torch.nn.Parameter(t, requires_grad=rec.requires_grad)
        elif rec.requires_grad:
            t.requires_grad_(True)
        tensors.append(t)
    return tensors


def _holds_references(packed: Packed) -> bool:
    """Whether ``packed``'s pickle refers to shared tensors or inherited objects (persistent
    ids); without them the C unpickler alone rebuilds it (a warm cell's call, a plain result)."""
    return bool(packed.records or packed.inherited)


#: what a message carries of a payload: a :class:`Packed`, or its pickle alone (on_the_wire)
Wire = Packed | bytes


def on_the_wire(packed: Packed) -> Wire:
    """What a message carries of ``packed``: its pickle alone when it refers to nothing shared
    (a cell's call, a plain result), which loads with no lookup of :class:`Packed` (see
    :func:`~nbaccel.launch.wire.pickling.dumps_message`); :func:`unpack`, :func:`take` and
    :func:`discard` take either."""
    if packed.segment is None and not _holds_references(packed):
        return packed.data
    return packed


def unpack(packed: Wire) -> Any:
    """Rebuild the objects in a rank; shared tensors map the segment copy-on-write."""
    if type(packed) is bytes:
        return pickle.loads(packed)
    if not _holds_references(packed):
        return pickle.loads(packed.data)
    return _Unpickler(packed.data, _map_segment(packed)).load()


def take(packed: Wire) -> Any:
    """Rebuild a value sent to one reader (a rank's return value in the notebook): the shared
    file is opened, unlinked and mapped shared, so its pages are the tensors' memory (no copy)
    and nothing is left in the shared-memory folder once it is mapped, whether or not
    unpickling works. (The rank that wrote it holds its lock until its next call or exit.)"""
    if type(packed) is bytes:  # a plain value (on_the_wire): no file
        return pickle.loads(packed)
    try:
        tensors = _map_segment(packed, take=True)
    finally:
        discard(packed)
    if not _holds_references(packed):
        return pickle.loads(packed.data)
    return _Unpickler(packed.data, tensors).load()


def discard(packed: Wire) -> None:
    """Remove ``packed``'s shared file, if it is still there (a value nobody will read)."""
    if type(packed) is not bytes and packed.segment is not None:
        try:
            os.unlink(packed.segment)
        except FileNotFoundError:
            pass
