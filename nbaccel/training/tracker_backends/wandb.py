"""Weights & Biases (``pip install wandb``): one wandb run per ``init_trackers`` call."""

from __future__ import annotations

from typing import Any

from nbaccel.training.trackers import GeneralTracker, plain_values, require


class WandBTracker(GeneralTracker):
    """Logs to a wandb run whose project is ``run_name``; ``**kwargs`` go to ``wandb.init``."""

    name = "wandb"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__(run_name)
        self.init_kwargs = kwargs
        self.run: Any = None

    def start(self) -> None:
        wandb = require("wandb", "wandb", self.name)
        self.run = wandb.init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(plain_values(values), allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(plain_values(values), step=step, **kwargs)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
