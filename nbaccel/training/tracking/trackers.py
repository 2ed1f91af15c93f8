"""Experiment trackers: one interface, a registry by name, two built-ins.

``GeneralTracker`` is the interface (``name``, ``requires_logging_directory``, ``tracker``,
``start``, ``store_init_configuration``, ``log``, ``finish``). Built in: ``"jsonl"`` (one JSON
object per line in ``<logging_dir>/<run_name>/metrics.jsonl``, no dependencies) and
``"tensorboard"`` (when ``torch.utils.tensorboard`` can be imported). Accelerate's other names
(wandb, comet_ml, aim, mlflow, clearml, dvclive, swanlab, trackio) live in
:mod:`nbaccel.training.tracking.backends`, imported only when used; a missing library is an
ImportError naming its pip package. Other packages add theirs with
:func:`register_tracker_class` (``nbaccel.notebook.tracker`` registers ``"notebook"`` when
``nbaccel`` is imported). :data:`LOGGER_TYPE_TO_CLASS` maps every registered name to its class.
Trackers run on the main process only.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "LOGGER_TYPE_TO_CLASS",
    "GeneralTracker",
    "JSONLinesTracker",
    "LoggerType",
    "TensorBoardTracker",
    "TrackerSet",
    "available_trackers",
    "filter_trackers",
    "plain_values",
    "register_tracker",
    "register_tracker_class",
    "require",
]


class LoggerType:
    """Tracker names known to nbaccel (strings; plug-ins may add more)."""

    ALL = "all"
    JSONL = "jsonl"
    TENSORBOARD = "tensorboard"
    NOTEBOOK = "notebook"
    AIM = "aim"
    WANDB = "wandb"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    TRACKIO = "trackio"


class GeneralTracker:
    """Base class of trackers.

    Subclasses set ``name`` and ``requires_logging_directory``, take ``run_name`` (and
    ``logging_dir`` when they need one) in ``__init__``, and implement ``log``. ``start()`` is
    called by ``init_trackers`` before anything is logged (open runs, files, connections there).
    """

    name: str = "general"
    requires_logging_directory: bool = False
    main_process_only: bool = True

    def __init__(self, run_name: str = "run", **kwargs: Any) -> None:
        self.run_name = run_name

    @property
    def tracker(self) -> Any:
        """The underlying library object (the run, the writer...)."""
        return None

    def start(self) -> None:
        """Open the run (called once by ``init_trackers``, on the processes that track)."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyper-parameters once, at the start."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` (scalars, or anything the tracker accepts) at ``step``."""
        raise NotImplementedError

    def finish(self) -> None:
        """Flush and close."""


def _plain(value: Any) -> Any:
    """Tensors and numpy scalars as Python numbers, so they serialise."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def plain_values(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with tensors and numpy scalars as Python numbers (what tracker libraries take)."""
    return {k: _plain(v) for k, v in dict(values).items()}


def require(module: str, pip_name: str, tracker: str) -> Any:
    """Import a tracker's library, or raise ImportError naming the pip package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"The {tracker!r} tracker needs the {pip_name!r} package: pip install {pip_name}"
        ) from err


class JSONLinesTracker(GeneralTracker):
    """Append one JSON object per ``log`` call to ``<logging_dir>/<run_name>/metrics.jsonl``."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(run_name)
        self.directory = Path(logging_dir) / run_name
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finish

    @property
    def tracker(self) -> Any:
        return self._file

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        (self.directory / "config.json").write_text(json.dumps(_plain(values), default=str))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        record = {"step": step, "time": time.time(), **_plain(dict(values))}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def finish(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardTracker(GeneralTracker):
    """Scalars (and dicts of scalars) to TensorBoard event files under ``logging_dir/run_name``."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        super().__init__(run_name)
        self.logging_dir = os.path.join(logging_dir, run_name)
        self.writer = SummaryWriter(self.logging_dir, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Hyperparameters to TensorBoard, and to ``<run>/<timestamp>/hparams.yml`` as
        Accelerate keeps them for later use."""
        import yaml

        self.writer.add_hparams(_plain(values), metric_dict={})
        self.writer.flush()
        folder = Path(self.logging_dir) / str(time.time())
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hparams.yml").write_text(yaml.safe_dump(_plain(values)))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in _plain(dict(values)).items():
            if isinstance(value, int | float):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


def _tensorboard_available() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


#: ``log_with`` name -> tracker class, for every registered tracker.
LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "jsonl": JSONLinesTracker,
    "tensorboard": TensorBoardTracker,
}
# name -> "can it run here?" (a missing optional package makes a tracker unavailable)
_AVAILABLE: dict[str, Callable[[], bool]] = {"tensorboard": _tensorboard_available}


# Accelerate's library trackers: name -> (module of the class, class name, library, pip name).
_BACKENDS: dict[str, tuple[str, str, str, str]] = {
    "wandb": ("wandb", "WandBTracker", "wandb", "wandb"),
    "comet_ml": ("comet", "CometMLTracker", "comet_ml", "comet_ml"),
    "aim": ("aim", "AimTracker", "aim", "aim"),
    "mlflow": ("mlflow", "MLflowTracker", "mlflow", "mlflow"),
    "clearml": ("clearml", "ClearMLTracker", "clearml", "clearml"),
    "dvclive": ("dvclive", "DVCLiveTracker", "dvclive", "dvclive"),
    "swanlab": ("swanlab", "SwanLabTracker", "swanlab", "swanlab"),
    "trackio": ("trackio", "TrackioTracker", "trackio", "trackio"),
}


def _backend_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(_BACKENDS[name][2]) is not None
    except (ImportError, ValueError):
        return False


def _backend(name: str) -> type[GeneralTracker]:
    """Register a library tracker on first use (its module imports nothing heavy)."""
    module, cls_name, _lib, _pip = _BACKENDS[name]
    cls = getattr(importlib.import_module(f"nbaccel.training.tracking.backends.{module}"), cls_name)
    LOGGER_TYPE_TO_CLASS[name] = cls
    _AVAILABLE[name] = lambda: _backend_available(name)
    return cls


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
    taken = LOGGER_TYPE_TO_CLASS.get(name)
    if taken is not None and taken is not tracker_cls and taken.__name__ != tracker_cls.__name__:
        warnings.warn(
            f"Tracker name {name!r} was registered by {taken.__name__}; {tracker_cls.__name__} "
            "replaces it.",
            UserWarning,
            stacklevel=2,
        )
    LOGGER_TYPE_TO_CLASS[name] = tracker_cls
    if available is not None:
        _AVAILABLE[name] = available
    else:
        _AVAILABLE.pop(name, None)
    return tracker_cls


def register_tracker(
    name: str, tracker_cls: type[GeneralTracker], available: Callable[[], bool] | None = None
) -> None:
    """nbaccel's first spelling: ``register_tracker(name, cls, available)``."""
    register_tracker_class(tracker_cls, name=name, available=available)


def _available(name: str) -> bool:
    check = _AVAILABLE.get(name)
    return check is None or bool(check())


def available_trackers() -> list[str]:
    """Names of the registered trackers that can run in this environment."""
    names = [name for name in LOGGER_TYPE_TO_CLASS if _available(name)]
    return names + [n for n in _BACKENDS if n not in names and _backend_available(n)]


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
        if name not in LOGGER_TYPE_TO_CLASS and name in _BACKENDS:
            _backend(name)
        if name not in LOGGER_TYPE_TO_CLASS:
            raise ValueError(
                f"Unknown tracker {name!r}; registered: {sorted(LOGGER_TYPE_TO_CLASS)}."
            )
        cls = LOGGER_TYPE_TO_CLASS[name]
        if not _available(name):
            # as Accelerate: a tracker whose package is missing is left out, the run goes on
            warnings.warn(
                f"Tracker {name!r} is skipped: its package is not installed here"
                + (f" (pip install {_BACKENDS[name][3]})." if name in _BACKENDS else "."),
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
    cls = LOGGER_TYPE_TO_CLASS[name] if name in LOGGER_TYPE_TO_CLASS else _backend(name)
    if cls.requires_logging_directory:
        return cls(run_name, logging_dir=logging_dir, **kwargs)
    return cls(run_name, **kwargs)


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
