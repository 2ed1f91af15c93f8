"""Model weights on disk, the one module that writes and reads them (``save_model``,
``save_state``, ``load_checkpoint_in_model``, offload folders).

Layout: the one the Hugging Face ecosystem reads: ``model.safetensors`` for one shard, or
``model-00001-of-0000N.safetensors`` files plus ``model.safetensors.index.json`` (``weight_map``:
parameter name -> file); ``.bin`` files (``torch.save``) the same way. Reading also accepts any
single weight file, a folder with one, or a plain ``{name: file}`` json index
(:func:`checkpoint_files`), and opens safetensors files in place (:func:`open_weights`).

Tied weights, one convention: tensors that share storage are written once, under their first
name, and the other names are recorded as ``{dropped name: kept name}`` (``tied_weights`` in the
index metadata, or ``<file>.tied.json`` beside a single file; :func:`tie_record`). A name the
checkpoint lacks is filled from its twin, where twins are the model's own tied parameters plus
the record (:func:`nbaccel.storage.ties.tied_twins`); loaders give every twin the same tensor.
Writes go through a staging directory (:mod:`nbaccel.storage.atomic`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nbaccel.storage.atomic import begin_staging, commit_staging, recover
from nbaccel.storage.safetensors_file import CorruptCheckpointError, SafetensorsFile
from nbaccel.storage.ties import tie_groups, tied_twins
from nbaccel.values.sizes import parse_size

logger = logging.getLogger(__name__)

__all__ = [
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "checkpoint_files",
    "drop_tied_aliases",
    "load_into_model",
    "load_model_weights",
    "open_weights",
    "read_weights",
    "save_model_weights",
    "shard_state_dict",
    "tie_record",
    "write_safetensors",
    "write_weights",
]

WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_WEIGHT_FILE = re.compile(
    r"^(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$"
)


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (
        t.device,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        t.dtype,
        t.shape,
        t.stride(),
    )


def drop_tied_aliases(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict, dict[str, str]]:
    """Keep one name per shared tensor; return (state dict, {dropped name: kept name})."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    storages: set[tuple[Any, int]] = set()
    for name, tensor in state_dict.items():
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.device.type == "meta"
            or not tensor.numel()
        ):
            kept[name] = tensor
            continue
        key = _storage_key(tensor)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        # A different view of a storage already written: safetensors needs its own copy.
        kept[name] = tensor.clone() if storage in storages else tensor
        storages.add(storage)
    return kept, aliases


def shard_state_dict(state_dict: Mapping[str, torch.Tensor], max_shard_size: int | str) -> list:
    """Split into shards of at most ``max_shard_size`` bytes (a bigger tensor gets its own)."""
    limit = parse_size(max_shard_size, "max_shard_size")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike) -> None:
    """One safetensors file of ``tensors`` (moved to the CPU, made contiguous)."""
    from safetensors.torch import save_file

    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(cpu, str(path), metadata={"format": "pt"})


def _write(tensors: dict[str, torch.Tensor], path: Path, safe: bool) -> None:
    if safe:
        write_safetensors(tensors, path)
    else:
        torch.save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, path)


def write_weights(
    state_dict: Mapping[str, torch.Tensor],
    directory: str | os.PathLike,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    base_name: str | None = None,
) -> list[str]:
    """Write shards (+ index when sharded) into an existing ``directory``; return file names."""
    directory = Path(directory)
    state_dict, aliases = drop_tied_aliases(state_dict)
    shards = shard_state_dict(state_dict, max_shard_size)
    ext = "safetensors" if safe_serialization else "bin"
    stem = base_name or ("model" if safe_serialization else "pytorch_model")
    if len(shards) == 1:
        name = f"{stem}.{ext}"
        _write(shards[0], directory / name, safe_serialization)
        if aliases:  # one file has no index: keep the tie record beside it
            (directory / f"{name}.tied.json").write_text(json.dumps(aliases))
            return [name, f"{name}.tied.json"]
        return [name]
    names, weight_map = [], {}
    for index, shard in enumerate(shards, start=1):
        name = f"{stem}-{index:05d}-of-{len(shards):05d}.{ext}"
        _write(shard, directory / name, safe_serialization)
        weight_map.update(dict.fromkeys(shard, name))
        names.append(name)
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    index_doc = {
        "metadata": {"total_size": total, "tied_weights": aliases},
        "weight_map": weight_map,
    }
    index_name = f"{stem}.{ext}.index.json"
    (directory / index_name).write_text(json.dumps(index_doc, indent=2, sort_keys=True))
    return [*names, index_name]


def save_model_weights(
    state_dict: Mapping[str, torch.Tensor],
    save_directory: str | os.PathLike,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> list[str]:
    """Atomically (re)write the weight files of ``save_directory``; other files there are kept."""
    staging = begin_staging(save_directory)
    names = write_weights(state_dict, staging, max_shard_size, safe_serialization)
    commit_staging(
        save_directory, carry_over=lambda name: not _WEIGHT_FILE.match(name.split(".tied")[0])
    )
    return names


# -- reading ------------------------------------------------------------------------------
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def checkpoint_files(checkpoint: str | os.PathLike) -> dict[str, list[str] | None]:
    """{file: its tensor names (None until opened)} of a checkpoint: one weight file, an index
    (``*.index.json`` with a ``weight_map``, or a plain ``{name: file}`` json), or a folder holding
    an index or exactly one weight file (safetensors preferred)."""
    path = Path(checkpoint)
    if path.is_file():
        return _from_index(path) if path.suffix == ".json" else {str(path): None}
    if not path.is_dir():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
    indexes = sorted(path.glob("*.index.json"))
    plain = path / "index.json"  # a plain {name: file} index, unless it is an offload index
    if not indexes and plain.is_file() and _is_weight_map(_index_doc(plain)):
        indexes = [plain]
    if len(indexes) > 1:
        indexes = [p for p in indexes if "safetensors" in p.name][:1] or indexes[:1]
    if indexes:
        return _from_index(indexes[0])
    weights = sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    weights = [p for p in weights if p.suffix == ".safetensors"] or weights
    if not weights:
        found = sorted(p.name for p in path.iterdir())
        raise FileNotFoundError(
            f"No model weights in {path}: expected {SAFE_WEIGHTS_NAME}, {WEIGHTS_NAME} or an "
            f"index file ({SAFE_WEIGHTS_INDEX_NAME}); found {found or 'nothing'}."
        )
    if len(weights) > 1:
        raise ValueError(
            f"{str(path)!r} holds {len(weights)} weight files and no index: pass one file, or a "
            "folder with a '*.index.json' mapping each tensor name to its shard."
        )
    return {str(weights[0]): None}


def _index_doc(index_path: Path) -> dict[str, Any]:
    with open(index_path) as f:
        return json.load(f)


def _is_weight_map(data: Any) -> bool:
    """True for ``{"weight_map": {name: file}}`` or a plain ``{name: file}`` document (an
    offload folder's ``index.json`` maps names to dtype/shape records instead)."""
    weight_map = data.get("weight_map", data) if isinstance(data, Mapping) else None
    return isinstance(weight_map, Mapping) and all(isinstance(v, str) for v in weight_map.values())


def _from_index(index_path: Path) -> dict[str, list[str]]:
    data = _index_doc(index_path)
    weight_map = data.get("weight_map", data)
    if not _is_weight_map(data):
        raise ValueError(
            f"{index_path} is not a checkpoint index (no 'weight_map' of name -> file)."
        )
    files: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        files.setdefault(str(index_path.parent / shard), []).append(name)
    return files


_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6; older files are a bare pickle


def _load_torch_file(path: str) -> Mapping[str, torch.Tensor]:
    """A torch checkpoint file as name -> tensor. A zip file (every ``torch.save`` since torch
    1.6) is memory-mapped: its tensors are views of the file's private mapping, not copies. A
    legacy (pre-zip) file cannot be mapped and is read into memory. A file that cannot be read
    raises :class:`CorruptCheckpointError` naming it."""
    with open(path, "rb") as f:
        zipped = f.read(4) == _ZIP_MAGIC
    if not zipped:
        logger.debug("%s is a legacy (non-zip) torch file: read into memory, not mapped", path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except Exception as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CorruptCheckpointError(
            f"{path} cannot be read as a torch checkpoint ({type(err).__name__}: {reason}): "
            "the file is truncated or corrupt, or holds objects other than tensors. Download "
            "or save it again (as safetensors where possible)."
        ) from err
    if (
        isinstance(state, Mapping)
        and "state_dict" in state
        and isinstance(state["state_dict"], Mapping)
    ):
        state = state["state_dict"]
    if not isinstance(state, Mapping):
        raise ValueError(f"{path} does not hold a state dict (got {type(state).__name__}).")
    return state


def open_weights(path: str | os.PathLike) -> SafetensorsFile | Mapping[str, torch.Tensor]:
    """One weight file, opened: safetensors in place (header only, :class:`SafetensorsFile`),
    torch files memory-mapped unless they predate torch's zip format (a mapping name ->
    tensor)."""
    path = str(path)
    return SafetensorsFile(path) if path.endswith(".safetensors") else _load_torch_file(path)


def tie_record(checkpoint: str | os.PathLike) -> dict[str, str]:
    """The ``{dropped name: kept name}`` tie record of a checkpoint ({} when it has none)."""
    path = Path(checkpoint)
    if path.is_dir():
        indexes = sorted(path.glob("*.index.json"))
        if indexes:
            path = ([p for p in indexes if "safetensors" in p.name] or indexes)[0]
        else:
            names = (SAFE_WEIGHTS_NAME, WEIGHTS_NAME)
            path = next((path / n for n in names if (path / n).exists()), path)
    if path.suffix == ".json" and path.is_file():
        data = _index_doc(path)
        metadata = data.get("metadata") if "weight_map" in data else None
        return dict((metadata or {}).get("tied_weights", {}))
    tied = path.with_name(f"{path.name}.tied.json")
    return json.loads(tied.read_text()) if path.is_file() and tied.exists() else {}


def read_weights(
    checkpoint: str | os.PathLike,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a checkpoint (a folder with one file or an index, or one weight file), in
    memory, and its tie record."""
    checkpoint = Path(checkpoint)
    if checkpoint.suffix not in (*_WEIGHT_SUFFIXES, ".json"):
        recover(checkpoint)  # a folder save_model_weights was replacing when it was killed
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(checkpoint):
        handle = open_weights(path)
        if isinstance(handle, SafetensorsFile):
            tensors.update({k: handle.read(k) for k in handle.entries})
        else:
            tensors.update(handle)
    return tensors, tie_record(checkpoint)


def load_into_model(
    model: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str] | None = None,
    strict: bool = True,
) -> tuple[list[str], list[str]]:
    """Load ``tensors`` into ``model``; a tied name missing from ``tensors`` comes from its twin
    (the model's own ties and the ``aliases`` record, see the module docstring).

    Raises ``KeyError`` listing missing and unexpected names when ``strict``.
    """
    tensors = dict(tensors)
    expected = model.state_dict()
    twins = tied_twins(tie_groups(model), aliases)
    for name in expected:
        if name not in tensors:
            source = next((t for t in twins.get(name, ()) if t in tensors), None)
            if source is not None:
                tensors[name] = tensors[source]
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    if strict and (missing or unexpected):
        raise KeyError(
            f"Checkpoint does not match {type(model).__name__}: missing keys "
            f"{missing[:20]}{' ...' if len(missing) > 20 else ''}; unexpected keys "
            f"{unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}."
        )
    model.load_state_dict(tensors, strict=False)
    return missing, unexpected


def load_model_weights(
    model: torch.nn.Module, directory: str | os.PathLike, strict: bool = True
) -> tuple[list[str], list[str]]:
    """Load what :func:`save_model_weights` wrote into ``model``; return (missing, unexpected)."""
    tensors, aliases = read_weights(directory)
    return load_into_model(model, tensors, aliases, strict)
