"""Sizes in bytes, as people write them: the one parser of ``max_memory``, ``max_shard_size`` and
``size_limit`` values.

Accepted: a non-negative int or float (bytes), or a string ``"<number>[unit]"`` where the unit is
one of B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), in any case,
spaces allowed around it; no unit means bytes. Refused, with the accepted forms named: ``bool``,
negative or non-finite numbers, anything else.
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_size"]

_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]I?B|B)?\s*", re.IGNORECASE)
_FORMS = "an int number of bytes or a string such as '10GiB', '5GB', '512MiB', '800MB' or '1024'"


def parse_size(size: int | float | str, what: str = "size") -> int:
    """``"10GiB"`` -> 10737418240, ``"5GB"`` -> 5000000000, ``"1024"`` or ``1024`` -> 1024.

    ``what`` names the value in the error (``"memory size"``, ``"max_shard_size"``).
    """
    if isinstance(size, bool):
        raise ValueError(f"Invalid {what} {size!r}: a bool is not a size; use {_FORMS}.")
    if isinstance(size, int | float):
        if size < 0 or not math.isfinite(size):
            raise ValueError(f"Invalid {what} {size!r}: sizes are finite and >= 0; use {_FORMS}.")
        return int(size)
    if isinstance(size, str):
        match = _SIZE.fullmatch(size)
        if match:
            number, unit = match.groups()
            return int(float(number) * _UNITS[(unit or "B").upper()])
    raise ValueError(
        f"Invalid {what} {size!r}: use {_FORMS} (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)."
    )
