"""Load a checkpoint into a (possibly empty) model, tensor by tensor, following a device map.

Checkpoints: one ``.safetensors`` / ``.bin`` / ``.pt`` file, or a folder with an index
(``*.index.json`` with a ``weight_map``, or a plain ``{name: file}`` json) and its shards. Keys are
compared with the model before any tensor is read: ``strict=True`` refuses mismatches, and every
loading error lists the missing and unexpected keys. Files, indexes and tied names follow
:mod:`nbaccel.storage.weights`: tied weights (the model's ties and the checkpoint's tie record)
are filled from whichever name the checkpoint has and stay tied. Disk-mapped tensors from
safetensors are indexed in place, not copied; from ``.bin`` they are written once as safetensors
into ``offload_folder``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from nbaccel.bigmodel import offload as _offload
from nbaccel.bigmodel.device_map import _lookup, get_device_map
from nbaccel.bigmodel.dispatch import OFFLOAD_INDEX_ATTR, dispatch_model
from nbaccel.bigmodel.offload import save_offload_index
from nbaccel.bigmodel.placement import _new_param, to_torch_device
from nbaccel.bigmodel.tied_parameters import find_tied_parameters
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
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    if offload_8bit_bnb:
        raise NotImplementedError("8-bit bitsandbytes offload is not supported by nbaccel.")
    device_map = get_device_map(model, device_map, dtype=dtype, offload_buffers=offload_buffers)
    device_map = device_map or {"": "cpu"}
    keep_fp32 = list(keep_in_fp32_modules or getattr(model, "_keep_in_fp32_modules", None) or [])

    # What the model expects: every tensor name except non-persistent buffers.
    owners: dict[str, tuple[nn.Module, str, bool]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        pre = mod_name + "." if mod_name else ""
        for leaf, p in mod._parameters.items():
            if p is not None:
                owners[pre + leaf] = (mod, leaf, True)
        for leaf, b in mod._buffers.items():
            if b is not None and leaf not in mod._non_persistent_buffers_set:
                owners[pre + leaf] = (mod, leaf, False)
    twins = tied_twins(find_tied_parameters(model), tie_record(checkpoint))
    tied = {n: [t for t in g if t in owners] for n, g in twins.items() if n in owners}

    files = checkpoint_files(checkpoint)
    opened: dict[str, SafetensorsFile | Mapping[str, torch.Tensor]] = {}
    ckpt_keys: list[str] = []
    for path, keys in files.items():
        if keys is None:
            handle = open_weights(path)
            opened[path] = handle
            keys = list(handle.keys())
            files[path] = keys
        ckpt_keys.extend(keys)
    present = set(ckpt_keys)
    unexpected = [k for k in ckpt_keys if k not in owners]
    missing = [
        n for n in owners if n not in present and not any(t in present for t in tied.get(n, ()))
    ]
    problem = _mismatch_text(missing, unexpected)
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(
            f"Checkpoint {str(checkpoint)!r} does not match {type(model).__name__}: {problem}."
        )
    if unexpected:
        logger.warning(
            "Checkpoint weights %s were not used when loading %s into %s (the model has no such "
            "tensors).", _fmt(unexpected), checkpoint, type(model).__name__,
        )  # fmt: skip
    if missing:
        logger.warning(
            "Loading %s into %s: %s.", checkpoint, type(model).__name__, _mismatch_text(missing, [])
        )

    disk_index: dict[str, dict] = {}
    placed: set[str] = set()
    for path, keys in files.items():
        handle = opened.pop(path, None)
        if handle is None:
            handle = open_weights(path)
        to_write: dict[str, torch.Tensor] = {}
        for key in keys:
            if key not in owners or key in placed:
                continue
            mod, leaf, is_param = owners[key]
            current = mod._parameters[leaf] if is_param else mod._buffers[leaf]
            try:
                stored_shape, stored_dtype = _shape_dtype(handle, key)
                if tuple(stored_shape) != tuple(current.shape):
                    raise CheckpointMismatchError(
                        f"{key!r} has shape {list(stored_shape)} in the checkpoint but "
                        f"{list(current.shape)} in the model"
                    )
                target = _target_dtype(key, stored_dtype, current.dtype, dtype, keep_fp32)
                group = tied.get(key, [key])
                by_device: dict[int | str, list[str]] = {}
                for name in group:  # a user map may split a tied group across devices
                    device = _lookup(name, device_map)
                    if device == "disk" and not is_param and not offload_buffers:
                        device = "cpu"  # buffers stay resident unless offload_buffers
                    by_device.setdefault(device, []).append(name)
                src = None
                for device, names in by_device.items():
                    if device == "disk":
                        if isinstance(handle, SafetensorsFile):
                            entry = {
                                "safetensors_file": os.path.abspath(path),
                                "weight_name": key,
                                "dtype": str(target).replace("torch.", ""),
                                "shape": list(stored_shape),
                            }
                            disk_index.update(dict.fromkeys(names, entry))
                        else:
                            to_write[key] = handle[key].to(target)
                            disk_index.update({n: {"alias": key} for n in names if n != key})
                        meta = current if current.device.type == "meta" else current.to("meta")
                        _assign(owners, names, meta)
                        continue
                    if src is None:
                        src = (
                            handle.read(key) if isinstance(handle, SafetensorsFile) else handle[key]
                        )
                    value = src.to(to_torch_device(device), dtype=target)
                    if (
                        not isinstance(handle, SafetensorsFile)
                        and value.data_ptr() == src.data_ptr()
                    ):
                        value = value.clone()  # do not keep the memory-mapped .bin file alive
                    _assign(owners, names, value)
                placed.update(group)
            except CheckpointMismatchError as err:
                raise CheckpointMismatchError(
                    f"Cannot load {str(checkpoint)!r}: {err}; {problem}."
                ) from None
            except Exception as err:
                raise RuntimeError(
                    f"Loading {key!r} from {path} failed ({err}); {problem}."
                ) from err
        if to_write:
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
            disk_index.update(written)
        del handle
    for name, entry in list(disk_index.items()):
        if "alias" in entry:
            disk_index[name] = disk_index[entry["alias"]]
    if disk_index:
        setattr(
            model,
            OFFLOAD_INDEX_ATTR,
            {**(getattr(model, OFFLOAD_INDEX_ATTR, None) or {}), **disk_index},
        )
        if offload_folder is not None:
            save_offload_index(disk_index, offload_folder)


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
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map=device_map,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_state_dict=bool(offload_state_dict),
        offload_buffers=offload_buffers,
        strict=strict,
    )
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
