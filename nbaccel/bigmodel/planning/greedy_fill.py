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

This module gives the same map in time linear in the model: sizes come from one scan
(``ModelScan``), the largest layer under a piece is computed once per piece, and the largest
layer still queued is read off a stack that carries its running maximum, where a literal reading
of the algorithm re-walks the whole queue after every split. Written from Accelerate's
documentation and observed behaviour.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from nbaccel.bigmodel.planning.module_sizes import ModelScan
from nbaccel.bigmodel.planning.size_walk import NO_LAYER as _NONE
from nbaccel.bigmodel.planning.size_walk import combine as _combine

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
    """Does Accelerate count tensor ``other`` as inside piece ``name``? It tests ``name + "."``
    as a substring of ``other + "."``, so ``"0"`` also holds ``"3.m0.weight"``; the same test
    keeps the same maps."""
    return (name + ".") in (other + ".")


def _children(piece: nn.Module | torch.Tensor) -> list[tuple[str, nn.Module]]:
    """``named_children``: set children, each module object once."""
    if isinstance(piece, torch.Tensor) or not piece._modules:
        return []
    out, seen = [], set()
    for key, child in piece._modules.items():
        if child is not None and id(child) not in seen:
            seen.add(id(child))
            out.append((key, child))
    return out


def _split(name: str, module: nn.Module) -> list[Piece]:
    """A split module becomes its direct parameters followed by its children."""
    prefix = name + "." if name else ""
    parts: list[Piece] = []
    seen: set[int] = set()
    for key, param in module._parameters.items():
        if param is not None and id(param) not in seen:
            seen.add(id(param))
            parts.append((prefix + key, param))
    parts += [(prefix + k, m) for k, m in _children(module)]
    return parts


class _Fill:
    """State of one fill. The queue is a stack (its front is the end of the list)."""

    def __init__(self, scan: ModelScan, no_split: set[str], tied_groups: list[list[str]]):
        self.scan, self.no_split = scan, no_split
        self.size = scan.piece_size
        self.layer_memo: dict[str, tuple[float, int]] = {}
        # The scan's walk found the largest layer under every module with children, if it
        # kept the same classes whole (the identity pass); otherwise they are found here.
        self.layers_by_id = scan.layers_by_id if scan.whole == no_split else {}
        self.tied_groups = tied_groups
        self.stack: list[Piece] = []
        self.agg: list[tuple[float, int]] = []  # running (largest layer, count) of the stack

    def splittable(self, piece: nn.Module | torch.Tensor) -> bool:
        return bool(_children(piece)) and type(piece).__name__ not in self.no_split

    def layers(self, name: str, piece: nn.Module | torch.Tensor) -> tuple[float, int]:
        """(size, count) of the largest unsplittable layers under a module piece."""
        found = self.layers_by_id.get(id(piece)) or self.layer_memo.get(name)
        if found is not None:
            return found
        if not self.splittable(piece):
            result = (self.size(name, piece), 1)
        else:
            result = _NONE
            prefix = name + "." if name else ""
            for key, child in _children(piece):
                result = _combine(result, self.layers(prefix + key, child))
        self.layer_memo[name] = result
        return result

    def _own(self, piece: Piece) -> tuple[float, int]:
        return _NONE if isinstance(piece[1], torch.Tensor) else self.layers(*piece)

    def push(self, piece: Piece) -> None:
        below = self.agg[-1] if self.agg else _NONE
        self.stack.append(piece)
        self.agg.append(_combine(below, self._own(piece)))

    def pop(self) -> Piece:
        self.agg.pop()
        return self.stack.pop()

    def reset(self, front_first: list[Piece]) -> None:
        """Replace the whole queue (a rare reordering): rebuild the running maxima."""
        self.stack, self.agg = [], []
        for piece in reversed(front_first):
            self.push(piece)

    def queue(self) -> list[Piece]:
        return self.stack[::-1]

    def largest(self) -> tuple[float, int]:
        """Largest unsplittable module layer still queued, and how many layers reach it."""
        size, count = self.agg[-1] if self.agg else _NONE
        return max(size, 0), count

    def outside_ties(self, name: str) -> list[str]:
        """Tied names outside ``name`` whose group also has a member inside it."""
        out: list[str] = []
        for group in self.tied_groups:  # a few groups: checked one by one, as Accelerate does
            inside = [_inside(name, p) for p in group]
            if any(inside) and not all(inside):
                out.extend(p for p, is_in in zip(group, inside) if not is_in)
        return out

    def with_ties(self, tied: list[str], size: float, queue: list[Piece]):
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
            total += self.size(*holder) - self.scan.tied_size(param)
        return total, names, pieces

    def fallback(self, limit: float) -> tuple[Piece | None, list[Piece]]:
        """First piece (depth-first through split pieces) fitting in ``limit``."""
        queue = self.queue()
        search = queue[::-1]  # a stack again: the front is the end
        while search:
            name, piece = search.pop()
            tied = self.outside_ties(name) if self.tied_groups else []
            total = self.size(name, piece)
            if tied:
                total, _, _ = self.with_ties(tied, total, search[::-1])
            if total <= limit:
                return (name, piece), _remove(queue, name)
            if self.splittable(piece):
                search.extend(reversed(_split(name, piece)))
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
    """Accelerate's "largest layer" kept free on the main devices, and when it is measured again:
    after a split, or once every layer of that size measured last time has left the queue."""

    def __init__(self, queue: _Fill, first: list[Piece]):
        self.queue = queue
        # The first measure also counts the model's own tensors; later ones only modules.
        largest = (0, 0)
        for name, piece in first:
            if isinstance(piece, torch.Tensor):
                own = (queue.size(name, piece), 1)
            else:
                own = queue.layers(name, piece)
            largest = _combine(largest, own)
        self.size, self.remaining = largest
        self.first_measure = True
        self.popped: set[str] = set()

    def leave(self, name: str, piece: nn.Module | torch.Tensor, size: float) -> None:
        """``name`` left the queue: layers of the largest size under it leave the count."""
        if self.size <= 0 or name in self.popped:
            return
        self.popped.add(name)
        if isinstance(piece, torch.Tensor):
            gone = 1 if self.first_measure and size == self.size else 0
        else:
            layer_size, count = self.queue.layers(name, piece)
            gone = count if layer_size == self.size else 0
        self.remaining -= gone
        if self.remaining <= 0:
            self.remeasure(name)

    def remeasure(self, just_popped: str | None = None) -> None:
        self.size, self.remaining = self.queue.largest()
        # A piece popped before the measure is not part of it, even if it is queued again.
        self.first_measure = False
        self.popped = {just_popped} if just_popped is not None else set()


class _Devices:
    """The devices in fill order, what each holds, and the one being filled."""

    def __init__(self, budgets: Mapping[int | str, float]):
        self.order = list(budgets)
        self.caps = dict(budgets)
        if "disk" not in self.caps:
            self.order.append("disk")
        self.caps["disk"] = math.inf  # the disk is never full
        gpus = [d for d in self.order if d not in ("cpu", "disk")]
        if "mps" in gpus:
            self.main = {"mps"}
        elif gpus:
            self.main = {gpus[0], "cpu"}
        else:
            self.main = {"cpu"}
        self.index = 0
        self.used: dict[int | str, float] = dict.fromkeys(self.order, 0)
        self.buffers: dict[int | str, float] = {}
        self.empty_minimum: dict[int | str, float] = {}
        self.result: dict[str, int | str] = {}

    def current(self, largest: float) -> tuple[int | str, float, float]:
        """(device, memory kept free on it, what may be used on it)."""
        device = self.order[self.index]
        reserved = largest if device in self.main else 0
        return device, reserved, self.caps[device] - reserved

    def move_on(self, device: int | str, total: float, reserved: float) -> None:
        """Nothing more fits on ``device``: it keeps its reserve and the next one is filled."""
        if self.used[device] == 0:
            self.empty_minimum[device] = total + reserved
        self.used[device] += reserved
        self.index += 1

    def report(self) -> GreedyFill:
        used = {d: u for d, u in self.used.items() if u > 0}
        return GreedyFill(self.result, used, self.buffers, self.empty_minimum)


def _split_a_partner(queue: _Fill, current: Piece, tied_names: list[str], tied_pieces) -> bool:
    """Split the first splittable tied partner in place; the current piece goes back first."""
    for tied_name, tied_piece in zip(tied_names, tied_pieces):
        if not queue.splittable(tied_piece):
            continue
        rest = queue.queue()
        at = next(i for i, (n, _) in enumerate(rest) if n == tied_name)
        queue.reset([current, *rest[:at], *_split(tied_name, tied_piece), *rest[at + 1 :]])
        return True
    return False


def _first_pieces(model: nn.Module) -> list[Piece]:
    """The model's own parameters, then its children, then its own buffers."""
    first = _split("", model)
    seen: set[int] = set()
    for key, buffer in model._buffers.items():
        if buffer is not None and id(buffer) not in seen:
            seen.add(id(buffer))
            first.append((key, buffer))
    return first


def greedy_fill(
    model: nn.Module,
    budgets: Mapping[int | str, float],
    scan: ModelScan,
    no_split: set[str],
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
    verbose: bool = False,
) -> GreedyFill:
    """Fill ``budgets`` (ordered devices, bytes) in order with the model's pieces."""
    devices = _Devices(budgets)
    first = _first_pieces(model)
    queue = _Fill(scan, no_split, scan.tied_groups)
    queue.reset(first)
    largest = _Largest(queue, first)
    while queue.stack:
        name, piece = queue.pop()
        size = scan.piece_size(name, piece)
        largest.leave(name, piece, size)
        tied = queue.outside_ties(name) if scan.tied_groups else []
        device, reserved, cap = devices.current(largest.size)
        total, tied_names, tied_pieces = (
            queue.with_ties(tied, size, queue.queue()) if tied else (size, [], [])
        )
        used = devices.used[device]
        if used + total <= cap:
            if verbose:
                print(f"Putting {name} ({total} bytes) on {device}.")
            devices.used[device] += total
            devices.result[name] = device
            if tied_names:
                queue.reset([(n, p) for n, p in queue.queue() if n not in tied_names])
            devices.result.update(dict.fromkeys(tied_names, device))
            if not offload_buffers and isinstance(piece, nn.Module):
                buffers = devices.buffers.get(device, 0) + scan.piece_buffers(name, piece)
                devices.buffers[device] = buffers
            continue
        if (
            tied
            and used + size <= cap
            and _split_a_partner(queue, (name, piece), tied_names, tied_pieces)
        ):
            largest.remeasure()
            continue
        if used + size >= cap and queue.splittable(piece):
            for part in reversed(_split(name, piece)):
                queue.push(part)
            largest.remeasure()
            continue
        if used == 0 and fallback_allocation and device != "disk":
            found, rest = queue.fallback(devices.caps[device] - max(largest.size, total))
            if found is not None:
                queue.reset([found, (name, piece), *rest])
                continue
        devices.move_on(device, total, reserved)
        queue.push((name, piece))
    return devices.report()
