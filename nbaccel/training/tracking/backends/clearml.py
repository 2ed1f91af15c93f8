"""ClearML (``pip install clearml``)."""

from __future__ import annotations

import os
from typing import Any

from nbaccel.training.tracking.trackers import (
    GeneralTracker,
    on_main_process,
    plain_values,
    require,
)

_SERIES_PREFIXES = ("eval", "test", "train")


def _title_and_series(name: str) -> tuple[str, str]:
    """``"eval_loss"`` -> ``("loss", "eval")`` (same for test_/train_); else ``(name, "train")``."""
    for prefix in _SERIES_PREFIXES:
        if name.startswith(prefix + "_"):
            return name[len(prefix) + 1 :], prefix
    return name, "train"


class ClearMLTracker(GeneralTracker):
    """Logs to a ClearML task: the current one when the script already started a task (left
    open at the end), else ``Task.init(**kwargs)`` with project and task named by
    ``CLEARML_PROJECT``/``CLEARML_TASK`` or ``run_name`` (closed by ``end_training``).

    With ``step``, numbers are scalars: ``eval_x``/``test_x``/``train_x`` are series
    ``eval``/``test``/``train`` of title ``x``, other names series ``train``; without ``step``
    they are single values. Other values are reported as text.
    """

    name = "clearml"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name or "run")
        self.user_provided_run_name = run_name
        self.init_kwargs = kwargs
        self.task: Any = None
        self._external = False

    def start(self) -> None:
        clearml = require("clearml", "clearml", self.name)
        existing = clearml.Task.current_task()
        if existing is not None:
            self.task, self._external = existing, True
            return
        options = dict(self.init_kwargs)
        options.setdefault(
            "project_name", os.environ.get("CLEARML_PROJECT", self.user_provided_run_name)
        )
        options.setdefault("task_name", os.environ.get("CLEARML_TASK", self.user_provided_run_name))
        self.task = clearml.Task.init(**options)

    @property
    def tracker(self) -> Any:
        return self.task

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.task.connect_configuration(plain_values(values))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        logger = self.task.get_logger()
        for key, value in plain_values(values).items():
            if not isinstance(value, int | float):
                logger.report_text(f"{key}: {value}")
            elif step is None:
                logger.report_single_value(name=key, value=value, **kwargs)
            else:
                title, series = _title_and_series(key)
                logger.report_scalar(
                    title=title, series=series, value=value, iteration=step, **kwargs
                )

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Report each image (numpy array or PIL image) under its name's title/series."""
        logger = self.task.get_logger()
        for key, image in values.items():
            title, series = _title_and_series(key)
            logger.report_image(title=title, series=series, iteration=step, image=image, **kwargs)

    @on_main_process
    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Report a table: ``dataframe``, or ``data`` rows (headed by ``columns``, else by the
        first row)."""
        if dataframe is None and data is None:
            raise ValueError("log_table needs data= (rows) or dataframe=.")
        table = dataframe if dataframe is not None else ([columns, *data] if columns else data)
        title, series = _title_and_series(table_name)
        self.task.get_logger().report_table(
            title=title, series=series, table_plot=table, iteration=step, **kwargs
        )

    def finish(self) -> None:
        if self.task is not None and not self._external:
            self.task.close()
