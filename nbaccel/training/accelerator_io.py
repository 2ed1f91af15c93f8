"""The persistence half of ``Accelerator``: checkpoints, model saving, state dicts.

Mixed into :class:`nbaccel.Accelerator`; the work is done by :mod:`nbaccel.training.checkpoint`,
:mod:`nbaccel.storage.weights` and the accelerator's strategy (state dicts, unwrapping).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from nbaccel.storage.weights import save_model_weights, write_safetensors
from nbaccel.training.checkpoint import Checkpointables, load_checkpoint, save_checkpoint

__all__ = ["StateIOMixin"]


class StateIOMixin:
    """save_state / load_state / save_model and friends, over the accelerator's prepared objects."""

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile=True
    ) -> torch.nn.Module:
        """The user's module inside the wrappers ``prepare`` added."""
        return self.strategy.unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The full state dict of a prepared model (gathered under FSDP: call on every rank)."""
        return self.strategy.model_state_dict(model, unwrap)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Save weights as safetensors shards + index (written by the main process, atomically).
        Weights a dispatched model keeps offloaded on cpu/disk are read back module by module."""
        from nbaccel.bigmodel.align_devices_hook import (
            get_state_dict_offloaded_model,
            has_offloaded_params,
        )

        if any(has_offloaded_params(m) for m in model.modules()):
            state_dict = get_state_dict_offloaded_model(model)
        else:
            state_dict = self.get_state_dict(model)
        if self.is_main_process:
            save_model_weights(state_dict, save_directory, max_shard_size, safe_serialization)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """``torch.save`` once per machine (or per node), atomically."""
        writer = (
            self.is_local_main_process
            if self.project_configuration.save_on_each_node
            else self.is_main_process
        )
        if not writer:
            return
        f = Path(f)
        tmp = f.with_name(f".{f.name}.partial")
        if safe_serialization:
            write_safetensors(obj, tmp)
        else:
            torch.save(obj, tmp)
        os.replace(tmp, f)

    # -- checkpoints --------------------------------------------------------------------------
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Also save/restore these objects (each needs ``state_dict`` and ``load_state_dict``)."""
        bad = [
            f"Item at index {i} ({type(o).__name__})"
            for i, o in enumerate(objects)
            if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))
        ]
        if bad:
            raise ValueError(
                f"{'; '.join(bad)}: register_for_checkpointing needs objects with "
                "state_dict() and load_state_dict()."
            )
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs in ``save_state`` before writing."""
        handle = RemovableHandle(self._save_model_state_pre_hook)
        self._save_model_state_pre_hook[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, input_dir)`` runs in ``load_state`` before reading."""
        handle = RemovableHandle(self._load_model_state_pre_hook)
        self._load_model_state_pre_hook[handle.id] = hook
        return handle

    def _checkpointables(self) -> Checkpointables:
        return Checkpointables(
            models=list(self._models),
            optimizers=list(self._optimizers),
            schedulers=list(self._schedulers),
            dataloaders=list(self._dataloaders),
            custom=list(self._custom_objects),
            scaler=self.scaler,
        )

    def _checkpoints_dir(self) -> Path:
        if self.project_dir is None:
            raise ValueError(
                "automatic_checkpoint_naming needs a project_dir (Accelerator(project_dir=...))."
            )
        return Path(self.project_dir) / "checkpoints"

    def save_state(
        self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True, **_
    ) -> str:
        """Save models, optimizers, schedulers, scaler, RNG states, dataloader positions and
        registered objects (every process calls it). Returns the checkpoint directory."""
        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            output_dir = self._checkpoints_dir() / f"checkpoint_{config.iteration}"
            if output_dir.exists():
                raise ValueError(
                    f"Checkpoint {output_dir} already exists; set "
                    "project_configuration.iteration past it to keep it."
                )
        elif output_dir is None:
            raise ValueError("save_state needs output_dir (or automatic_checkpoint_naming).")
        final = save_checkpoint(
            output_dir,
            self._checkpointables(),
            self.strategy,
            safe_serialization=safe_serialization,
            save_on_each_node=config.save_on_each_node,
            pre_hooks=list(self._save_model_state_pre_hook.values()),
            extra={"step": self.step},
            step=self.step,
        )
        if config.automatic_checkpoint_naming:
            if config.total_limit is not None and self.is_main_process:
                _prune(self._checkpoints_dir(), config.total_limit)
            self.wait_for_everyone()
            config.iteration += 1
        return str(final)

    def load_state(
        self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None, **kw
    ) -> None:
        """Restore what ``save_state`` wrote (every process calls it)."""
        config = self.project_configuration
        if input_dir is None:
            if not config.automatic_checkpoint_naming:
                raise ValueError("load_state needs input_dir (or automatic_checkpoint_naming).")
            found = _numbered(self._checkpoints_dir())
            if not found:
                raise FileNotFoundError(f"No checkpoint_<n> folder in {self._checkpoints_dir()}.")
            input_dir = found[-1][1]
        manifest = load_checkpoint(
            input_dir,
            self._checkpointables(),
            self.strategy,
            pre_hooks=list(self._load_model_state_pre_hook.values()),
            strict=kw.get("strict", True),
        )
        self.step = int(manifest.get("step", 0))
        match = re.fullmatch(r"checkpoint_(\d+)", Path(input_dir).name)
        if config.automatic_checkpoint_naming and match:
            config.iteration = int(match.group(1)) + 1


def _numbered(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = re.fullmatch(r"checkpoint_(\d+)", path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _prune(directory: Path, total_limit: int) -> None:
    found = _numbered(directory)
    for _number, path in found[: max(len(found) - total_limit, 0)]:
        shutil.rmtree(path, ignore_errors=True)
