"""Tied parameters in the identity walk's sizes: each counted once, under its first name.

Accelerate counts a Parameter that appears under several names (an embedding tied to the output
head) once, under the name ``named_parameters`` gives first, and the device map keeps a tie's
names together. The identity walk (``size_walk``) counted every occurrence. Here the few tied
parameters are found where the walk met them, ordered as ``named_parameters`` orders them, and
each later occurrence is taken back out of the modules above it: only those modules change, so
a model with tied weights is planned as fast as one without, where a by-name scan of 10^5
modules would cost several times the walk.

Not handled here (the caller falls back to the by-name scan): a module with tensors that appears
under two names (sizes then depend on which name is asked for), and a tensor shared as a buffer.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from nbaccel.bigmodel.planning.size_walk import (
    NO_LAYER,
    IdentitySizes,
    Walked,
    combine,
    leaf_bytes,
    tensor_bytes,
)

__all__ = ["count_ties_once"]


@dataclass
class _Seen:
    """One occurrence of a tied parameter."""

    tensor: torch.Tensor
    holder: nn.Module  # the module whose ``_parameters`` hold it
    entry: int  # the walk's index of the holder, or of its parent when the holder is a leaf
    leaf: tuple[int, str] | None  # (position, key) of a leaf holder in its parent
    param: tuple[int, str]  # (position, key) in the holder's ``_parameters``


def count_ties_once(found: IdentitySizes, walked: Walked) -> bool:
    """Correct ``found`` in place (sizes, layers, tie groups); False when the model shares a
    module with tensors, or a buffer, which only a by-name scan answers the way Accelerate does."""
    counts = Counter(walked.ids)
    twice = {ident for ident, n in counts.items() if n > 1}
    entries = sorted(
        {bisect_right(walked.marks, k) - 1 for k, i in enumerate(walked.ids) if i in twice}
    )
    seen: list[_Seen] = []
    for entry in entries:
        found_here = _occurrences(walked.modules[entry], entry, twice)
        if found_here is None:
            return False
        seen += found_here
    if not _one_place_per_holder(seen):
        return False
    paths = _Paths(walked)
    by_tensor: dict[int, list[_Seen]] = {}
    for one in sorted(seen, key=paths.order):
        by_tensor.setdefault(id(one.tensor), []).append(one)
    changed: set[int] = set()
    measured: set[int] = set()  # leaf holders given an entry of their own
    groups: list[tuple[tuple, list[str]]] = []
    for group in by_tensor.values():
        size = tensor_bytes(group[0].tensor)
        names = [paths.name(one) for one in group]
        found.tied_sizes.update(dict.fromkeys(names, 0))
        found.tied_sizes[names[0]] = size
        found.tied_dups.update(names[1:])
        groups.append((paths.order(group[1]), names))
        for later in group[1:]:
            if later.leaf is not None:
                key = id(later.holder)
                if key not in measured:
                    measured.add(key)
                    params, buffers = leaf_bytes(later.holder)
                    found.size_by_id[key] = params + buffers
                    if buffers:
                        found.buffers_by_id[key] = buffers
                found.size_by_id[key] -= size
            for entry in paths.chain(later.entry):
                found.size_by_id[id(walked.modules[entry])] -= size
                changed.add(entry)
    # Groups in the order their first repeat comes (as the by-name scan lists them).
    found.tied_groups = [sorted(names) for _, names in sorted(groups, key=lambda g: g[0])]
    _relayer(found, walked, sorted(changed, reverse=True))
    return True


def _occurrences(module: nn.Module, entry: int, twice: set[int]) -> list[_Seen] | None:
    """Occurrences of the ``twice`` tensors in one walked module: its own parameters and those
    of its leaf children. None if one of them is a buffer."""
    out: list[_Seen] = []
    if any(t is not None and id(t) in twice for t in module._buffers.values()):
        return None
    for at, (key, tensor) in enumerate(module._parameters.items()):
        if tensor is not None and id(tensor) in twice:
            out.append(_Seen(tensor, module, entry, None, (at, key)))
    for position, (child_key, child) in enumerate(module._modules.items()):
        if child is None or child._modules:
            continue
        if any(t is not None and id(t) in twice for t in child._buffers.values()):
            return None
        for at, (key, tensor) in enumerate(child._parameters.items()):
            if tensor is not None and id(tensor) in twice:
                out.append(_Seen(tensor, child, entry, (position, child_key), (at, key)))
    return out


def _one_place_per_holder(seen: list[_Seen]) -> bool:
    """A holder met at two places is a shared module: names decide its sizes."""
    places: dict[int, tuple] = {}
    for one in seen:
        place = (one.entry, one.leaf)
        if places.setdefault(id(one.holder), place) != place:
            return False
    return True


class _Paths:
    """Names and ``named_parameters`` order of occurrences, from the walk's parent links."""

    def __init__(self, walked: Walked):
        self.walked = walked
        self.memo: dict[int, tuple[tuple[int, ...], str]] = {0: ((), "")}  # the model

    def chain(self, entry: int) -> list[int]:
        """``entry`` and every walked module above it."""
        out = []
        while entry != -1:
            out.append(entry)
            entry = self.walked.parents[entry]
        return out

    def _entry(self, entry: int) -> tuple[tuple[int, ...], str]:
        """(child positions from the model down, dotted name) of a walked module."""
        known = self.memo.get(entry)
        if known is not None:
            return known
        parent = self.walked.parents[entry]
        positions, name = self._entry(parent)
        target = self.walked.modules[entry]
        holder = self.walked.modules[parent]
        at, key = next((i, k) for i, (k, m) in enumerate(holder._modules.items()) if m is target)
        self.memo[entry] = result = ((*positions, at), f"{name}.{key}" if name else key)
        return result

    def _holder(self, one: _Seen) -> tuple[tuple[int, ...], str]:
        positions, name = self._entry(one.entry)
        if one.leaf is None:
            return positions, name
        at, key = one.leaf
        return (*positions, at), f"{name}.{key}" if name else key

    def order(self, one: _Seen) -> tuple:
        """Sort key: a module's own parameters come before its children's, children in order."""
        return self._holder(one)[0], one.param[0]

    def name(self, one: _Seen) -> str:
        holder = self._holder(one)[1]
        key = one.param[1]
        return f"{holder}.{key}" if holder else key


def _relayer(found: IdentitySizes, walked: Walked, entries: list[int]) -> None:
    """Largest layers again under the modules whose sizes changed, deepest first."""
    layers, sizes = found.layers_by_id, found.size_by_id
    for entry in entries:
        module = walked.modules[entry]
        key = id(module)
        if key not in layers:
            continue  # under a module kept whole: its layers never matter
        if entry in walked.kept_whole:
            layers[key] = (sizes[key], 1)
            continue
        best, done = NO_LAYER, set()
        for child in module._modules.values():
            if child is None or id(child) in done:
                continue
            done.add(id(child))
            if child._modules:
                best = combine(best, layers[id(child)])
            else:
                size = sizes.get(id(child))
                best = combine(best, (sum(leaf_bytes(child)) if size is None else size, 1))
        layers[key] = best if best[1] else (sizes[key], 1)
