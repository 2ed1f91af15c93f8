"""trackio (``pip install trackio``): a local-first, wandb-compatible tracker."""

from __future__ import annotations

from typing import Any

from nbaccel.training.trackers import GeneralTracker, plain_values, require


class TrackioTracker(GeneralTracker):
    """Logs to a trackio run whose project is ``run_name``; ``**kwargs`` go to ``trackio.init``."""

    name = "trackio"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__(run_name)
        self.init_kwargs = kwargs
        self.run: Any = None

    def start(self) -> None:
        trackio = require("trackio", "trackio", self.name)
        self.run = trackio.init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        trackio = require("trackio", "trackio", self.name)
        trackio.config.update(plain_values(values), allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(plain_values(values), step=step, **kwargs)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
