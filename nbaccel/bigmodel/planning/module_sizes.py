"""Sizes of modules and tensors: the numbers a device map is planned from.

Everything here makes one pass over the model's tensors and answers from dictionaries keyed by
module name, so planning stays linear in the number of tensors even for 10^5-tensor MoE models.
Works on ``meta`` models: only shapes and dtypes are read.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from functools import cache

import torch
from torch import nn

from nbaccel.bigmodel.planning.size_ties import count_ties_once
from nbaccel.bigmodel.planning.size_walk import Layers, leaf_bytes, tensor_bytes, walk_sizes
from nbaccel.storage.ties import shared_parameters

__all__ = [
    "calculate_maximum_sizes",
    "compute_module_sizes",
    "dtype_byte_size",
    "get_max_layer_size",
    "ModelScan",
    "modules_preorder",
    "named_module_tensors",
]


@cache
def dtype_byte_size(dtype: torch.dtype) -> int | float:
    """Bytes one element of ``dtype`` takes; ``torch.bool`` counts as one bit (1/8), as in
    Accelerate, so sizes of models with boolean masks are the same numbers."""
    if dtype == torch.bool:
        return 1 / 8
    packed = _PACKED_BYTES.get(str(getattr(dtype, "value", dtype)))
    if packed is not None:  # quantized formats below a byte (CustomDtype or its name)
        return packed
    return torch.empty((), dtype=dtype).element_size()


_PACKED_BYTES = {"int4": 0.5, "int2": 0.25, "fp8": 1}


def named_module_tensors(
    module: nn.Module,
    include_buffers: bool = True,
    recurse: bool = False,
    remove_non_persistent: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (and buffers) of ``module`` by name, optionally without non-persistent buffers."""
    yield from module.named_parameters(recurse=recurse)
    if not include_buffers:
        return
    for name, buf in module.named_buffers(recurse=recurse):
        if remove_non_persistent:
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            if leaf in owner._non_persistent_buffers_set:
                continue
        yield name, buf


def _tensor_bytes(
    name: str,
    tensor: torch.Tensor,
    dtype: torch.dtype | None,
    special_dtypes: Mapping[str, torch.dtype] | None,
) -> int:
    if special_dtypes and name in special_dtypes:
        return tensor.numel() * dtype_byte_size(special_dtypes[name])
    if dtype is not None and tensor.is_floating_point():
        # Loading casts floating tensors to ``dtype`` but never upcasts them.
        return tensor.numel() * min(dtype_byte_size(dtype), tensor.element_size())
    return tensor_bytes(tensor)


@contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector: building 10^5 small objects would otherwise trigger
    full-heap collections that cost more than the work itself (nothing here creates cycles)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def modules_preorder(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) for every module in ``named_modules`` order, shared ones under each name.

    An explicit stack instead of torch's nested generators, which cost a frame per level per
    module (the planner's timings: ``benchmarks/bench_device_map.py``).
    """
    with no_gc():
        return _preorder(model)


def _preorder(model: nn.Module) -> list[tuple[str, nn.Module]]:
    entries = _preorder_keys(model)
    return list(zip(_names(entries), (m for m, _, _ in entries)))


def _preorder_keys(model: nn.Module) -> list[tuple[nn.Module, int, str]]:
    """(module, index of its parent in this list or -1, its key in the parent), in pre-order.
    No dotted names are built: most callers only need a few of them."""
    out: list[tuple[nn.Module, int, str]] = []
    stack: list[tuple[nn.Module, int, str]] = [(model, -1, "")]
    pop, push, append = stack.pop, stack.append, out.append
    while stack:
        item = pop()
        index = len(out)
        append(item)
        children = item[0]._modules
        if children:
            for key, child in reversed(children.items()):
                if child is not None:
                    push((child, index, key))
    return out


def _names(entries: list[tuple[nn.Module, int, str]]) -> list[str]:
    names = [""] * len(entries)
    for i in range(1, len(entries)):
        _, parent, key = entries[i]
        names[i] = f"{names[parent]}.{key}" if parent else key
    return names


class ModelScan:
    """One pass over a model: bytes under every module (ties counted once, with their first
    name) and every tensor, the same for buffers only, and the groups of tied parameter names.

    Without ``dtype``/``special_dtypes`` (the usual case) the pass builds no name at all:
    ``piece_size`` answers by module identity, and tied weights are taken back out of the
    modules above their later names (``size_ties``). A model that shares a module with tensors,
    or a buffer, is scanned again with names, so every answer keeps Accelerate's by-name
    meaning (a tensor counts under its first name). ``sizes`` / ``buffer_sizes`` (by dotted
    name, as ``compute_module_sizes`` returns them) are built on first use, or at once with
    ``tensor_names=True``. ``whole`` names the classes a planner keeps in one piece: the
    identity pass then also answers ``layers`` (the largest of them under a module).
    """

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype | str | None = None,
        special_dtypes: Mapping[str, torch.dtype] | None = None,
        tensor_names: bool = False,
        whole: Collection[str] = (),
    ):
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.replace("torch.", ""))
        self.model = model
        self.dtype, self.special_dtypes = dtype, special_dtypes
        self._sizes: dict[str, int] | None = None
        self._buffer_sizes: dict[str, int] | None = None
        self.whole = frozenset(whole)
        self.layers_by_id: dict[int, Layers] = {}
        self._tied_sizes: dict[str, int | float] | None = None  # set by the identity walk
        with no_gc():
            if not tensor_names and dtype is None and not special_dtypes and self._walk(model):
                self.by_name = False
                return
            self._scan(model)

    def _walk(self, model: nn.Module) -> bool:
        """Sizes by module identity (``size_walk``, ties counted once by ``size_ties``); False
        if a module with tensors, or a buffer, is shared: sizes then depend on names.

        Only modules with children get an entry (a leaf adds its bytes to its parent and is
        measured again on demand, which is cheaper than keeping ~10^5 entries)."""
        found = walk_sizes(model, self.whole)
        if found.met_twice is not None and not count_ties_once(found, found.met_twice):
            return False
        self.size_by_id, self.buffers_by_id = found.size_by_id, found.buffers_by_id
        self.layers_by_id = found.layers_by_id
        self.tied_groups: list[list[str]] = found.tied_groups
        self.tied_dups: set[str] = found.tied_dups
        self._tied_sizes = found.tied_sizes
        return True

    @staticmethod
    def _leaf(module: nn.Module, buffers_only: bool = False) -> int | float:
        """Bytes of a module without children (not kept by the identity walk)."""
        params, buffers = leaf_bytes(module)
        return buffers if buffers_only else params + buffers

    def _scan(self, model: nn.Module) -> None:
        dtype, special_dtypes = self.dtype, self.special_dtypes
        entries = self._entries = _preorder_keys(model)
        names = self._name_list = _names(entries)
        totals = [0] * len(entries)
        buffer_totals = [0] * len(entries)
        tensor_sizes: dict[str, int] = {}
        tensor_buffers: dict[str, int] = {}
        seen: set[int] = set()  # ids of tensors already counted (ties and shared modules)
        dups: list[tuple[int, str, torch.Tensor]] = []
        plain = dtype is None and not special_dtypes
        add = seen.add
        for i, (module, _, _) in enumerate(entries):
            own = 0
            params = module._parameters
            if params:
                for leaf, tensor in params.items():
                    if tensor is None:
                        continue
                    key = id(tensor)
                    if key in seen:
                        dups.append((i, leaf, tensor))
                        continue
                    add(key)
                    full = _join(names[i], leaf)
                    if plain:
                        size = tensor_bytes(tensor)
                    else:
                        size = _tensor_bytes(full, tensor, dtype, special_dtypes)
                    tensor_sizes[full] = size
                    own += size
            if module._buffers:
                own_buffers = 0
                for leaf, tensor in module._buffers.items():
                    if tensor is None or id(tensor) in seen:
                        continue
                    add(id(tensor))
                    full = _join(names[i], leaf)
                    size = (
                        tensor_bytes(tensor)
                        if plain
                        else _tensor_bytes(full, tensor, dtype, special_dtypes)
                    )
                    tensor_buffers[full] = size
                    tensor_sizes[full] = size
                    own_buffers += size
                own += own_buffers
                buffer_totals[i] = own_buffers
            totals[i] = own
        self._tensor_sizes, self._tensor_buffers = tensor_sizes, tensor_buffers
        self._finish_named(entries, totals, buffer_totals, self._tie_groups(entries, dups))

    def _finish_named(self, entries, totals, buffer_totals, tied) -> None:
        parents = [e[1] for e in entries]
        self._totals = totals = _sum_upwards(parents, totals)
        self._buffer_totals = buffer_totals = _sum_upwards(parents, buffer_totals)
        # A module shared under two names counts its tensors under the first one only, so
        # answers go by name whenever a module object appears twice.
        self.by_name = len({id(e[0]) for e in entries}) != len(entries)
        self.size_by_id = dict(zip(map(id, (e[0] for e in reversed(entries))), reversed(totals)))
        self.buffers_by_id = {
            id(e[0]): t for e, t in zip(reversed(entries), reversed(buffer_totals)) if t
        }
        names = self._name_list
        groups = [[_join(names[i], leaf) for i, leaf in pairs] for pairs in tied]
        self.tied_groups = [sorted(g) for g in groups]
        self.tied_dups = {n for g in groups for n in g[1:]}

    @staticmethod
    def _tie_groups(entries, dups) -> list[list[tuple[int, str]]]:
        """(module index, leaf) of every name of each tied parameter, first occurrence first.
        Only runs a second pass when the first one met a tensor twice (rare)."""
        if not dups:
            return []
        return shared_parameters((i, e[0]) for i, e in enumerate(entries))

    def _named(self) -> None:
        """Switch to the by-name scan (sizes by dotted name asked for after a fast walk)."""
        if not hasattr(self, "_entries"):
            with no_gc():
                self._scan(self.model)

    @property
    def modules(self) -> list[tuple[str, nn.Module]]:
        """(name, module) in ``named_modules`` order, shared modules under each name."""
        self._named()
        return list(zip(self._name_list, (e[0] for e in self._entries)))

    def _by_name(self, totals: list[int], tensors: dict[str, int]) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for name, total in zip(self._name_list, totals):
            out[name] += total
        out.update(tensors)
        return out

    @property
    def sizes(self) -> dict[str, int]:
        if self._sizes is None:
            self._named()
            self._sizes = self._by_name(self._totals, self._tensor_sizes)
        return self._sizes

    @property
    def buffer_sizes(self) -> dict[str, int]:
        if self._buffer_sizes is None:
            self._named()
            self._buffer_sizes = self._by_name(self._buffer_totals, self._tensor_buffers)
            for name in list(self._buffer_sizes):
                if not self._buffer_sizes[name]:
                    del self._buffer_sizes[name]
        return self._buffer_sizes

    def tied_size(self, name: str) -> int | float:
        """Bytes counted under one name of a tied parameter (0 but for its first name)."""
        if self._tied_sizes is None:
            return self.sizes.get(name, 0)
        return self._tied_sizes.get(name, 0)

    def tensor_size(self, name: str, tensor: torch.Tensor) -> int | float:
        """Size of one tensor unit (0 for the second name of a tied weight)."""
        if name in self.tied_dups:
            return 0
        return _tensor_bytes(name, tensor, self.dtype, self.special_dtypes)

    def piece_size(self, name: str, piece: nn.Module | torch.Tensor) -> int | float:
        """Bytes of a module or tensor named ``name`` (Accelerate's ``module_sizes[name]``)."""
        if isinstance(piece, torch.Tensor):
            return self.tensor_size(name, piece)
        if self.by_name:
            return self.sizes.get(name, 0)
        found = self.size_by_id.get(id(piece))
        return self._leaf(piece) if found is None else found

    def piece_buffers(self, name: str, module: nn.Module) -> int | float:
        """Bytes of the buffers under a module (counted once, like its size)."""
        if self.by_name:
            return self.buffer_sizes.get(name, 0)
        if id(module) in self.size_by_id:
            return self.buffers_by_id.get(id(module), 0)
        return self._leaf(module, buffers_only=True)


def _sum_upwards(parents: list[int], totals: list) -> list:
    """Add each entry into its parent's, deepest first (children come after their parent)."""
    for i in range(len(totals) - 1, 0, -1):
        totals[parents[i]] += totals[i]
    return totals


def _join(name: str, leaf: str) -> str:
    return f"{name}.{leaf}" if name else leaf


def compute_module_sizes(
    model: nn.Module,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype] | None = None,
    buffers_only: bool = False,
) -> dict[str, int]:
    """Bytes under every module and tensor name (``""`` is the whole model); ties counted once."""
    scan = ModelScan(model, dtype, special_dtypes, tensor_names=True)
    return scan.buffer_sizes if buffers_only else scan.sizes


def get_max_layer_size(
    modules: list[tuple[str, nn.Module]],
    module_sizes: Mapping[str, int],
    no_split_module_classes: list[str] | None,
) -> tuple[int, list[str]]:
    """The largest unsplittable layer (a leaf, or a ``no_split_module_classes`` block) under
    ``modules``, and every name reaching that size. Each module is visited once."""
    no_split = set(no_split_module_classes or ())
    best, names = 0, []
    stack = list(reversed(modules))
    while stack:
        name, module = stack.pop()
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if not children or type(module).__name__ in no_split:
            size = module_sizes.get(name, 0)
            if size > best:
                best, names = size, [name]
            elif size == best and size > 0:
                names.append(name)
        else:
            prefix = name + "." if name else ""
            stack.extend((prefix + n, m) for n, m in reversed(children))
    return best, names


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """(total bytes of the model, (bytes of its largest leaf layer, that layer's names))."""
    sizes = compute_module_sizes(model)
    no_split = getattr(model, "_no_split_modules", None) or []
    largest = get_max_layer_size(list(model.named_children()), sizes, no_split)
    if largest[0] == 0 and sizes.get("", 0):
        largest = (sizes[""], [""])
    return sizes.get("", 0), largest
