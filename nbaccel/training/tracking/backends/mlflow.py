"""MLflow (``pip install mlflow``): a run in an experiment, on any tracking store (a local
``file:`` store included: ``logging_dir``)."""

from __future__ import annotations

import json
import os
from typing import Any

from nbaccel.training.tracking.trackers import (
    GeneralTracker,
    on_main_process,
    plain_values,
    require,
)
from nbaccel.values.booleans import parse_bool

_MAX_PARAM = 500  # MLflow's limit on a parameter value's length when mlflow does not say


class MLflowTracker(GeneralTracker):
    """Logs to an MLflow run. ``experiment_name`` (or ``MLFLOW_EXPERIMENT_NAME``) names the
    experiment, created when missing; ``logging_dir`` (or ``MLFLOW_TRACKING_URI``) is the
    tracking store; ``MLFLOW_TAGS`` (JSON) and ``MLFLOW_NESTED_RUN`` (a boolean) override
    ``tags`` and ``nested_run``. Numbers are metrics; parameters longer than MLflow allows are
    skipped with a warning. ``log_figure``/``log_artifact``/``log_artifacts`` store files."""

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
        tags = os.environ.get("MLFLOW_TAGS", tags)
        self.tags = json.loads(tags) if isinstance(tags, str) else tags
        nested = os.environ.get("MLFLOW_NESTED_RUN")
        self.nested_run = (
            parse_bool(nested, "MLFLOW_NESTED_RUN") if nested is not None else bool(nested_run)
        )
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
        limit = _max_param_length(mlflow)
        params = {}  # a new dict: the caller's (shared by every tracker) is left as it is
        for key, value in plain_values(values).items():
            if len(str(value)) > limit:
                warnings.warn(
                    f"MLflow parameter {key!r} is longer than {limit} characters: skipped.",
                    stacklevel=2,
                )
                continue
            params[key] = value
        mlflow.log_params(params)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        mlflow = require("mlflow", "mlflow", self.name)
        metrics = {k: v for k, v in plain_values(values).items() if isinstance(v, int | float)}
        mlflow.log_metrics(metrics, step=step, **kwargs)

    @on_main_process
    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """Store a matplotlib/plotly ``figure`` in the run as ``artifact_file``."""
        mlflow = require("mlflow", "mlflow", self.name)
        mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Store every file under ``local_dir`` in the run (under ``artifact_path``)."""
        mlflow = require("mlflow", "mlflow", self.name)
        mlflow.log_artifacts(local_dir=os.fspath(local_dir), artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Store one file in the run (under ``artifact_path``)."""
        mlflow = require("mlflow", "mlflow", self.name)
        mlflow.log_artifact(local_path=os.fspath(local_path), artifact_path=artifact_path)

    def finish(self) -> None:
        if self.active_run is not None:
            mlflow = require("mlflow", "mlflow", self.name)
            mlflow.end_run()


def _max_param_length(mlflow: Any) -> int:
    """MLflow's own limit on a parameter value's length (it grew across releases)."""
    try:
        from mlflow.utils import validation
    except ImportError:
        return _MAX_PARAM
    return int(getattr(validation, "MAX_PARAM_VAL_LENGTH", _MAX_PARAM))
