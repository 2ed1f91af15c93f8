"""Split a list, tuple, dict or tensor into contiguous per-process shares.

Used by ``split_between_processes``: process ``i`` of ``n`` gets a contiguous slice, the first
``len % n`` processes one element more; ``apply_padding`` completes short shares with the input's
last element so that every process holds the same count. A Hugging Face ``datasets.Dataset``
is split with ``select``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["split_for_process"]


def _bounds(length: int, index: int, count: int) -> tuple[int, int]:
    base, extra = divmod(length, count)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _split_sequence(seq: Any, index: int, count: int, apply_padding: bool) -> Any:
    length = len(seq)
    start, end = _bounds(length, index, count)
    share = seq.select(range(start, end)) if _is_hf_dataset(seq) else seq[start:end]
    if not apply_padding or length == 0:
        return share
    target = -(-length // count)  # ceil
    missing = target - (end - start)
    if missing <= 0:
        return share
    # padded with the input's last element, as Accelerate pads
    if isinstance(seq, torch.Tensor):
        return torch.cat([share, seq[-1:].repeat_interleave(missing, dim=0)], dim=0)
    if _is_hf_dataset(seq):
        return seq.select(list(range(start, end)) + [length - 1] * missing)
    padding = [seq[-1]] * missing
    return share + (tuple(padding) if isinstance(seq, tuple) else padding)


def _is_hf_dataset(inputs: Any) -> bool:
    """A Hugging Face ``datasets.Dataset`` (split with ``select``)."""
    return type(inputs).__module__.startswith("datasets.") and hasattr(inputs, "select")


def split_for_process(inputs: Any, index: int, count: int, apply_padding: bool = False) -> Any:
    """Return process ``index``'s share of ``inputs`` out of ``count`` processes."""
    if count <= 1:
        return inputs
    if isinstance(inputs, dict):
        lengths = {key: len(value) for key, value in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"split_between_processes needs every dict value to have the same length; got "
                f"{lengths}."
            )
        return {
            key: _split_sequence(value, index, count, apply_padding)
            for key, value in inputs.items()
        }
    if isinstance(inputs, list | tuple | torch.Tensor) or _is_hf_dataset(inputs):
        return _split_sequence(inputs, index, count, apply_padding)
    raise TypeError(
        f"split_between_processes takes a list, tuple, dict, tensor or datasets.Dataset, not "
        f"{type(inputs).__name__}; convert it to a list first."
    )
