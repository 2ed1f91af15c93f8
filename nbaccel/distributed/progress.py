"""A ``tqdm`` progress bar shown by the main process only (other ranks get a disabled bar)."""

from __future__ import annotations

from typing import Any

from nbaccel.distributed.state import PartialState

__all__ = ["tqdm"]


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(*args, **kwargs)``, disabled on every rank but the local main one
    unless ``main_process_only=False``. The first positional argument must be the iterable
    (a bool there is the old calling convention and is rejected with the fix)."""
    try:
        from tqdm.auto import tqdm as _tqdm
    except ImportError as exc:
        raise ImportError("nbaccel's tqdm needs the tqdm package: pip install tqdm") from exc
    if args and isinstance(args[0], bool):
        raise ValueError(
            "Pass the iterable first and main_process_only as a keyword: "
            "tqdm(iterable, main_process_only=True)."
        )
    if main_process_only:
        kwargs["disable"] = kwargs.get("disable", False) or not PartialState().is_local_main_process
    return _tqdm(*args, **kwargs)
