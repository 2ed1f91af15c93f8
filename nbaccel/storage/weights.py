"""Model weights on disk: safetensors (or torch) shards plus an index, tied weights saved once.

The layout is the one the Hugging Face ecosystem reads: ``model.safetensors`` for one shard, or
``model-00001-of-0000N.safetensors`` files plus ``model.safetensors.index.json`` (``weight_map``:
parameter name -> file). Parameters that share storage (tied embeddings) are written once; the
extra names are recorded in the index metadata and come back by themselves when the model ties
them again. Writes go through a staging directory (:mod:`nbaccel.storage.atomic`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nbaccel.storage.atomic import begin_staging, commit_staging, recover

__all__ = [
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "drop_tied_aliases",
    "load_model_weights",
    "parse_size",
    "read_weights",
    "save_model_weights",
    "shard_state_dict",
]

WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_WEIGHT_FILE = re.compile(
    r"^(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$"
)
_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


def parse_size(size: int | str) -> int:
    """``"10GB"`` -> 10_000_000_000, ``"5MiB"`` -> 5_242_880; ints pass through."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if not match:
        raise ValueError(f"Cannot read size {size!r}: use an int or e.g. '10GB', '500MB', '2GiB'.")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())


def drop_tied_aliases(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict, dict[str, str]]:
    """Keep one name per shared tensor; return (state dict, {dropped name: kept name})."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    storages: set[tuple[Any, int]] = set()
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
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
    limit = parse_size(max_shard_size)
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


def _write(tensors: dict[str, torch.Tensor], path: Path, safe: bool) -> None:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    if safe:
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata={"format": "pt"})
    else:
        torch.save(tensors, path)


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


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def read_weights(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor saved in ``directory`` (one file or an index) and its tied-name record."""
    directory = Path(directory)
    recover(directory)
    for index_name in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
        if (directory / index_name).exists():
            doc = json.loads((directory / index_name).read_text())
            tensors: dict[str, torch.Tensor] = {}
            for name in sorted(set(doc["weight_map"].values())):
                tensors.update(_read_file(directory / name))
            return tensors, doc.get("metadata", {}).get("tied_weights", {})
    for name in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME):
        if (directory / name).exists():
            tied = directory / f"{name}.tied.json"
            aliases = json.loads(tied.read_text()) if tied.exists() else {}
            return _read_file(directory / name), aliases
    found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    raise FileNotFoundError(
        f"No model weights in {directory}: expected {SAFE_WEIGHTS_NAME}, {WEIGHTS_NAME} or an "
        f"index file ({SAFE_WEIGHTS_INDEX_NAME}); found {found or 'nothing'}."
    )


def load_into_model(
    model: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str] | None = None,
    strict: bool = True,
) -> tuple[list[str], list[str]]:
    """Load ``tensors`` into ``model``; tied names come back from their kept twin.

    Raises ``KeyError`` listing missing and unexpected names when ``strict``.
    """
    tensors = dict(tensors)
    expected = model.state_dict()
    for alias, kept in (aliases or {}).items():
        if alias in expected and alias not in tensors and kept in tensors:
            tensors[alias] = tensors[kept]
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
