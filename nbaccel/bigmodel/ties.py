"""Tied parameters: groups of names that share one Parameter object, and re-tying them."""

from __future__ import annotations

from torch import nn

from nbaccel.bigmodel.planning.module_sizes import modules_preorder
from nbaccel.storage.ties import tie_groups

__all__ = [
    "find_tied_parameters",
    "retie_parameters",
]


def find_tied_parameters(model: nn.Module, **kwargs: object) -> list[list[str]]:
    """Groups of parameter names that share one Parameter object, e.g. ``[["embed.weight",
    "lm_head.weight"]]``. One pass over the modules."""
    return tie_groups(model, modules_preorder(model))


def retie_parameters(model: nn.Module, tied_params: list[list[str]]) -> None:
    """Make every name in each group point at the first name's Parameter again."""
    for group in tied_params:
        source = model.get_parameter(group[0])
        for name in group[1:]:
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            owner._parameters[leaf] = source
