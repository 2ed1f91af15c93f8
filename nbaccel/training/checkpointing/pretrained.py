"""``model.save_pretrained(...)`` on a model whose weights are sharded over the ranks (FSDP2,
tensor parallel): the prepared model's own ``save_pretrained`` would write each rank's shards (or
read freed storage). It is replaced, on that model only, by one that gathers the full state dict
(a collective: every rank calls it, as in Accelerate's examples) and lets the main process alone
write the files with the model's original method."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["gather_on_save_pretrained"]


def gather_on_save_pretrained(
    model: torch.nn.Module,
    state_dict_of: Callable[[torch.nn.Module], dict[str, Any]],
    is_main_process: bool,
) -> None:
    """Give ``model`` (when it has ``save_pretrained``) a ``save_pretrained`` that writes the
    gathered full weights from the main process. Without ``state_dict=`` every rank gathers (call
    it on every rank); with one (``accelerator.get_state_dict(model)``, already gathered) no rank
    communicates and only the main process writes."""
    original = getattr(model, "save_pretrained", None)
    if original is None or getattr(original, "_nbaccel_gathers", False):
        return

    @functools.wraps(original)
    def save_pretrained(save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        state_dict = kwargs.pop("state_dict", None)
        if state_dict is None:
            state_dict = state_dict_of(model)  # collective: the same call on every rank
        kwargs.pop("is_main_process", None)
        if not is_main_process:
            return None
        kwargs.update(state_dict=state_dict, is_main_process=True)
        return original(save_directory, *args, **kwargs)

    save_pretrained._nbaccel_gathers = True  # type: ignore[attr-defined]
    model.save_pretrained = save_pretrained
