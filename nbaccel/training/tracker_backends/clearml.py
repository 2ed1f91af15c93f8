"""ClearML (``pip install clearml``)."""

from __future__ import annotations

from typing import Any

from nbaccel.training.trackers import GeneralTracker, plain_values, require


class ClearMLTracker(GeneralTracker):
    """Logs to a ClearML task (``Task.init(**kwargs)``, task name ``run_name`` unless given).
    Scalars ``"a/b"`` go to title ``a``, series ``b``; other values are reported as text."""

    name = "clearml"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name or "run")
        self.user_provided_run_name = run_name
        self.init_kwargs = kwargs
        self.task: Any = None

    def start(self) -> None:
        clearml = require("clearml", "clearml", self.name)
        existing = clearml.Task.current_task()
        if existing is not None:
            self.task = existing
            return
        options = dict(self.init_kwargs)
        options.setdefault("project_name", self.user_provided_run_name)
        options.setdefault("task_name", self.user_provided_run_name)
        self.task = clearml.Task.init(**options)

    @property
    def tracker(self) -> Any:
        return self.task

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.task.connect_configuration(plain_values(values))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        logger = self.task.get_logger()
        for key, value in plain_values(values).items():
            if isinstance(value, int | float):
                title, _, series = key.rpartition("/")
                title = title or series
                if step is None:
                    logger.report_single_value(name=key, value=value, **kwargs)
                else:
                    logger.report_scalar(
                        title=title, series=series, value=value, iteration=step, **kwargs
                    )
            else:
                logger.report_text(f"{key}: {value}", **kwargs)

    def finish(self) -> None:
        if self.task is not None and self.user_provided_run_name is not None:
            self.task.close()
