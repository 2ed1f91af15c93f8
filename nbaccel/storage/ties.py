"""Tied parameters: which names of a model hold one Parameter object, and which names of a model
plus a checkpoint's tie record must get the same tensor. The one finder of ties: the big-model
planner (sizes), ``find_tied_parameters`` and the weight loaders all ask it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import TypeVar

from torch import nn

__all__ = ["shared_parameters", "tie_groups", "tied_twins"]

_K = TypeVar("_K", bound=Hashable)


def shared_parameters(modules: Iterable[tuple[_K, nn.Module]]) -> list[list[tuple[_K, str]]]:
    """``(module key, leaf)`` of every name of each Parameter met more than once, first occurrence
    first; groups in the order their first repeat is met.

    ``modules`` is any walk of ``(key, module)``: ``named_modules(remove_duplicate=False)``, or
    a faster one whose keys are indices (the size scan names only what it must).
    """
    first: dict[int, tuple[_K, str]] = {}
    groups: dict[int, list[tuple[_K, str]]] = {}
    for key, module in modules:
        for leaf, param in module._parameters.items():
            if param is None:
                continue
            ident = id(param)
            if ident in first:
                groups.setdefault(ident, [first[ident]]).append((key, leaf))
            else:
                first[ident] = (key, leaf)
    return list(groups.values())


def tie_groups(
    model: nn.Module, modules: Iterable[tuple[str, nn.Module]] | None = None
) -> list[list[str]]:
    """Groups of parameter names of ``model`` that share one Parameter object, each sorted:
    ``[["embed.weight", "lm_head.weight"]]``. ``modules`` is a ready ``(name, module)`` walk of
    ``model`` in ``named_modules`` order (shared modules under each name), if the caller has one."""
    if modules is None:
        modules = model.named_modules(remove_duplicate=False)
    return [
        sorted(f"{name}.{leaf}" if name else leaf for name, leaf in group)
        for group in shared_parameters(modules)
    ]


def tied_twins(
    groups: Iterable[Iterable[str]], record: Mapping[str, str] | None = None
) -> dict[str, list[str]]:
    """name -> every name holding the same tensor (itself included), from a model's tie
    ``groups`` and a checkpoint's tie ``record``; untied names are not listed."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    for group in [*map(list, groups), *([a, k] for a, k in (record or {}).items())]:
        for name in group[1:]:
            parent[root(name)] = root(group[0])
    members: dict[str, list[str]] = {}
    for name in parent:
        members.setdefault(root(name), []).append(name)
    return {n: sorted(g) for g in members.values() if len(g) > 1 for n in g}
