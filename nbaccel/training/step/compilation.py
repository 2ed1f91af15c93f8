"""How ``Accelerator.prepare`` compiles a model: ``dynamo_backend=`` or a ``TorchDynamoPlugin``
(its backend, mode, fullgraph, dynamic, options and ``use_regional_compilation``), or the
launcher's ``ACCELERATE_DYNAMO_*`` variables. Every field is applied; none is read and dropped.
Plus the one line that says what a prepared model runs with (precision and compilation)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from nbaccel.training.step.compile_regions import compile_regions, compile_regions_fsdp2
from nbaccel.values.booleans import env_flag

__all__ = ["Compilation", "describe_run"]


def _backend_name(value: Any) -> str:
    name = str(getattr(value, "value", value) or "no").lower()
    return "no" if name in ("", "none") else name


class Compilation:
    """The compile settings of one accelerator.

    Args:
        dynamo_backend: ``Accelerator(dynamo_backend=...)`` (wins over the plugin's backend).
        plugin: a ``TorchDynamoPlugin`` (or a dict of its fields), or None (then the launcher's
            ``ACCELERATE_DYNAMO_BACKEND`` / ``..._USE_REGIONAL_COMPILATION`` variables).
    """

    def __init__(self, dynamo_backend: Any = None, plugin: Any = None) -> None:
        get = plugin.get if isinstance(plugin, dict) else lambda k, d=None: getattr(plugin, k, d)
        env = os.environ.get
        self.backend = _backend_name(
            dynamo_backend
            or (get("backend") if plugin is not None else None)
            or env("ACCELERATE_DYNAMO_BACKEND")
        )
        regional = get("use_regional_compilation") if plugin is not None else None
        if regional is None:
            regional = env_flag("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION")
        self.regional = bool(regional)
        self.options: dict[str, Any] = {}
        if plugin is not None:
            for key in ("mode", "fullgraph", "dynamic", "options", "disable"):
                value = get(key)
                if value is not None and not (key == "disable" and value is False):
                    self.options[key] = value
            if self.options.get("options") is not None and "mode" in self.options:
                # torch.compile takes one of the two: explicit options win over the mode name
                self.options.pop("mode")
        self.regions = 0

    @property
    def enabled(self) -> bool:
        return self.backend != "no"

    def apply(self, model: nn.Module, sharded: bool = False) -> nn.Module:
        """``model`` compiled as asked (unchanged when no backend is set). Regional compilation
        compiles each block of a repeated stack; on a sharded model (FSDP2) in place, so the
        sharding hooks stay on the original modules."""
        if not self.enabled:
            return model
        kwargs = {"backend": self.backend, **self.options}
        if not self.regional:
            return torch.compile(model, **kwargs)
        inner = getattr(model, "module", model) if not sharded else model
        if sharded or inner is not model:
            compile_regions_fsdp2(inner, **kwargs)
            compiled = model
        else:
            compiled = compile_regions(model, **kwargs)
        self.regions = sum(
            isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
            or "_compiled_call_impl" in vars(m)
            and m._compiled_call_impl is not None
            for m in compiled.modules()
        )
        return compiled

    def describe(self) -> str:
        """``"no"``, ``"inductor"`` or ``"inductor, regional (2 regions)"``."""
        if not self.enabled:
            return "no"
        if self.regional:
            return f"{self.backend}, regional ({self.regions} regions)"
        return f"{self.backend}, whole model"


def describe_run(precision: Any, model: nn.Module, compilation: Compilation) -> str:
    """What a prepared model trains with, e.g. ``"precision fp8 (torchao Float8Linear: 12
    layers; autocast no); compile inductor, regional (2 regions)"``."""
    name = getattr(precision, "name", "no")
    text = f"precision {name}"
    if name == "fp8":
        count = precision.fp8_layer_count(model)
        engine = "torchao Float8Linear" if precision.backend == "AO" else "Transformer Engine"
        text += f" ({engine}: {count} layers; autocast {precision.mode})"
    return f"{text}; compile {compilation.describe()}"
