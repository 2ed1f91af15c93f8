"""Checkpoints of FSDP2-sharded models and their optimizers, and merging sharded checkpoints.

Two formats, chosen by ``FullyShardedDataParallelPlugin.state_dict_type``:

- ``SHARDED_STATE_DICT``: ``torch.distributed.checkpoint`` (dcp) directories
  ``pytorch_model_fsdp_{i}/`` and ``optimizer_{i}/``; every rank writes its own shard (``.distcp``
  files), nothing is gathered. Loading reshards, so the world size may change between save and load.
- ``FULL_STATE_DICT``: the full state is gathered on rank 0 (on CPU) and written there as
  ``pytorch_model_fsdp_{i}.bin`` / ``optimizer_{i}.bin`` (``torch.save``); loading reads it on
  rank 0 and broadcasts it into the shards.

Loaders look at what is on disk (a directory or a file), so either format loads whatever the
plugin says. ``merge_fsdp_weights`` turns a sharded model directory into one safetensors file
that a plain ``nn.Module`` loads.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nbaccel.distributed.state import AcceleratorState
from nbaccel.storage.weights import write_safetensors

__all__ = [
    "find_model_for_optimizer",
    "get_fsdp_state_dict",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "load_fsdp_state",
    "merge_fsdp_weights",
    "save_fsdp_model",
    "save_fsdp_optimizer",
    "save_fsdp_state",
]

MODEL_NAME = "pytorch_model_fsdp"
OPTIMIZER_NAME = "optimizer"


def _is_sharded(plugin: Any) -> bool:
    return getattr(plugin, "state_dict_type", "FULL_STATE_DICT") == "SHARDED_STATE_DICT"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _options(full: bool, **extra: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full, **extra)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)


def _module(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)


def get_fsdp_state_dict(model: nn.Module, full_state_dict: bool = True) -> dict[str, Any]:
    """The model's state dict: full tensors on CPU on rank 0 (``{}`` elsewhere), or DTensor shards.

    Every rank must call it (the full state is all-gathered).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(_module(model), options=_options(full_state_dict))


def find_model_for_optimizer(optimizer: Any, models: nn.Module | Iterable[nn.Module]) -> nn.Module:
    """The model whose parameters ``optimizer`` updates (checkpoints need the pair)."""
    models = [models] if isinstance(models, nn.Module) else list(models)
    ids = {id(p) for g in _inner(optimizer).param_groups for p in g["params"]}
    for model in models:
        if any(id(p) in ids for p in model.parameters()):
            return model
    raise ValueError(
        "None of the prepared models owns this optimizer's parameters; pass the model the "
        "optimizer was built for (after accelerator.prepare)."
    )


# -- model --------------------------------------------------------------------------------------
def save_fsdp_model(
    plugin: Any, model: nn.Module, output_dir: str | os.PathLike, model_index: int = 0
) -> str:
    """Save ``model`` into ``output_dir`` in the plugin's format; returns the path written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    output_dir = Path(output_dir)
    if _is_sharded(plugin):
        path = output_dir / f"{MODEL_NAME}_{model_index}"
        state = {"model": get_model_state_dict(_module(model))}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))
        return str(path)
    path = output_dir / f"{MODEL_NAME}_{model_index}.bin"
    state = get_fsdp_state_dict(model, full_state_dict=True)
    return _save_full_on_rank0(state, path)


def load_fsdp_model(
    plugin: Any, model: nn.Module, input_dir: str | os.PathLike, model_index: int = 0
) -> None:
    """Load what ``save_fsdp_model`` wrote (sharded directory or full file) into ``model``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    module = _module(model)
    sharded_path, full_path = _saved(input_dir, MODEL_NAME, model_index, "model checkpoint")
    if sharded_path is not None:
        state = {"model": get_model_state_dict(module)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(sharded_path)))
        set_model_state_dict(module, state["model"])
        return
    state = torch.load(full_path, map_location="cpu", weights_only=True) if _rank() == 0 else {}
    _check_keys(module, state)
    set_model_state_dict(module, state, options=_options(True, broadcast_from_rank0=True))


def _check_keys(module: nn.Module, state: dict[str, Any]) -> None:
    """Rank 0 compares the file's keys with the model's; every rank raises the same error."""
    problem = None
    if _rank() == 0:
        expected = set(module.state_dict().keys())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            problem = f"missing keys: {missing}; unexpected keys: {unexpected}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise KeyError(f"The FSDP checkpoint does not match the model: {problem}.")


# -- optimizer ----------------------------------------------------------------------------------
def save_fsdp_optimizer(
    plugin: Any,
    optimizer: Any,
    model: nn.Module,
    output_dir: str | os.PathLike,
    optimizer_index: int = 0,
) -> str:
    """Save the optimizer of the FSDP ``model`` in the plugin's format; returns the path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    output_dir = Path(output_dir)
    module, inner = _module(model), _inner(optimizer)
    if _is_sharded(plugin):
        path = output_dir / f"{OPTIMIZER_NAME}_{optimizer_index}"
        state = {"optimizer": get_optimizer_state_dict(module, inner)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))
        return str(path)
    path = output_dir / f"{OPTIMIZER_NAME}_{optimizer_index}.bin"
    state = get_optimizer_state_dict(module, inner, options=_options(True))
    return _save_full_on_rank0(state, path)


def load_fsdp_optimizer(
    plugin: Any,
    optimizer: Any,
    model: nn.Module,
    input_dir: str | os.PathLike,
    optimizer_index: int = 0,
) -> None:
    """Load what ``save_fsdp_optimizer`` wrote into ``optimizer`` (resharding as needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    module, inner = _module(model), _inner(optimizer)
    sharded_path, full_path = _saved(
        input_dir, OPTIMIZER_NAME, optimizer_index, "optimizer checkpoint"
    )
    if sharded_path is not None:
        state = {"optimizer": get_optimizer_state_dict(module, inner)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(sharded_path)))
        set_optimizer_state_dict(module, inner, state["optimizer"])
        return
    state = torch.load(full_path, map_location="cpu", weights_only=True) if _rank() == 0 else {}
    set_optimizer_state_dict(
        module, inner, state, options=_options(True, broadcast_from_rank0=True)
    )


# -- the Accelerator's seam -------------------------------------------------------------------
def _plugin(plugin: Any) -> Any:
    if plugin is not None:
        return plugin
    state = AcceleratorState.current()
    return None if state is None else state.fsdp_plugin


def save_fsdp_state(objects: Any, output_dir: str | os.PathLike, plugin: Any = None) -> list[str]:
    """Save every prepared model and optimizer of ``objects`` (``.models``, ``.optimizers``).

    Called by ``save_state`` on every rank with the (shared) staging directory; returns the
    names written there, for the checkpoint manifest. Optimizer ``i`` is saved with the model
    that owns its parameters.
    """
    plugin = _plugin(plugin)
    names = []
    for i, model in enumerate(objects.models):
        names.append(Path(save_fsdp_model(plugin, model, output_dir, i)).name)
    for i, optimizer in enumerate(objects.optimizers):
        model = find_model_for_optimizer(optimizer, objects.models)
        names.append(Path(save_fsdp_optimizer(plugin, optimizer, model, output_dir, i)).name)
    return names


def load_fsdp_state(objects: Any, input_dir: str | os.PathLike, plugin: Any = None) -> None:
    """Restore what :func:`save_fsdp_state` wrote (either format) into ``objects``."""
    plugin = _plugin(plugin)
    for i, model in enumerate(objects.models):
        load_fsdp_model(plugin, model, input_dir, i)
    for i, optimizer in enumerate(objects.optimizers):
        model = find_model_for_optimizer(optimizer, objects.models)
        load_fsdp_optimizer(plugin, optimizer, model, input_dir, i)


# -- merging ------------------------------------------------------------------------------------
def _read_dcp_tensors(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a dcp checkpoint, full size, on CPU, in this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(checkpoint_dir)
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # loading in one process is the point here, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def merge_fsdp_weights(
    checkpoint_dir: str | os.PathLike,
    output_path: str | os.PathLike,
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> str:
    """Merge a sharded (dcp) FSDP model checkpoint into one full weights file.

    ``checkpoint_dir`` is a ``pytorch_model_fsdp_{i}`` directory written with
    ``SHARDED_STATE_DICT``. The result, ``output_path/model.safetensors`` (or
    ``pytorch_model.bin`` with ``safe_serialization=False``; a path ending in ``.safetensors`` or
    ``.bin`` is used as the file name), loads into the plain model with ``load_state_dict``.
    Runs in one process; inside a distributed run only rank 0 works and the others wait.
    Returns the written file's path.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / ".metadata").is_file():
        raise FileNotFoundError(
            f"{checkpoint_dir} is not a torch.distributed.checkpoint directory (no .metadata): "
            "pass the pytorch_model_fsdp_N folder written with "
            "state_dict_type='SHARDED_STATE_DICT'."
        )
    output_path = Path(output_path)
    if output_path.suffix in (".safetensors", ".bin"):
        target = output_path
    else:
        target = output_path / ("model.safetensors" if safe_serialization else "pytorch_model.bin")
    if _rank() == 0:
        state = _read_dcp_tensors(str(checkpoint_dir))
        if state and all(k.startswith("model.") for k in state):
            state = {k[len("model.") :]: v for k, v in state.items()}
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.suffix == ".safetensors":
            write_safetensors(state, target)
        else:
            torch.save(state, target)
        if remove_checkpoint_dir:
            shutil.rmtree(checkpoint_dir)
    _barrier()
    return str(target)


def _save_full_on_rank0(state: dict, path: Path) -> str:
    """Write a gathered (full) state dict from rank 0 only; every rank waits for it."""
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
    _barrier()
    return str(path)


def _saved(
    input_dir: str | os.PathLike, stem: str, index: int, what: str
) -> tuple[Path | None, Path]:
    """Where ``save_fsdp_*`` put item ``index``: its sharded folder (None when it was saved as
    one file) and its full file; neither there is a FileNotFoundError naming both."""
    sharded = Path(input_dir) / f"{stem}_{index}"
    full = Path(input_dir) / f"{stem}_{index}.bin"
    if sharded.is_dir():
        return sharded, full
    if not full.is_file():
        raise FileNotFoundError(
            f"No FSDP {what} {index} in {input_dir}: expected {sharded.name}/ "
            f"(SHARDED_STATE_DICT) or {full.name} (FULL_STATE_DICT)."
        )
    return None, full
