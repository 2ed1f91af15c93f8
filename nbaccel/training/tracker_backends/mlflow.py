"""MLflow (``pip install mlflow``): a run in an experiment, on any tracking store (a local
``file:`` store included: ``logging_dir``)."""

from __future__ import annotations

import os
from typing import Any

from nbaccel.training.trackers import GeneralTracker, plain_values, require

_MAX_PARAM = 500  # MLflow's limit on a parameter value's length


class MLflowTracker(GeneralTracker):
    """Logs to an MLflow run. ``experiment_name`` (or ``MLFLOW_EXPERIMENT_NAME``) names the
    experiment, created when missing; ``logging_dir`` (or ``MLFLOW_TRACKING_URI``) is the
    tracking store. Numbers are metrics; parameters longer than MLflow allows are skipped with
    a warning."""

    name = "mlflow"
    requires_logging_directory = False

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike | None = None,
        run_id: str | None = None,
        tags: dict[str, Any] | str | None = None,
        nested_run: bool = False,
        run_name: str | None = None,
        description: str | None = None,
    ) -> None:
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        self.tags = tags
        self.nested_run = nested_run
        self.description = description
        uri = os.environ.get("MLFLOW_TRACKING_URI", logging_dir)
        self.logging_dir = None if uri is None else os.fspath(uri)
        super().__init__(os.environ.get("MLFLOW_RUN_NAME", run_name) or "run")
        self.active_run: Any = None

    def start(self) -> None:
        mlflow = require("mlflow", "mlflow", self.name)
        if self.logging_dir is not None:
            mlflow.set_tracking_uri(self.logging_dir)
        experiment_id = None
        if self.experiment_name:
            found = mlflow.get_experiment_by_name(self.experiment_name)
            experiment_id = (
                found.experiment_id
                if found is not None
                else mlflow.create_experiment(self.experiment_name)
            )
        self.active_run = mlflow.start_run(
            run_id=self.run_id,
            experiment_id=experiment_id,
            run_name=self.run_name,
            nested=self.nested_run,
            tags=self.tags,
            description=self.description,
        )

    @property
    def tracker(self) -> Any:
        return self.active_run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import warnings

        mlflow = require("mlflow", "mlflow", self.name)
        params = {}
        for key, value in plain_values(values).items():
            if len(str(value)) > _MAX_PARAM:
                warnings.warn(
                    f"MLflow parameter {key!r} is longer than {_MAX_PARAM} characters: skipped.",
                    stacklevel=2,
                )
                continue
            params[key] = value
        mlflow.log_params(params)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        mlflow = require("mlflow", "mlflow", self.name)
        metrics = {k: v for k, v in plain_values(values).items() if isinstance(v, int | float)}
        mlflow.log_metrics(metrics, step=step, **kwargs)

    def finish(self) -> None:
        if self.active_run is not None:
            mlflow = require("mlflow", "mlflow", self.name)
            mlflow.end_run()
