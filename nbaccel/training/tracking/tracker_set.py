"""The trackers of one accelerator (:class:`TrackerSet`): resolved from ``log_with`` through
the registry, built on the main process only, started, logged to and finished together."""

from __future__ import annotations

from typing import Any

from nbaccel.training.tracking.registry import build_tracker, filter_trackers
from nbaccel.training.tracking.trackers import GeneralTracker

__all__ = ["TrackerSet"]


class _InactiveTracker(GeneralTracker):
    """What ``get_tracker`` returns on processes that do not track: every call does nothing."""

    name = "inactive"

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        return None


class TrackerSet:
    """The trackers of one accelerator: built on the main process only, used by name."""

    def __init__(self, log_with: Any, logging_dir: str | None, is_main_process: bool) -> None:
        self.wanted = filter_trackers(log_with, logging_dir)
        self.logging_dir = logging_dir
        self.is_main_process = is_main_process
        self.trackers: list[GeneralTracker] = []
        self.finished = False

    def init(self, project_name: str, config: dict | None, init_kwargs: dict | None) -> None:
        init_kwargs = init_kwargs or {}
        if self.finished:  # a new run after end_training(): the finished trackers are let go
            self.trackers, self.finished = [], False
        for item in self.wanted:
            if isinstance(item, GeneralTracker):
                tracker = item
            elif self.is_main_process:
                tracker = build_tracker(
                    item, project_name, self.logging_dir, **init_kwargs.get(item, {})
                )
            else:
                continue
            if self.is_main_process or not tracker.main_process_only:
                self.trackers.append(tracker)
        for tracker in self.trackers:
            tracker.start()
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def log(self, values: dict[str, Any], step: int | None, log_kwargs: dict | None) -> None:
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get(self, name: str, unwrap: bool = False) -> Any:
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if self.is_main_process and any(getattr(w, "name", w) == name for w in self.wanted):
            raise ValueError(f"Tracker {name!r} is not started yet: call init_trackers() first.")
        if self.is_main_process:
            raise ValueError(
                f"No tracker named {name!r}; started: {[t.name for t in self.trackers]}."
            )
        return _InactiveTracker()

    def finish(self) -> None:
        """Finish every tracker once; they stay listed (``accelerator.trackers``), as in
        Accelerate, so their files and runs can be inspected after ``end_training()``."""
        if not self.finished:
            for tracker in self.trackers:
                tracker.finish()
        self.finished = True
