"""Experiment trackers: the interface and the two built-ins.

``GeneralTracker`` is the interface (``name``, ``requires_logging_directory``, ``tracker``,
``start``, ``store_init_configuration``, ``log``, ``finish``). Built in: ``"jsonl"`` (one JSON
object per line in ``<logging_dir>/<run_name>/metrics.jsonl``, no dependencies) and
``"tensorboard"`` (when ``torch.utils.tensorboard`` can be imported). Accelerate's other names
(wandb, comet_ml, aim, mlflow, clearml, dvclive, swanlab, trackio) live in
:mod:`nbaccel.training.tracking.backends`; the names are kept in
:mod:`nbaccel.training.tracking.registry`. Trackers run on the main process only
(:func:`on_main_process`).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbaccel.distributed.state import PartialState

__all__ = [
    "GeneralTracker",
    "JSONLinesTracker",
    "LoggerType",
    "TensorBoardTracker",
    "on_main_process",
    "plain_values",
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


def on_main_process(function: Callable[..., Any]) -> Callable[..., Any]:
    """Run a tracker method on the main process only (when the tracker's
    ``main_process_only`` is True); elsewhere the call returns None."""

    @functools.wraps(function)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and not PartialState().is_main_process:
            return None
        return function(self, *args, **kwargs)

    return wrapper
