"""The device map Accelerate documents: a sequential fill that keeps the largest layer free.

``infer_auto_device_map`` in Accelerate walks the model's top-level pieces in order and fills
devices one after the other (GPU 0, GPU 1, ..., cpu, disk). On the *main* devices (GPU 0 and the
CPU, or MPS alone, or the CPU alone without GPUs) it keeps the size of the largest remaining
unsplittable layer free, in case an offloaded layer has to be brought back there. A piece that
does not fit is split into its direct parameters and children, unless it is a leaf or a
``no_split_module_classes`` block, in which case the fill moves to the next device. Tied
parameters travel with the piece that owns their first occurrence. With
``fallback_allocation`` a device that would stay empty first takes the first piece (found
breadth-first) that fits.

nbaccel's own planner (``device_map``) replaces the blanket reserve by the real size of the
offloaded layers; this module exists so that a model that needs no offloading gets exactly the
map Accelerate users expect. Written from Accelerate's documentation and observed behaviour.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from nbaccel.bigmodel.module_sizes import get_max_layer_size

__all__ = ["GreedyFill", "greedy_fill"]

Piece = tuple[str, "nn.Module | torch.Tensor"]


@dataclass
class GreedyFill:
    """Result of one fill: the (unclean) map and the numbers the warnings are built from."""

    device_map: dict[str, int | str]
    used: dict[int | str, float]
    buffers_by_device: dict[int | str, float] = field(default_factory=dict)
    empty_minimum: dict[int | str, float] = field(default_factory=dict)


def _inside(name: str, other: str) -> bool:
    """Is tensor/module ``other`` equal to or under ``name``?"""
    return (other + ".").startswith(name + ".")


def _children(piece: nn.Module | torch.Tensor) -> list[tuple[str, nn.Module]]:
    if isinstance(piece, torch.Tensor):
        return []
    return list(piece.named_children())


def _split(name: str, module: nn.Module) -> list[Piece]:
    """A split module becomes its direct parameters followed by its children."""
    parts: list[Piece] = list(module.named_parameters(recurse=False))
    parts += _children(module)
    return [(f"{name}.{n}", p) for n, p in parts]


def _outside_ties(name: str, tied_groups: list[list[str]]) -> list[str]:
    """Tied names outside ``name`` whose group also has a member inside it."""
    out: list[str] = []
    for group in tied_groups:
        inside = [_inside(name, p) for p in group]
        if any(inside) and not all(inside):
            out.extend(p for p, is_in in zip(group, inside) if not is_in)
    return out


def _with_ties(
    tied: list[str], size: float, sizes: Mapping[str, float], queue: list[Piece]
) -> tuple[float, list[str], list]:
    """Size of a piece plus the queued pieces holding its outside tied parameters."""
    names: list[str] = []
    pieces: list = []
    total = size
    for param in tied:
        holder = next(((n, m) for n, m in queue if param.startswith(n + ".")), None)
        if holder is None:
            continue
        names.append(holder[0])
        pieces.append(holder[1])
        total += sizes.get(holder[0], 0) - sizes.get(param, 0)
    return total, names, pieces


def _largest(queue: list[Piece], sizes, no_split, modules_only=True) -> tuple[float, list[str]]:
    """Largest unsplittable layer in the queue (the first measure also counts the model's own
    top-level tensors; later ones only modules, as Accelerate does)."""
    pieces = [(n, m) for n, m in queue if isinstance(m, nn.Module)] if modules_only else queue
    return get_max_layer_size(pieces, sizes, list(no_split))


def _fallback(queue, sizes, limit, no_split, tied_groups) -> tuple[Piece | None, list[Piece]]:
    """First piece fitting in ``limit``; a piece too big is searched through before the next."""
    search = list(queue)
    while search:
        name, piece = search.pop(0)
        total, _, _ = _with_ties(
            _outside_ties(name, tied_groups), sizes.get(name, 0), sizes, search
        )
        if total <= limit:
            return (name, piece), _remove(queue, name)
        children = _children(piece)
        if children and type(piece).__name__ not in no_split:
            search = _split(name, piece) + search
    return None, queue


def _remove(queue: list[Piece], name: str) -> list[Piece]:
    """The queue without ``name``; an ancestor of it is replaced by its remaining pieces."""
    out: list[Piece] = []
    for n, piece in queue:
        if n == name:
            continue
        if name.startswith(n + ".") and isinstance(piece, nn.Module):
            out.extend(_remove(_split(n, piece), name))
            continue
        out.append((n, piece))
    return out


class _Largest:
    """The largest unsplittable layer still queued, and the names reaching that size (kept
    sorted, so dropping every name under a placed piece is a bisect, not a scan)."""

    def __init__(self, queue: list[Piece], sizes, no_split):
        self.sizes, self.no_split = sizes, no_split
        self.refresh(queue, modules_only=False)

    def refresh(self, queue: list[Piece], modules_only: bool = True) -> None:
        self.size, names = _largest(queue, self.sizes, self.no_split, modules_only)
        self.names = sorted(names)

    def drop(self, name: str, queue_front_first) -> None:
        """Forget ``name`` and every name under it; re-measure once none is left."""
        names = self.names
        prefix = name + "."
        lo = hi = bisect.bisect_left(names, prefix)
        while hi < len(names) and names[hi].startswith(prefix):
            hi += 1
        del names[lo:hi]
        at = bisect.bisect_left(names, name)
        if at < len(names) and names[at] == name:
            del names[at]
        if not names:
            self.refresh(queue_front_first())


def greedy_fill(
    model: nn.Module,
    budgets: Mapping[int | str, float],
    sizes: Mapping[str, float],
    buffer_sizes: Mapping[str, float],
    tied_groups: list[list[str]],
    no_split: set[str],
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
    verbose: bool = False,
) -> GreedyFill:
    """Fill ``budgets`` (ordered devices, bytes) in order with the model's pieces."""
    devices = list(budgets)
    caps = dict(budgets)
    if "disk" not in caps:
        devices.append("disk")
    caps["disk"] = math.inf  # the disk is never full
    gpus = [d for d in devices if d not in ("cpu", "disk")]
    if "mps" in gpus:
        main = {"mps"}
    elif gpus:
        main = {gpus[0], "cpu"}
    else:
        main = {"cpu"}
    first: list[Piece] = list(model.named_parameters(recurse=False))
    first += list(model.named_children())
    first += list(model.named_buffers(recurse=False))
    stack: list[Piece] = first[::-1]  # the front of the queue is the end of the list

    def queue() -> list[Piece]:
        return stack[::-1]

    def push_front(pieces: list[Piece]) -> None:
        stack.extend(reversed(pieces))

    result: dict[str, int | str] = {}
    used: dict[int | str, float] = dict.fromkeys(devices, 0)
    buffers: dict[int | str, float] = {}
    empty_minimum: dict[int | str, float] = {}
    index = 0
    largest = _Largest(first, sizes, no_split)
    while stack:
        name, piece = stack.pop()
        largest.drop(name, queue)
        size = sizes.get(name, 0)
        tied = _outside_ties(name, tied_groups) if tied_groups else []
        device = devices[index]
        reserved = largest.size if device in main else 0
        cap = caps[device] - reserved
        total, tied_names, tied_pieces = (
            _with_ties(tied, size, sizes, queue()) if tied else (size, [], [])
        )
        if used[device] + total <= cap:
            if verbose:
                print(f"Putting {name} ({total} bytes) on {device}.")
            used[device] += total
            result[name] = device
            if tied_names:
                stack[:] = [(n, p) for n, p in stack if n not in tied_names]
            for tied_name in tied_names:
                result[tied_name] = device
            if not offload_buffers and isinstance(piece, nn.Module):
                buffers[device] = buffers.get(device, 0) + buffer_sizes.get(name, 0)
            continue
        if tied and used[device] + size <= cap:
            # The piece fits without its tied partners: split a partner if one can be split.
            split_partner = False
            for tied_name, tied_piece in zip(tied_names, tied_pieces):
                if not _children(tied_piece) or type(tied_piece).__name__ in no_split:
                    continue
                rest = queue()
                at = next(i for i, (n, _) in enumerate(rest) if n == tied_name)
                parts = _split(tied_name, tied_piece)
                stack[:] = [(name, piece), *rest[:at], *parts, *rest[at + 1 :]][::-1]
                largest.refresh(queue())
                split_partner = True
                break
            if split_partner:
                continue
        splittable = bool(_children(piece)) and type(piece).__name__ not in no_split
        if used[device] + size >= cap and splittable:
            push_front(_split(name, piece))
            largest.refresh(queue())
            continue
        if used[device] == 0 and fallback_allocation and device != "disk":
            limit = caps[device] - max(largest.size, total)
            found, rest = _fallback(queue(), sizes, limit, no_split, tied_groups)
            if found is not None:
                stack[:] = [found, (name, piece), *rest][::-1]
                continue
        if used[device] == 0:
            empty_minimum[device] = total + reserved
        used[device] += reserved
        index += 1
        stack.append((name, piece))
    return GreedyFill(result, {d: u for d, u in used.items() if u > 0}, buffers, empty_minimum)
