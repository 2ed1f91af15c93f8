"""Comet (``pip install comet_ml``)."""

from __future__ import annotations

from typing import Any

from nbaccel.training.tracking.trackers import GeneralTracker, plain_values, require


class CometMLTracker(GeneralTracker):
    """Logs to a Comet experiment in project ``run_name``; ``**kwargs`` go to
    ``comet_ml.start``. Numbers become metrics, strings "others", dicts groups of metrics."""

    name = "comet_ml"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__(run_name)
        self.init_kwargs = kwargs
        self.writer: Any = None

    def start(self) -> None:
        comet_ml = require("comet_ml", "comet_ml", self.name)
        self.writer = comet_ml.start(project_name=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.writer.log_parameters(plain_values(values))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.writer.set_step(step)
        for key, value in plain_values(values).items():
            if isinstance(value, int | float):
                self.writer.log_metric(key, value, step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.log_other(key, value, **kwargs)
            elif isinstance(value, dict):
                self.writer.log_metrics(value, step=step, **kwargs)

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.end()
