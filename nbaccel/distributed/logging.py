"""Logging that knows about ranks: ``get_logger(name)`` returns a :class:`MultiProcessAdapter`.

Every log call takes two extra keywords: ``main_process_only=True`` (only rank 0 emits, so N
ranks do not print N copies) and ``in_order=False`` (every rank emits, one after another in rank
order, with a barrier between; ``main_process_only`` is then ignored). Messages are prefixed
with ``[RANK i]``. The call site recorded in the
record is the user's line, not this module's.

This file is ``nbaccel.distributed.logging``; it imports the standard library's ``logging``
absolutely, and nothing in nbaccel imports it by a relative name.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from nbaccel.distributed.state import PartialState

__all__ = ["MultiProcessAdapter", "get_logger"]

_LEVEL_VARIABLES = ("NBACCEL_LOG_LEVEL", "ACCELERATE_LOG_LEVEL")


class MultiProcessAdapter(logging.LoggerAdapter):
    """A ``LoggerAdapter`` whose calls take ``main_process_only`` and ``in_order``."""

    @staticmethod
    def _should_log(main_process_only: bool) -> bool:
        return not main_process_only or PartialState().is_main_process

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        """Prefix the message with ``[RANK i]`` and point the record at the caller's line."""
        msg, kwargs = super().process(msg, kwargs)
        # One frame for log(), one for LoggerAdapter.warning/info/...: the user's line.
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {PartialState().process_index}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        if not PartialState._shared_state:
            raise RuntimeError(
                "Create the distributed state first: call PartialState() or Accelerator() before "
                "logging through nbaccel.logging.get_logger (it needs to know the process rank)."
            )
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        if in_order:  # every rank, one after another (main_process_only does not apply)
            state = PartialState()
            for rank in range(state.num_processes):
                if rank == state.process_index:
                    self.logger.log(level, msg, *args, **kwargs)
                state.wait_for_everyone()
        elif self._should_log(main_process_only):
            self.logger.log(level, msg, *args, **kwargs)

    @functools.lru_cache(None)  # noqa: B019 - the cache is the feature: one warning per message
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """``warning`` that emits a given message once per process."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The rank-aware logger for ``name``. ``log_level`` (or ``NBACCEL_LOG_LEVEL`` /
    ``ACCELERATE_LOG_LEVEL``) sets the level of this logger and of the root logger."""
    if log_level is None:
        log_level = next((os.environ[v] for v in _LEVEL_VARIABLES if v in os.environ), None)
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logger.root.setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
