"""Byte counts as text for people: ``human_bytes(1536) == "1.5 KiB"``."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(size: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``None`` -> ``"-"`` (binary units, B up to TiB)."""
    if size is None:
        return "-"
    size = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
