"""The Accelerator's checkpoints: what ``save_state``/``load_state`` cover beyond the prepared
objects (registered objects, pre-hooks), where numbered checkpoints go and how many are kept.
Each :class:`~nbaccel.Accelerator` holds one; the writing itself is
:mod:`nbaccel.training.checkpointing.state`'s (atomic: an interrupted save leaves the previous one).
"""

from __future__ import annotations

import os
import re
import shutil
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.hooks import RemovableHandle

from nbaccel.training.checkpointing.state import Checkpointables, load_checkpoint, save_checkpoint
from nbaccel.training.config.configuration import ProjectConfiguration

__all__ = ["Checkpointing"]


class Checkpointing:
    """Registered objects and hooks, and the project's checkpoint naming."""

    def __init__(self, config: ProjectConfiguration, state: Any) -> None:
        self.config = config
        self.state = state  # is_main_process, wait_for_everyone
        self.custom_objects: list[Any] = []
        self.save_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self.load_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()

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
        self.custom_objects.extend(objects)

    def register_save_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs in ``save_state`` before writing."""
        handle = RemovableHandle(self.save_hooks)
        self.save_hooks[handle.id] = hook
        return handle

    def register_load_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, input_dir)`` runs in ``load_state`` before reading."""
        handle = RemovableHandle(self.load_hooks)
        self.load_hooks[handle.id] = hook
        return handle

    def _checkpoints_dir(self) -> Path:
        if self.config.project_dir is None:
            raise ValueError(
                "automatic_checkpoint_naming needs a project_dir (Accelerator(project_dir=...))."
            )
        return Path(self.config.project_dir) / "checkpoints"

    def save(
        self,
        output_dir: str | os.PathLike | None,
        objects: Checkpointables,
        strategy: Any,
        step: int,
        safe_serialization: bool = True,
    ) -> str:
        """Write a checkpoint of ``objects`` (and the registered ones); its directory."""
        config = self.config
        if config.automatic_checkpoint_naming:
            output_dir = self._checkpoints_dir() / f"checkpoint_{config.iteration}"
            if output_dir.exists():
                raise ValueError(
                    f"Checkpoint {output_dir} already exists; set "
                    "project_configuration.iteration past it to keep it."
                )
        elif output_dir is None:
            raise ValueError("save_state needs output_dir (or automatic_checkpoint_naming).")
        objects.custom = list(self.custom_objects)
        final = save_checkpoint(
            output_dir,
            objects,
            strategy,
            safe_serialization=safe_serialization,
            save_on_each_node=config.save_on_each_node,
            pre_hooks=list(self.save_hooks.values()),
            extra={"step": step},
            step=step,
        )
        if config.automatic_checkpoint_naming:
            if config.total_limit is not None and self.state.is_main_process:
                _prune(self._checkpoints_dir(), config.total_limit)
            self.state.wait_for_everyone()
            config.iteration += 1
        return str(final)

    def load(
        self,
        input_dir: str | os.PathLike | None,
        objects: Checkpointables,
        strategy: Any,
        strict: bool = True,
    ) -> int:
        """Restore what :meth:`save` wrote into ``objects``; the step it was saved at."""
        config = self.config
        if input_dir is None:
            if not config.automatic_checkpoint_naming:
                raise ValueError("load_state needs input_dir (or automatic_checkpoint_naming).")
            found = _numbered(self._checkpoints_dir())
            if not found:
                raise FileNotFoundError(f"No checkpoint_<n> folder in {self._checkpoints_dir()}.")
            input_dir = found[-1][1]
        objects.custom = list(self.custom_objects)
        manifest = load_checkpoint(
            input_dir, objects, strategy, pre_hooks=list(self.load_hooks.values()), strict=strict
        )
        match = re.fullmatch(r"checkpoint_(\d+)", Path(input_dir).name)
        if config.automatic_checkpoint_naming and match:
            config.iteration = int(match.group(1)) + 1
        return int(manifest.get("step", 0))


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
