"""Parse the ``--ranks`` option of ``%%distributed``: ``0``, ``0,2``, ``1-3``, ``all``."""

from __future__ import annotations

__all__ = ["parse_names", "parse_ranks"]


def parse_ranks(spec: str | None, world_size: int) -> list[int]:
    """The sorted ranks named by ``spec`` (None or "all": every rank); ValueError when invalid."""
    if spec is None or spec.strip().lower() in ("", "all", "*"):
        return list(range(world_size))
    ranks: set[int] = set()
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part[1:]:
                low_text, high_text = part.split("-", 1)
                low, high = int(low_text), int(high_text)
                if low > high:
                    raise ValueError
                ranks.update(range(low, high + 1))
            else:
                ranks.add(int(part))
        except ValueError:
            raise ValueError(
                f"--ranks {spec!r}: {part!r} is not a rank or a range; use e.g. 0, 0,2 or 1-3."
            ) from None
    outside = sorted(r for r in ranks if not 0 <= r < world_size)
    if outside:
        raise ValueError(
            f"--ranks {spec!r}: rank(s) {outside} are not in the pool, which has ranks "
            f"0-{world_size - 1}."
        )
    if not ranks:
        raise ValueError(f"--ranks {spec!r} names no rank.")
    return sorted(ranks)


def parse_names(values: list[str] | None) -> list[str]:
    """Variable names from ``--push a,b --push c`` or ``a b c``; ValueError for a non-name."""
    names: list[str] = []
    for value in values or []:
        for name in value.replace(",", " ").split():
            if not name.isidentifier():
                raise ValueError(f"{name!r} is not a variable name.")
            if name not in names:
                names.append(name)
    return names
