"""The listing of detached runs and pools as plain text, one line a run or pool.

Shared by ``nbaccel runs`` / ``nbaccel pools`` and the notebook's ``runs()`` / ``pools()``, so
the shell and the notebook show the same table. Each row is a ``row()`` of
:class:`~nbaccel.launch.detached.folder.RunInfo` or
:class:`~nbaccel.launch.detached.pool_folder.PoolInfo`: column name to text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["MAX_WIDTH", "listing_text"]

MAX_WIDTH = 60  # a column's widest, in characters: longer text is cut


def listing_text(rows: Sequence[Mapping[str, str]], empty: str) -> str:
    """``rows`` as aligned columns under a header line, each column at most ``MAX_WIDTH``
    wide; ``empty`` (what to say) when there are none."""
    if not rows:
        return empty
    columns = list(rows[0])
    widths = {c: min(MAX_WIDTH, max(len(c), *(len(str(r[c])) for r in rows))) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r[c])[: widths[c]].ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
