"""What a rank inherited from the process it was forked from: the modules ``sys.modules`` held
at the fork. The fork server notes them after its preloading (every rank forked from it inherits
the note); a rank forked from the kernel itself (``start_method="fork"``) notes them first thing.
What a rank imports beyond them is its own start-up cost, paid again by every rank of every
launch.
"""

from __future__ import annotations

import sys

__all__ = ["inherited_modules", "note_inherited"]


class _Inherited:
    """The note, one per process (a forked child gets its parent's)."""

    modules: frozenset[str] | None = None


_note = _Inherited()


def note_inherited() -> None:
    """What this process holds now is what a rank forked from it inherits."""
    _note.modules = frozenset(sys.modules)


def inherited_modules() -> frozenset[str] | None:
    """In a rank forked by the server (or from the kernel, ``start_method="fork"``): the
    modules it had imported for it (what ``sys.modules`` held at the fork); None elsewhere."""
    return _note.modules
