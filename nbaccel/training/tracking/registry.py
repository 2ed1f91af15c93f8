"""The tracker registry: one table, ``log_with`` name -> :class:`TrackerEntry`.

An entry holds the tracker's class, whether it can run here, and for Accelerate's library
trackers (wandb, comet_ml, aim, mlflow, clearml, dvclive, swanlab, trackio) where the class lives
and what to install: their classes are imported on first use, so naming them costs nothing.
Other packages add theirs with :func:`register_tracker_class` (``nbaccel.notebook.tracker``
registers ``"notebook"`` when ``nbaccel`` is imported). :data:`LOGGER_TYPE_TO_CLASS`
(Accelerate's name) is the table read as name -> class, for every class registered or loaded.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
import warnings
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from nbaccel.training.tracking.trackers import (
    GeneralTracker,
    JSONLinesTracker,
    TensorBoardTracker,
    _tensorboard_available,
)

__all__ = [
    "LOGGER_TYPE_TO_CLASS",
    "TrackerEntry",
    "TrackerRegistry",
    "available_trackers",
    "build_tracker",
    "filter_trackers",
    "get_available_trackers",
    "register_tracker",
    "register_tracker_class",
]


@dataclass
class TrackerEntry:
    """One tracker name: its class (None until a library tracker is first used), whether it can
    run here (None: always), and for a library tracker its module under
    ``nbaccel.training.tracking.backends``, class name, library and pip package."""

    cls: type[GeneralTracker] | None = None
    available: Callable[[], bool] | None = None
    backend: tuple[str, str] | None = None
    library: str | None = None
    pip: str | None = None

    def can_run(self) -> bool:
        if self.available is not None:
            return bool(self.available())
        if self.cls is None and self.library is not None:
            return _importable(self.library)
        return True


def _importable(library: str) -> bool:
    try:
        return importlib.util.find_spec(library) is not None
    except (ImportError, ValueError):
        return False


def _library(module: str, cls_name: str, library: str, pip: str) -> TrackerEntry:
    return TrackerEntry(
        backend=(module, cls_name), library=library, pip=pip, available=lambda: _importable(library)
    )


class TrackerRegistry(MutableMapping[str, type[GeneralTracker]]):
    """Every tracker name, one entry each; read as a mapping it is name -> class of the
    classes registered or loaded (Accelerate's ``LOGGER_TYPE_TO_CLASS``)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._entries: dict[str, TrackerEntry] = {
            "jsonl": TrackerEntry(JSONLinesTracker),
            "tensorboard": TrackerEntry(TensorBoardTracker, available=_tensorboard_available),
            "wandb": _library("wandb", "WandBTracker", "wandb", "wandb"),
            "comet_ml": _library("comet", "CometMLTracker", "comet_ml", "comet_ml"),
            "aim": _library("aim", "AimTracker", "aim", "aim"),
            "mlflow": _library("mlflow", "MLflowTracker", "mlflow", "mlflow"),
            "clearml": _library("clearml", "ClearMLTracker", "clearml", "clearml"),
            "dvclive": _library("dvclive", "DVCLiveTracker", "dvclive", "dvclive"),
            "swanlab": _library("swanlab", "SwanLabTracker", "swanlab", "swanlab"),
            "trackio": _library("trackio", "TrackioTracker", "trackio", "trackio"),
        }

    # the mapping: name -> class, for the classes registered or loaded
    def __getitem__(self, name: str) -> type[GeneralTracker]:
        entry = self._entries.get(name)
        if entry is None or entry.cls is None:
            raise KeyError(name)
        return entry.cls

    def __setitem__(self, name: str, cls: type[GeneralTracker]) -> None:
        with self._lock:
            self._entries[name] = TrackerEntry(cls)

    def __delitem__(self, name: str) -> None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.cls is None:
                raise KeyError(name)
            if entry.backend is None:
                del self._entries[name]
            else:  # a library tracker stays known, its class imported again when used
                entry.cls = None

    def __iter__(self) -> Iterator[str]:
        return iter([n for n, e in list(self._entries.items()) if e.cls is not None])

    def __len__(self) -> int:
        return sum(1 for e in list(self._entries.values()) if e.cls is not None)

    # the registry
    def entry(self, name: str) -> TrackerEntry | None:
        """The entry of ``name``, or None when no tracker has that name."""
        return self._entries.get(name)

    def register(
        self, name: str, cls: type[GeneralTracker], available: Callable[[], bool] | None
    ) -> type[GeneralTracker] | None:
        """Make ``name`` build ``cls``; returns the class it held before, if any."""
        with self._lock:
            old = self._entries.get(name)
            pip = old.pip if old is not None else None
            self._entries[name] = TrackerEntry(cls, available=available, pip=pip)
            return old.cls if old is not None else None

    def load(self, name: str) -> type[GeneralTracker]:
        """The class of ``name``, a library tracker's imported now if it was not yet."""
        with self._lock:
            entry = self._entries[name]
            if entry.cls is None and entry.backend is not None:
                module, cls_name = entry.backend
                path = f"nbaccel.training.tracking.backends.{module}"
                entry.cls = getattr(importlib.import_module(path), cls_name)
            if entry.cls is None:
                raise KeyError(name)
            return entry.cls

    def available(self) -> list[str]:
        """Names that can run here: registered or loaded classes first, then library trackers
        whose library is installed."""
        entries = list(self._entries.items())
        loaded = [n for n, e in entries if e.cls is not None and e.can_run()]
        return loaded + [n for n, e in entries if e.cls is None and e.can_run()]


#: every tracker name; read as a mapping, Accelerate's ``log_with`` name -> tracker class
LOGGER_TYPE_TO_CLASS = TrackerRegistry()


def register_tracker_class(
    tracker_cls: type[GeneralTracker],
    name: str | None = None,
    available: Callable[[], bool] | None = None,
) -> type[GeneralTracker]:
    """Make ``log_with=name`` (default: the class's ``name``) build ``tracker_cls``.

    Usable as a class decorator, as in Accelerate. The class must subclass GeneralTracker and
    declare its own ``name`` (unless ``name=`` is given) and ``requires_logging_directory``
    (ValueError otherwise). ``available()`` says whether the tracker can run here (a missing
    optional package makes it unavailable). Registering a name that another class holds
    replaces that class, with a UserWarning.
    """
    if not (isinstance(tracker_cls, type) and issubclass(tracker_cls, GeneralTracker)):
        raise ValueError(
            f"register_tracker_class needs a GeneralTracker subclass, not {tracker_cls!r}."
        )

    def declares(attr: str) -> bool:
        return any(attr in vars(c) for c in tracker_cls.__mro__ if c is not GeneralTracker)

    name = name or (tracker_cls.name if declares("name") else None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{tracker_cls.__name__} needs a class attribute `name` (a string).")
    if not declares("requires_logging_directory"):
        raise ValueError(
            f"{tracker_cls.__name__} needs a class attribute `requires_logging_directory`: True "
            "when it writes under the Accelerator's logging directory, else False."
        )
    taken = LOGGER_TYPE_TO_CLASS.register(name, tracker_cls, available)
    if taken is not None and taken is not tracker_cls and taken.__name__ != tracker_cls.__name__:
        warnings.warn(
            f"Tracker name {name!r} was registered by {taken.__name__}; {tracker_cls.__name__} "
            "replaces it.",
            UserWarning,
            stacklevel=2,
        )
    return tracker_cls


def register_tracker(
    name: str, tracker_cls: type[GeneralTracker], available: Callable[[], bool] | None = None
) -> None:
    """nbaccel's first spelling: ``register_tracker(name, cls, available)``."""
    register_tracker_class(tracker_cls, name=name, available=available)


def available_trackers() -> list[str]:
    """Names of the registered trackers that can run in this environment."""
    return LOGGER_TYPE_TO_CLASS.available()


def get_available_trackers() -> list[str]:
    """Names of the trackers that can run here (Accelerate's name)."""
    return available_trackers()


def filter_trackers(log_with: Any, logging_dir: str | None = None) -> list[Any]:
    """Resolve ``log_with`` into tracker names and instances (``"all"`` = every available)."""
    if log_with is None:
        return []
    items = log_with if isinstance(log_with, list | tuple) else [log_with]
    resolved: list[Any] = []
    for item in items:
        if isinstance(item, GeneralTracker):
            resolved.append(item)
            continue
        name = str(getattr(item, "value", item)).lower()
        if name == "all":
            resolved += [n for n in available_trackers() if n not in resolved]
            continue
        entry = LOGGER_TYPE_TO_CLASS.entry(name)
        if entry is None:
            raise ValueError(
                f"Unknown tracker {name!r}; registered: {sorted(LOGGER_TYPE_TO_CLASS)}."
            )
        cls = LOGGER_TYPE_TO_CLASS.load(name)
        if not entry.can_run():
            # as Accelerate: a tracker whose package is missing is left out, the run goes on
            warnings.warn(
                f"Tracker {name!r} is skipped: its package is not installed here"
                + (f" (pip install {entry.pip})." if entry.pip else "."),
                stacklevel=3,
            )
            continue
        if cls.requires_logging_directory and logging_dir is None:
            raise ValueError(
                f"Logging with `{name}` requires a `logging_dir`: the tracker writes files. Pass "
                "project_dir= (or a ProjectConfiguration with logging_dir) to Accelerator."
            )
        if name not in resolved:
            resolved.append(name)
    return resolved


def build_tracker(name: str, run_name: str, logging_dir: str | None, **kwargs: Any) -> Any:
    """Instantiate a registered tracker by name."""
    cls = LOGGER_TYPE_TO_CLASS.load(name)
    if cls.requires_logging_directory:
        return cls(run_name, logging_dir=logging_dir, **kwargs)
    return cls(run_name, **kwargs)
