"""Byte counts as text for people: the one place that picks the unit of a size.

``human_bytes(1536) == "1.5 KiB"`` is nbaccel's own style (tables, widgets, status lines);
``convert_bytes(1536) == "1.5 KB"`` is Accelerate's (``accelerate.utils.convert_bytes``), kept
for scripts that print or parse it. Both steps by 1024.
"""

from __future__ import annotations

__all__ = ["byte_unit", "convert_bytes", "human_bytes"]

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB")
_ACCELERATE = ("bytes", "KB", "MB", "GB", "TB", "PB")


def _scaled(size: float, units: tuple[str, ...]) -> tuple[float, str]:
    """``size`` divided by 1024 until it is below 1024 or the units run out."""
    for unit in units[:-1]:
        if abs(size) < 1024:
            return size, unit
        size /= 1024
    return size, units[-1]


def human_bytes(size: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``, ``100`` -> ``"100 B"``; ``None`` -> ``"-"`` (B up to TiB)."""
    if size is None:
        return "-"
    value, unit = _scaled(float(size), _BINARY)
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"


def convert_bytes(size: float) -> str:
    """``1536`` -> ``"1.5 KB"``: Accelerate's spelling (bytes, KB ... PB; two decimals at most)."""
    value, unit = _scaled(size, _ACCELERATE)
    return f"{round(value, 2)} {unit}"


def byte_unit(size: float) -> tuple[str, int]:
    """The binary unit to draw ``size`` in, and its bytes: ``byte_unit(3 * 2**20) == ("MiB",
    2**20)`` (for an axis whose largest value is ``size``)."""
    _, unit = _scaled(float(size), _BINARY)
    return unit, 1024 ** _BINARY.index(unit)
