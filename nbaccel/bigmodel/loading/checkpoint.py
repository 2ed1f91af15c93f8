"""Load a checkpoint into a (possibly empty) model, tensor by tensor, following a device map.

Checkpoints: one ``.safetensors`` / ``.bin`` / ``.pt`` file, or a folder with an index
(``*.index.json`` with a ``weight_map``, or a plain ``{name: file}`` json) and its shards. Keys are
compared with the model before any tensor is read: ``strict=True`` refuses mismatches, and every
loading error lists the missing and unexpected keys. Files, indexes and tied names follow
:mod:`nbaccel.storage.weights`: tied weights (the model's ties and the checkpoint's tie record)
are filled from whichever name the checkpoint has and stay tied. Disk-mapped tensors from
safetensors are indexed in place, not copied; from ``.bin`` they are written once as safetensors
into ``offload_folder``.

What is mapped and what is copied: a tensor bound for the CPU in the dtype it is stored in
becomes the parameter as it is, a view of the file's private memory map (its pages are read when
first touched, shared with the page cache, copied only if written to): safetensors files, and
``.bin`` files saved by ``torch.save`` since torch 1.6 (zip files, loaded with ``mmap=True``); a
legacy pre-zip ``.bin`` cannot be mapped and is read into memory. A tensor whose dtype changes is
cast from the mapping into new memory (safetensors pages are released after). A tensor bound
for a GPU is streamed through pinned staging buffers
(:mod:`~nbaccel.bigmodel.loading.tensor_copies`). A load that fails (a corrupt or truncated file,
a shape that does not fit, a file changed while it was read) puts back every tensor it had
replaced, so no half-loaded model is left in use.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nbaccel.bigmodel import offload as _offload
from nbaccel.bigmodel.dispatch import OFFLOAD_INDEX_ATTR, dispatch_model
from nbaccel.bigmodel.loading.tensor_copies import TensorCopies
from nbaccel.bigmodel.offload import save_offload_index
from nbaccel.bigmodel.placement import _new_param
from nbaccel.bigmodel.planning.device_map import _lookup, get_device_map
from nbaccel.bigmodel.ties import find_tied_parameters
from nbaccel.storage.safetensors_file import SafetensorsFile
from nbaccel.storage.ties import tied_twins
from nbaccel.storage.weights import checkpoint_files, open_weights, tie_record

__all__ = ["CheckpointMismatchError", "load_checkpoint_and_dispatch", "load_checkpoint_in_model"]

logger = logging.getLogger(__name__)


class CheckpointMismatchError(RuntimeError):
    """A checkpoint's keys or shapes do not match the model."""


def _fmt(keys: list[str], limit: int = 30) -> str:
    if not keys:
        return "none"
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _mismatch_text(missing: list[str], unexpected: list[str]) -> str:
    return (
        f"missing keys (in the model, not in the checkpoint): {_fmt(missing)}; "
        f"unexpected keys (in the checkpoint, not in the model): {_fmt(unexpected)}"
    )


def _target_dtype(
    name: str,
    stored: torch.dtype,
    current: torch.dtype,
    dtype: torch.dtype | None,
    keep_fp32: list[str],
) -> torch.dtype:
    if not stored.is_floating_point:
        return stored
    if keep_fp32 and any(
        name == m or name.startswith(m + ".") or f".{m}." in f".{name}" for m in keep_fp32
    ):
        return torch.float32
    if dtype is not None:
        return dtype
    return current if current.is_floating_point else stored


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: Mapping[str, int | str | torch.device] | str | None = None,
    offload_folder: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Fill ``model`` from ``checkpoint`` following ``device_map`` (everything on CPU without one).

    Tensors are read one at a time (peak memory: the weights kept + one tensor), so
    ``offload_state_dict`` is accepted but unnecessary. ``strict=True`` raises
    :class:`CheckpointMismatchError` listing missing and unexpected keys before reading tensors;
    otherwise mismatches are logged as a warning with the same lists.
    """
    if offload_8bit_bnb:
        raise NotImplementedError("8-bit bitsandbytes offload is not supported by nbaccel.")
    load = _load_checkpoint(
        model, checkpoint, device_map, offload_folder, dtype, offload_buffers,
        keep_in_fp32_modules, strict,
    )  # fmt: skip
    load.report_mismatch(require_data=False)


def _load_checkpoint(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: Any,
    offload_folder: str | os.PathLike | None,
    dtype: torch.dtype | str | None,
    offload_buffers: bool,
    keep_in_fp32_modules: list[str] | None,
    strict: bool,
) -> _CheckpointLoad:
    """Load what the checkpoint holds; the caller reports the key mismatches."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    device_map = get_device_map(model, device_map, dtype=dtype, offload_buffers=offload_buffers)
    keep_fp32 = list(keep_in_fp32_modules or getattr(model, "_keep_in_fp32_modules", None) or [])
    load = _CheckpointLoad(
        model, checkpoint, device_map or {"": "cpu"}, dtype, keep_fp32, offload_buffers
    )
    try:
        files, opened = load.open_files()
        load.check_keys(files, strict)
        for path, keys in files.items():
            handle = opened.pop(path, None) or open_weights(path)
            load.write_bin_offload(path, load.load_file(path, keys, handle), offload_folder)
            del handle
        load.copies.finish()
    except BaseException:
        load.put_back()  # nothing half-loaded stays in the model
        raise
    load.record_disk_index(offload_folder)
    return load


def _expected_tensors(model: nn.Module) -> dict[str, tuple[nn.Module, str, bool]]:
    """name -> (owning module, leaf, is a parameter) for every tensor the model expects from a
    checkpoint: all but non-persistent buffers, shared modules under each name."""
    owners: dict[str, tuple[nn.Module, str, bool]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        pre = mod_name + "." if mod_name else ""
        for leaf, p in mod._parameters.items():
            if p is not None:
                owners[pre + leaf] = (mod, leaf, True)
        for leaf, b in mod._buffers.items():
            if b is not None and leaf not in mod._non_persistent_buffers_set:
                owners[pre + leaf] = (mod, leaf, False)
    return owners


class _CheckpointLoad:
    """One ``load_checkpoint_in_model`` call, in steps: open the files, compare the keys, load
    each file tensor by tensor (a tied group once, onto each device the map gives it), write
    ``.bin`` tensors mapped to disk as safetensors, record the disk index on the model."""

    def __init__(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike,
        device_map: Mapping[str, int | str],
        dtype: torch.dtype | None,
        keep_fp32: list[str],
        offload_buffers: bool,
    ) -> None:
        self.model, self.checkpoint, self.device_map = model, checkpoint, device_map
        self.dtype, self.keep_fp32, self.offload_buffers = dtype, keep_fp32, offload_buffers
        self.owners = _expected_tensors(model)
        twins = tied_twins(find_tied_parameters(model), tie_record(checkpoint))
        self.tied = {
            n: [t for t in g if t in self.owners] for n, g in twins.items() if n in self.owners
        }
        self.problem = ""  # the key lists, appended to every loading error
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.disk_index: dict[str, dict] = {}
        self.placed: set[str] = set()
        self.replaced: dict[tuple[int, str], tuple[nn.Module, str, bool, torch.Tensor]] = {}
        self.copies = TensorCopies()

    def open_files(self) -> tuple[dict[str, list[str]], dict[str, SafetensorsFile | Mapping]]:
        """Every file and its keys (files without an index entry are opened to list them)."""
        files = checkpoint_files(self.checkpoint)
        opened: dict[str, SafetensorsFile | Mapping[str, torch.Tensor]] = {}
        for path, keys in files.items():
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"Checkpoint {str(self.checkpoint)!r}: its index puts {_fmt(keys or [], 3)} "
                    f"in {path}, which does not exist (a shard not downloaded or copied?)."
                )
            if path.endswith(".safetensors"):
                opened[path] = open_weights(path)  # every header checked before loading
                files[path] = keys if keys is not None else list(opened[path].keys())
            elif keys is None:
                opened[path] = open_weights(path)
                files[path] = list(opened[path].keys())
        return files, opened

    def check_keys(self, files: Mapping[str, list[str]], strict: bool) -> None:
        """Missing and unexpected keys: an error under ``strict``, else a warning listing them."""
        ckpt_keys = [k for keys in files.values() for k in keys]
        present = set(ckpt_keys)
        unexpected = [k for k in ckpt_keys if k not in self.owners]
        missing = [
            n
            for n in self.owners
            if n not in present and not any(t in present for t in self.tied.get(n, ()))
        ]
        self.problem = _mismatch_text(missing, unexpected)
        self.missing, self.unexpected = missing, unexpected
        model_name = type(self.model).__name__
        if strict and (missing or unexpected):
            raise CheckpointMismatchError(
                f"Checkpoint {str(self.checkpoint)!r} does not match {model_name}: {self.problem}."
            )

    def _on_meta(self, name: str) -> bool:
        mod, leaf, _ = self.owners[name]
        return getattr(mod, leaf).device.type == "meta"

    def report_mismatch(self, require_data: bool) -> None:
        """One report of the missing and unexpected keys: an error when ``require_data`` and a
        missing tensor is left without data (on the meta device, not offloaded), else a
        warning."""
        if not (self.missing or self.unexpected):
            return
        model_name = type(self.model).__name__
        empty = [n for n in self.missing if n not in self.disk_index and self._on_meta(n)]
        if require_data and empty:
            raise CheckpointMismatchError(
                f"Checkpoint {str(self.checkpoint)!r} does not match {model_name}: "
                f"{self.problem}. The missing tensors have no data (the model was built on the "
                "meta device): use a checkpoint that holds them, or build those modules with "
                "real weights."
            )
        if self.unexpected:  # Accelerate's phrase, which scripts and tests match
            head = f"Some weights of the model checkpoint at {self.checkpoint} were not used when"
            head += f" initializing {model_name}"
        else:
            head = f"Checkpoint {self.checkpoint} does not fill {model_name}"
        logger.warning("%s: %s.", head, self.problem)

    def load_file(self, path: str, keys: list[str], handle: Any) -> dict[str, torch.Tensor]:
        """Load every expected tensor of one file; return the ``.bin`` tensors mapped to disk
        (they must be written as safetensors to be read in place)."""
        to_write: dict[str, torch.Tensor] = {}
        for key in keys:
            if key not in self.owners or key in self.placed:
                continue
            if isinstance(handle, SafetensorsFile) and key not in handle.entries:
                raise CheckpointMismatchError(
                    f"Cannot load {str(self.checkpoint)!r}: its index puts {key!r} in {path}, "
                    f"which does not hold it; {self.problem}."
                )
            try:
                self._load_tensor(path, key, handle, to_write)
            except CheckpointMismatchError as err:
                raise CheckpointMismatchError(
                    f"Cannot load {str(self.checkpoint)!r}: {err}; {self.problem}."
                ) from None
            except Exception as err:
                raise RuntimeError(
                    f"Loading {key!r} from {path} failed ({err}); {self.problem}."
                ) from err
        self.copies.drain()
        if isinstance(handle, SafetensorsFile):
            handle.check_unchanged()  # rewritten while read: its views may mix two files
        return to_write

    def put_back(self) -> None:
        """Restore every tensor this load replaced (after a failure)."""
        with contextlib.suppress(Exception):
            self.copies.finish()
        for mod, leaf, is_param, old in self.replaced.values():
            (mod._parameters if is_param else mod._buffers)[leaf] = old
        self.replaced.clear()

    def _load_tensor(self, path: str, key: str, handle: Any, to_write: dict) -> None:
        mod, leaf, is_param = self.owners[key]
        current = mod._parameters[leaf] if is_param else mod._buffers[leaf]
        stored_shape, stored_dtype = _shape_dtype(handle, key)
        if tuple(stored_shape) != tuple(current.shape):
            raise CheckpointMismatchError(
                f"{key!r} has shape {list(stored_shape)} in {path} but "
                f"{list(current.shape)} in the model"
            )
        target = _target_dtype(key, stored_dtype, current.dtype, self.dtype, self.keep_fp32)
        group = self.tied.get(key, [key])
        for device, names in self._devices_of(group, is_param).items():
            self._remember(names)
            if device == "disk":
                self._map_to_disk(path, key, handle, names, target, list(stored_shape), to_write)
                meta = current if current.device.type == "meta" else current.to("meta")
                _assign(self.owners, names, meta)
                continue
            if device == "cpu" and stored_dtype != target:
                put = partial(_assign, self.owners, names)
                self.copies.cast_later(path, key, handle, target, put)
                continue
            _assign(self.owners, names, self.copies.value(key, handle, device, target))
        self.placed.update(group)

    def _remember(self, names: list[str]) -> None:
        for name in names:
            mod, leaf, is_param = self.owners[name]
            slot = (id(mod), leaf)
            if slot not in self.replaced:
                old = mod._parameters[leaf] if is_param else mod._buffers[leaf]
                self.replaced[slot] = (mod, leaf, is_param, old)

    def _devices_of(self, group: list[str], is_param: bool) -> dict[int | str, list[str]]:
        """The names of a tied group by device (a user map may split a group across devices)."""
        by_device: dict[int | str, list[str]] = {}
        for name in group:
            device = _lookup(name, self.device_map)
            if device == "disk" and not is_param and not self.offload_buffers:
                device = "cpu"  # buffers stay resident unless offload_buffers
            by_device.setdefault(device, []).append(name)
        return by_device

    def _map_to_disk(self, path, key, handle, names, target, shape, to_write) -> None:
        """Index a safetensors tensor in place, or queue a ``.bin`` one to be written once."""
        if isinstance(handle, SafetensorsFile):
            entry = {
                "safetensors_file": os.path.abspath(path),
                "weight_name": key,
                "dtype": str(target).replace("torch.", ""),
                "shape": shape,
            }
            self.disk_index.update(dict.fromkeys(names, entry))
        else:
            to_write[key] = handle[key].to(target)
            self.disk_index.update({n: {"alias": key} for n in names if n != key})

    def write_bin_offload(
        self, path: str, to_write: dict[str, torch.Tensor], offload_folder: Any
    ) -> None:
        """Write the disk-mapped tensors of a ``.bin`` file into ``offload_folder``, once."""
        if not to_write:
            return
        if offload_folder is None:
            raise ValueError(
                f"device_map puts {_fmt(list(to_write), 5)} on disk and {path} is not "
                "safetensors (cannot be read in place): pass offload_folder=... to write "
                "them there once."
            )
        written = _offload.offload_state_dict(
            offload_folder, to_write, file_name=Path(path).stem + ".safetensors"
        )
        for entry in written.values():
            entry["safetensors_file"] = os.path.abspath(
                os.path.join(offload_folder, entry["safetensors_file"])
            )
        self.disk_index.update(written)

    def record_disk_index(self, offload_folder: Any) -> None:
        """Where every disk-mapped tensor lives, on the model (and in ``offload_folder``)."""
        index = self.disk_index
        for name, entry in list(index.items()):
            if "alias" in entry:
                index[name] = index[entry["alias"]]
        if not index:
            return
        previous = getattr(self.model, OFFLOAD_INDEX_ATTR, None) or {}
        setattr(self.model, OFFLOAD_INDEX_ATTR, {**previous, **index})
        if offload_folder is not None:
            save_offload_index(index, offload_folder)


def _shape_dtype(handle, key: str) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(handle, SafetensorsFile):
        dtype, shape, _, _ = handle.entries[key]
        return shape, dtype
    tensor = handle[key]
    return tuple(tensor.shape), tensor.dtype


def _assign(
    owners: Mapping[str, tuple[nn.Module, str, bool]], names: list[str], value: torch.Tensor
) -> None:
    """Give every name of a tied group the same new tensor (one Parameter object)."""
    shared: nn.Parameter | None = None
    for name in names:
        mod, leaf, is_param = owners[name]
        if is_param:
            if shared is None:
                shared = (
                    value
                    if isinstance(value, nn.Parameter)
                    else _new_param(mod._parameters[leaf], value)
                )
            mod._parameters[leaf] = shared
        else:
            mod._buffers[leaf] = value


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: Mapping[str, int | str | torch.device] | str | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    offload_buffers: bool = False,
    dtype: torch.dtype | str | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> nn.Module:
    """Plan (``"auto"``, ``"balanced"``, ``"balanced_low_0"``, ``"sequential"`` or a dict), load the
    checkpoint into ``model`` and dispatch it. Disk blocks of a safetensors checkpoint are read in
    place; ``offload_folder`` is only needed for other formats."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    device_map = get_device_map(
        model, device_map, max_memory, no_split_module_classes, dtype, offload_buffers
    )
    load = _load_checkpoint(
        model, checkpoint, device_map, offload_folder, dtype, offload_buffers, None, strict
    )
    load.report_mismatch(require_data=True)  # one report: both key lists, before dispatching
    if device_map is None:
        return model
    return dispatch_model(
        model,
        device_map=device_map,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
    )
