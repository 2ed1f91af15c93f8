"""Bytes under every module with children, by module identity, in one pass over the model.

The planner's hot path on 10^5-module MoE models. Reading a module's three dicts and its
tensors costs a few cache misses each, so the time is set by how many objects are touched, not
by arithmetic: the walk touches each module and tensor once, builds no name, and handles a
leaf module (most of an MoE model) inline in its parent's step instead of pushing it on the
stack. Leaves get no entry: their bytes go to their parent, and the few leaves a planner asks
about are measured again on demand.

Tied parameters (one Parameter under several names) are counted at every occurrence here;
``size_ties`` then takes the later ones back out (Accelerate counts a tie once, under its first
name), walking only up from where they are.

The same pass finds, under each module, the largest *layer* (a leaf, or a module whose class is
kept whole) and how many layers reach that size: the planner asks for it for every piece it
queues, and reading it from the walk spares a second walk over the model.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "NO_LAYER",
    "IdentitySizes",
    "Layers",
    "Walked",
    "combine",
    "leaf_bytes",
    "tensor_bytes",
    "walk_sizes",
]

Layers = tuple[float, int]  # (size of the largest layer, how many layers reach it)
NO_LAYER: Layers = (-1, 0)


@dataclass
class IdentitySizes:
    """Bytes (and buffer bytes, where non-zero) under each module with children, by ``id``,
    and the largest layer under each of them (``layers_by_id``)."""

    size_by_id: dict[int, int | float]
    buffers_by_id: dict[int, int | float]
    layers_by_id: dict[int, Layers]
    tied_groups: list[list[str]] = field(default_factory=list)  # each group's names, sorted
    tied_dups: set[str] = field(default_factory=set)  # every name but a tie's first
    tied_sizes: dict[str, int | float] = field(default_factory=dict)  # bytes counted per name
    met_twice: Walked | None = None  # what the walk saw, when it met a tensor twice


def combine(a: Layers, b: Layers) -> Layers:
    """(largest size, how many layers reach it) of two groups of layers."""
    if a[0] > b[0]:
        return a
    if b[0] > a[0]:
        return b
    return a[0], a[1] + b[1]


def walk_sizes(model: nn.Module, whole: Collection[str] = ()) -> IdentitySizes:
    """Sizes by module identity, every occurrence of a tensor counted (``met_twice`` is set when
    a tensor was met twice). Booleans count one bit per element.
    ``whole``: class names of modules that count as one layer (``no_split_module_classes``;
    the model itself is always split); layers are not looked for under them."""
    modules: list[nn.Module] = []
    parents: list[int] = []
    totals: list[int | float] = []
    layers: dict[int, Layers] = {}  # largest leaf under each module outside whole ones
    buffer_totals: dict[int, int | float] = {}
    kept_whole: set[int] = set()  # indices of modules counted as one layer
    whole = set(whole)
    ids: list[int] = []  # every tensor met; duplicates are looked for once, at the end
    marks: list[int] = []  # where each module's tensors start in ``ids``
    note, mark = ids.append, marks.append
    keep, link, record = modules.append, parents.append, totals.append
    stack, stack_parents, stack_tracked = [model], [-1], [True]  # no tuple per module
    pop, pop_parent, pop_tracked = stack.pop, stack_parents.pop, stack_tracked.pop
    push, push_parent, push_tracked = stack.append, stack_parents.append, stack_tracked.append
    boolean = torch.bool
    while stack:
        module = pop()
        index = len(totals)
        link(pop_parent())
        keep(module)
        mark(len(ids))
        tracked = pop_tracked()  # are this module's layers wanted?
        if index and tracked and whole and type(module).__name__ in whole:  # the model: never
            kept_whole.add(index)  # one layer: what is under it does not matter
            tracked = False
        own = own_buffers = 0
        best, reaching = NO_LAYER
        if module._parameters or module._buffers:  # rare on a module with children
            own, own_buffers = _own_bytes(module, note)
        for child in module._modules.values():
            if child is None:
                continue
            if child._modules:
                push(child)
                push_parent(index)
                push_tracked(tracked)
                continue
            leaf = 0  # a leaf: measured right here
            for tensor in child._parameters.values():
                if tensor is not None:
                    note(id(tensor))
                    leaf += tensor.nbytes if tensor.dtype is not boolean else tensor.numel() / 8
            own += leaf
            if child._buffers:
                leaf_buffers = _own_bytes(child, note, params=False)[1]
                own_buffers += leaf_buffers
                leaf += leaf_buffers
            if not tracked:
                continue
            if leaf > best:
                best, reaching = leaf, 1
            elif leaf == best:
                reaching += 1
        record(own + own_buffers)
        if tracked:
            layers[index] = (best, reaching)
        if own_buffers:
            buffer_totals[index] = own_buffers
    found = _finish(modules, parents, totals, layers, buffer_totals, kept_whole)
    if len(set(ids)) != len(ids):  # every occurrence was counted: see ``size_ties``
        found.met_twice = Walked(modules, parents, ids, marks, kept_whole)
    return found


@dataclass
class Walked:
    """What the walk saw, in its order: modules with children, each one's parent index, the id
    of every tensor met, where each module's tensors start among them, the modules counted as
    one layer (their indices)."""

    modules: list[nn.Module]
    parents: list[int]
    ids: list[int]
    marks: list[int]
    kept_whole: set[int]


def leaf_bytes(module: nn.Module) -> tuple[int | float, int | float]:
    """(bytes of parameters, bytes of buffers) of one module's own tensors."""
    params = buffers = 0
    for tensor in module._parameters.values():
        if tensor is not None:
            params += tensor.nbytes if tensor.dtype is not torch.bool else tensor.numel() / 8
    if module._buffers:
        buffers = sum(tensor_bytes(t) for t in module._buffers.values() if t is not None)
    return params, buffers


def tensor_bytes(tensor: torch.Tensor) -> int | float:
    """Bytes of a tensor in its own dtype; booleans count one bit per element, as Accelerate
    counts them."""
    return tensor.nbytes if tensor.dtype is not torch.bool else tensor.numel() / 8


def _own_bytes(module: nn.Module, note, params: bool = True) -> tuple[int | float, int | float]:
    """``leaf_bytes`` of a module (its parameters' only if ``params``); ``note`` gets the ids of
    the tensors counted. Off the hot path: most modules are measured inline in the walk."""
    counted = [module._buffers.values()]
    if params:
        counted.append(module._parameters.values())
    for tensors in counted:
        for tensor in tensors:
            if tensor is not None:
                note(id(tensor))
    own, own_buffers = leaf_bytes(module)
    return (own if params else 0), own_buffers


def _finish(modules, parents, totals, layers, buffer_totals, kept_whole) -> IdentitySizes:
    """Add every entry into its parent's (children come after their parent) and key by id.
    An entry's total and layers are complete when the reverse scan reaches it; a module kept
    whole, or one whose children are all ``None``, is one layer."""
    for i in range(len(totals) - 1, -1, -1):
        if i:
            totals[parents[i]] += totals[i]
        if i in kept_whole:
            size, count = layers[i] = (totals[i], 1)
        else:
            found = layers.get(i)
            if found is None:
                continue  # under a module kept whole
            size, count = found
            if not count:
                size, count = layers[i] = (totals[i], 1)
        if i:  # ``combine`` into the parent, inline: this runs once per module
            parent = parents[i]
            above, reaching = layers[parent]
            if size > above:
                layers[parent] = (size, count)
            elif size == above:
                layers[parent] = (size, reaching + count)
    size_by_id = dict(zip(map(id, modules), totals))
    layers_by_id = {id(modules[i]): found for i, found in layers.items()}
    buffers_by_id: dict[int, int | float] = {}
    if buffer_totals:
        buffers = [0] * len(totals)
        for i, size in buffer_totals.items():
            buffers[i] = size
        for i in range(len(buffers) - 1, 0, -1):
            buffers[parents[i]] += buffers[i]
        buffers_by_id = {id(m): b for m, b in zip(modules, buffers) if b}
    return IdentitySizes(size_by_id, buffers_by_id, layers_by_id)
