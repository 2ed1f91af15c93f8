"""Directories that appear complete or not at all.

A checkpoint (or a saved model) is written into a hidden staging sibling
(``.<name>.partial``), flushed to disk, and only then renamed into place. A process killed
mid-write leaves the previous directory untouched. Replacing an existing directory takes two
renames; if a process dies between them, :func:`recover` (called before every load) puts the old
directory back.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

__all__ = ["begin_staging", "commit_staging", "recover", "staging_path"]


def staging_path(final: str | os.PathLike) -> Path:
    """The hidden sibling a directory is written into before it is renamed into place."""
    final = Path(final).absolute()
    return final.parent / f".{final.name}.partial"


def _previous_path(final: Path) -> Path:
    return final.parent / f".{final.name}.previous"


def begin_staging(final: str | os.PathLike) -> Path:
    """Create an empty staging directory for ``final`` (removing a stale one from a killed save)."""
    staging = staging_path(final)
    staging.parent.mkdir(parents=True, exist_ok=True)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(mode=0o700)
    return staging


def _fsync_tree(directory: Path) -> None:
    for root, _dirs, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not fsync directories
    finally:
        os.close(fd)


def commit_staging(
    final: str | os.PathLike, carry_over: Callable[[str], bool] | None = None
) -> Path:
    """Flush the staging directory and rename it to ``final``, replacing what was there.

    ``carry_over(name)`` selects files of the old ``final`` to keep in the new one (e.g. a
    ``config.json`` next to saved weights).
    """
    final = Path(final).absolute()
    staging = staging_path(final)
    if carry_over is not None and final.is_dir():
        for entry in final.iterdir():
            target = staging / entry.name
            if entry.is_file() and carry_over(entry.name) and not target.exists():
                shutil.copy2(entry, target)
    _fsync_tree(staging)
    previous = _previous_path(final)
    if previous.exists():
        shutil.rmtree(previous)
    if final.exists():
        os.rename(final, previous)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    if previous.exists():
        shutil.rmtree(previous, ignore_errors=True)
    return final


def recover(final: str | os.PathLike) -> None:
    """Undo a replacement that was interrupted between its two renames."""
    final = Path(final).absolute()
    previous = _previous_path(final)
    if not previous.exists():
        return
    if final.exists():
        shutil.rmtree(previous, ignore_errors=True)  # the new one made it: drop the old
    else:
        os.rename(previous, final)
