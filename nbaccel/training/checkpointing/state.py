"""Training checkpoints: ``save_state`` / ``load_state`` of everything a run needs to resume.

A checkpoint directory holds the models (``model.safetensors``, ``model_1.safetensors``, ...),
optimizers (``optimizer.bin``, ...), schedulers, dataloader positions, the fp16 scaler,
registered objects, one RNG file per rank (``random_states_<rank>.pkl``) and a manifest
(``nbaccel_checkpoint.json``) written last, in Accelerate's layout
(:mod:`nbaccel.training.checkpointing.layout`): Accelerate resumes what nbaccel saved and nbaccel
resumes what Accelerate saved. Every process calls both functions.

The directory is built in a staging sibling and renamed into place (:mod:`nbaccel.storage.atomic`),
so a save killed half-way leaves the previous checkpoint loadable. Loading checks the manifest
first and names every missing file, rather than failing on the first one.

Model and optimizer state go through the accelerator's strategy
(:class:`~nbaccel.training.strategies.base.Strategy`): a strategy with its own checkpoint format
(FSDP) writes and reads the models and optimizers itself; otherwise this module writes the full
state dicts the strategy gives.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nbaccel.distributed.random import get_rng_states, set_rng_states
from nbaccel.distributed.state import PartialState
from nbaccel.storage.atomic import begin_staging, commit_staging, recover, staging_path
from nbaccel.storage.weights import read_weights, write_weights
from nbaccel.training.checkpointing.layout import accelerate_manifest, indexed_name, load_pickle
from nbaccel.training.strategies.base import Strategy

__all__ = ["CheckpointError", "Checkpointables", "load_checkpoint", "save_checkpoint"]

MANIFEST_NAME = "nbaccel_checkpoint.json"
FORMAT = "nbaccel-checkpoint"


class CheckpointError(FileNotFoundError):
    """A checkpoint directory is missing, partial, foreign or does not fit the prepared objects."""


@dataclass
class Checkpointables:
    """What ``save_state`` saves and ``load_state`` restores, in preparation order."""

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    dataloaders: list[Any] = field(default_factory=list)
    custom: list[Any] = field(default_factory=list)
    scaler: Any = None


_name = indexed_name


def _loader_file(loader: Any, index: int) -> str:
    """Accelerate's ``dl_state_dict.bin`` for a stateful loader, nbaccel's position file else."""
    stateful = getattr(loader, "use_stateful_dataloader", False)
    return _name("dl_state_dict" if stateful else "dataloader", index, "bin")


# -- save ---------------------------------------------------------------------------------------
def _is_writer(state: PartialState, save_on_each_node: bool) -> bool:
    return state.is_local_main_process if save_on_each_node else state.is_main_process


def save_checkpoint(
    output_dir: str | os.PathLike,
    objects: Checkpointables,
    strategy: Strategy,
    safe_serialization: bool = True,
    save_on_each_node: bool = False,
    pre_hooks: Sequence[Callable[..., None]] = (),
    extra: dict[str, Any] | None = None,
    step: int = 0,
) -> Path:
    """Write a checkpoint atomically into ``output_dir`` (every process must call this).

    ``strategy`` gives each model's and optimizer's full state dict (or writes them in its own
    format); ``extra`` goes in the manifest, ``step`` in the random states (Accelerate reads it).
    """
    state = PartialState()
    writer = _is_writer(state, save_on_each_node)
    final = Path(output_dir).absolute()
    staging = begin_staging(final) if writer else None
    state.wait_for_everyone()
    staging = staging or staging_path(final)
    own_format = strategy.sharded_checkpoints
    models = list(objects.models)
    weights = [] if own_format else [strategy.model_state_dict(m) for m in models]
    for hook in pre_hooks:
        hook(models, weights, str(staging))
    files: list[str] = []
    if own_format:
        files += strategy.save_sharded_checkpoint(objects, staging)
    else:
        optimizer_states = [
            strategy.optimizer_state_dict(opt, _model_for(opt, objects.models))
            for opt in objects.optimizers
        ]
    if writer:
        if not own_format:
            for i, sd in enumerate(weights):
                stem = "model" if safe_serialization else "pytorch_model"
                base = stem if i == 0 else f"{stem}_{i}"
                files += write_weights(sd, staging, "1000TB", safe_serialization, base_name=base)
            for i, sd in enumerate(optimizer_states):
                files.append(_save(sd, staging / _name("optimizer", i, "bin")))
        for i, sched in enumerate(objects.schedulers):
            files.append(_save(sched.state_dict(), staging / _name("scheduler", i, "bin")))
        for i, loader in enumerate(objects.dataloaders):
            if hasattr(loader, "state_dict"):
                files.append(_save(loader.state_dict(), staging / _loader_file(loader, i)))
        if objects.scaler is not None:
            files.append(_save(objects.scaler.state_dict(), staging / "scaler.pt"))
        for i, obj in enumerate(objects.custom):
            files.append(_save(obj.state_dict(), staging / f"custom_checkpoint_{i}.pkl"))
    _save(get_rng_states(step), staging / f"random_states_{state.process_index}.pkl")
    state.wait_for_everyone()
    if writer:
        manifest = {
            "format": FORMAT,
            "version": 1,
            "num_processes": state.num_processes,
            "models": len(models) if own_format else len(weights),
            "optimizers": len(objects.optimizers),
            "schedulers": len(objects.schedulers),
            "dataloaders": sum(hasattr(d, "state_dict") for d in objects.dataloaders),
            "custom_objects": len(objects.custom),
            "scaler": objects.scaler is not None,
            "step": step,
            "safe_serialization": safe_serialization,
            "files": sorted(files),
            **(extra or {}),
        }
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
        commit_staging(final)
    state.wait_for_everyone()
    return final


def _save(obj: Any, path: Path) -> str:
    torch.save(obj, path)
    return path.name


# -- load ---------------------------------------------------------------------------------------
_load = load_pickle


def _wanted(objects: Checkpointables) -> dict[str, int]:
    return {
        "models": len(objects.models),
        "optimizers": len(objects.optimizers),
        "schedulers": len(objects.schedulers),
        "custom_objects": len(objects.custom),
    }


def read_manifest(input_dir: Path, objects: Checkpointables | None = None) -> dict[str, Any]:
    """The manifest of a checkpoint (one stood in for a folder Accelerate wrote, checked against
    ``objects``), or a ``CheckpointError`` saying what is wrong."""
    if not input_dir.is_dir():
        raise CheckpointError(f"No checkpoint at {input_dir}: the directory does not exist.")
    present = sorted(p.name for p in input_dir.iterdir())
    path = input_dir / MANIFEST_NAME
    if not path.exists():
        try:
            foreign = accelerate_manifest(input_dir, _wanted(objects or Checkpointables()))
        except FileNotFoundError as exc:
            raise CheckpointError(str(exc)) from None
        if foreign is not None:
            return foreign
        raise CheckpointError(
            f"{input_dir} is not a complete checkpoint: {MANIFEST_NAME} is missing (it is "
            "written last by Accelerator.save_state) and there are no model or random_states "
            f"files of one Accelerate wrote. Found: {present or 'nothing'}."
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an nbaccel checkpoint manifest.")
    missing = [name for name in manifest["files"] if name not in present]
    if missing:
        raise CheckpointError(
            f"Checkpoint {input_dir} is incomplete: missing {missing}. Found: {present}."
        )
    return manifest


def _check_counts(manifest: dict[str, Any], objects: Checkpointables, input_dir: Path) -> None:
    wanted = _wanted(objects)
    wrong = [
        f"{manifest[k]} {k} saved but {v} to restore" for k, v in wanted.items() if manifest[k] != v
    ]
    if wrong:
        raise CheckpointError(
            f"Checkpoint {input_dir} does not fit this Accelerator: {'; '.join(wrong)}. Prepare "
            "(and register_for_checkpointing) the same objects, in the same order, as when saving."
        )


def load_checkpoint(
    input_dir: str | os.PathLike,
    objects: Checkpointables,
    strategy: Strategy,
    pre_hooks: Sequence[Callable[..., None]] = (),
    strict: bool = True,
) -> dict[str, Any]:
    """Restore ``objects`` from a checkpoint written by :func:`save_checkpoint`."""
    state = PartialState()
    input_dir = Path(input_dir).absolute()
    if state.is_local_main_process:
        recover(input_dir)
    state.wait_for_everyone()
    manifest = read_manifest(input_dir, objects)
    models = list(objects.models)
    for hook in pre_hooks:
        hook(models, str(input_dir))
    if len(models) == len(objects.models):  # hooks that load models themselves remove them
        _check_counts(manifest, objects, input_dir)
    if strategy.sharded_checkpoints:
        strategy.load_sharded_checkpoint(objects, input_dir)
    else:
        safe = manifest["safe_serialization"]
        stem = "model" if safe else "pytorch_model"
        for i, model in enumerate(models):
            tensors, aliases = _read_model(input_dir, stem if i == 0 else f"{stem}_{i}", safe)
            strategy.load_model_state_dict(model, tensors, aliases, strict)
        for i, opt in enumerate(objects.optimizers):
            sd = _load(input_dir / _name("optimizer", i, "bin"))
            strategy.load_optimizer_state_dict(opt, sd, _model_for(opt, objects.models))
    for i, sched in enumerate(objects.schedulers):
        sched.load_state_dict(_load(input_dir / _name("scheduler", i, "bin")))
    for i, loader in enumerate(objects.dataloaders):
        if not hasattr(loader, "load_state_dict"):
            continue
        for name in (_loader_file(loader, i), _name("dataloader", i, "bin")):
            if (input_dir / name).exists():  # (earlier nbaccel checkpoints: dataloader_<i>.bin)
                loader.load_state_dict(_load(input_dir / name))
                break
    if objects.scaler is not None and (input_dir / "scaler.pt").exists():
        objects.scaler.load_state_dict(_load(input_dir / "scaler.pt"))
    for i, obj in enumerate(objects.custom):
        obj.load_state_dict(_load(input_dir / f"custom_checkpoint_{i}.pkl", trusted=True))
    rng_path = input_dir / f"random_states_{state.process_index}.pkl"
    if rng_path.exists():
        set_rng_states(_load(rng_path))
    else:
        warnings.warn(
            f"{rng_path.name} is not in the checkpoint (saved with {manifest['num_processes']} "
            f"processes, loading with {state.num_processes}): random states not restored.",
            stacklevel=2,
        )
    return manifest


def _read_model(input_dir: Path, base: str, safe: bool) -> tuple[dict, dict]:
    """The tensors of one model of a checkpoint and its tie record."""
    path = input_dir / f"{base}.{'safetensors' if safe else 'bin'}"
    if not path.exists():
        raise CheckpointError(f"Checkpoint {input_dir} has no weights file {path.name}.")
    return read_weights(path)


def _model_for(optimizer: Any, models: Sequence[torch.nn.Module]) -> torch.nn.Module | None:
    """The prepared model whose parameters ``optimizer`` updates (FSDP needs the pair)."""
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if any(id(p) in owned for p in model.parameters()):
            return model
    return models[0] if models else None
