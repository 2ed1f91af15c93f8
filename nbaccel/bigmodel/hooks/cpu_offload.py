"""Whole-model CPU offload: the model lives on CPU and moves to the execution device when it is
called (what :func:`~nbaccel.bigmodel.dispatch.cpu_offload_with_hook` installs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nbaccel.bigmodel.hooks.model_hook import ModelHook, remove_hook_from_module
from nbaccel.bigmodel.placement import to_torch_device
from nbaccel.distributed.collectives import send_to_device

__all__ = [
    "CpuOffload",
    "UserCpuOffloadHook",
]


class CpuOffload(ModelHook):
    """Keep the whole model on CPU and move it to ``execution_device`` when it is called; it stays
    there until ``offload`` (or the next model's forward, through ``prev_module_hook``)."""

    def __init__(
        self,
        execution_device: int | str | torch.device | None = None,
        prev_module_hook: UserCpuOffloadHook | None = None,
    ):
        if execution_device is None:
            execution_device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self.execution_device = to_torch_device(execution_device)
        self.prev_module_hook = prev_module_hook
        self.on_execution_device = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        self.on_execution_device = False
        return module.to("cpu")

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
        if not self.on_execution_device:
            module.to(self.execution_device)
            self.on_execution_device = True
        return send_to_device(args, self.execution_device), send_to_device(
            kwargs, self.execution_device
        )


class UserCpuOffloadHook:
    """What :func:`cpu_offload_with_hook` returns: ``offload()`` sends the model back to CPU,
    ``remove()`` removes the hook."""

    def __init__(self, model: nn.Module, hook: CpuOffload):
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        remove_hook_from_module(self.model)
