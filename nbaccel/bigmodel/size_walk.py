"""Bytes under every module with children, by module identity, in one pass over the model.

The planner's hot path on 10^5-module MoE models. Reading a module's three dicts and its
tensors costs a few cache misses each, so the time is set by how many objects are touched, not
by arithmetic: the walk touches each module and tensor once, builds no name, and handles a
leaf module (most of an MoE model) inline in its parent's step instead of pushing it on the
stack. Leaves get no entry: their bytes go to their parent, and the few leaves a planner asks
about are measured again on demand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["IdentitySizes", "walk_sizes"]


@dataclass
class IdentitySizes:
    """Bytes (and buffer bytes, where non-zero) under each module with children, by ``id``."""

    size_by_id: dict[int, int | float]
    buffers_by_id: dict[int, int | float]


def walk_sizes(model: nn.Module) -> IdentitySizes | None:
    """Sizes by module identity; ``None`` when some tensor is met twice (tied weights or a
    shared module), where sizes depend on names. Booleans count one bit per element."""
    modules: list[nn.Module] = []
    parents: list[int] = []
    totals: list[int | float] = []
    buffer_totals: dict[int, int | float] = {}
    ids: list[int] = []  # every tensor met; duplicates are looked for once, at the end
    note = ids.append
    keep, link, record = modules.append, parents.append, totals.append
    stack, stack_parents = [model], [-1]  # two stacks: no tuple per module
    pop, pop_parent = stack.pop, stack_parents.pop
    push, push_parent = stack.append, stack_parents.append
    boolean = torch.bool
    while stack:
        module = pop()
        index = len(totals)
        link(pop_parent())
        keep(module)
        own = own_buffers = 0
        if module._parameters or module._buffers:  # rare on a module with children
            own, own_buffers = _own_bytes(module, note)
        for child in module._modules.values():
            if child is None:
                continue
            if child._modules:
                push(child)
                push_parent(index)
                continue
            for tensor in child._parameters.values():  # a leaf: measured right here
                if tensor is not None:
                    note(id(tensor))
                    own += tensor.nbytes if tensor.dtype is not boolean else tensor.numel() / 8
            if child._buffers:
                own_buffers += _own_bytes(child, note, params=False)[1]
        record(own + own_buffers)
        if own_buffers:
            buffer_totals[index] = own_buffers
    if len(set(ids)) != len(ids):
        return None
    return _finish(modules, parents, totals, buffer_totals)


def _bytes(tensor: torch.Tensor) -> int | float:
    return tensor.nbytes if tensor.dtype is not torch.bool else tensor.numel() / 8


def _own_bytes(module: nn.Module, note, params: bool = True) -> tuple[int | float, int | float]:
    """Bytes of a module's own parameters (if ``params``) and own buffers; ``note`` gets ids."""
    own = own_buffers = 0
    if params:
        for tensor in module._parameters.values():
            if tensor is not None:
                note(id(tensor))
                own += _bytes(tensor)
    for tensor in module._buffers.values():
        if tensor is not None:
            note(id(tensor))
            own_buffers += _bytes(tensor)
    return own, own_buffers


def _finish(modules, parents, totals, buffer_totals) -> IdentitySizes:
    """Add every entry into its parent's (children come after their parent) and key by id."""
    for i in range(len(totals) - 1, 0, -1):
        totals[parents[i]] += totals[i]
    size_by_id = dict(zip(map(id, modules), totals))
    buffers_by_id: dict[int, int | float] = {}
    if buffer_totals:
        buffers = [0] * len(totals)
        for i, size in buffer_totals.items():
            buffers[i] = size
        for i in range(len(buffers) - 1, 0, -1):
            buffers[parents[i]] += buffers[i]
        buffers_by_id = {id(m): b for m, b in zip(modules, buffers) if b}
    return IdentitySizes(size_by_id, buffers_by_id)
