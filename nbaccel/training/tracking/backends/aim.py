"""Aim (``pip install aim``): runs in a local Aim repository (``logging_dir``)."""

from __future__ import annotations

import os
from typing import Any

from nbaccel.training.tracking.trackers import GeneralTracker, plain_values, require


class AimTracker(GeneralTracker):
    """Tracks into the Aim repo at ``logging_dir`` under run name ``run_name``; ``**kwargs``
    go to ``aim.Run``."""

    name = "aim"
    requires_logging_directory = True

    def __init__(
        self, run_name: str, logging_dir: str | os.PathLike | None = ".", **kwargs: Any
    ) -> None:
        super().__init__(run_name)
        self.aim_repo_path = os.fspath(logging_dir or ".")
        self.init_kwargs = kwargs
        self.writer: Any = None

    def start(self) -> None:
        aim = require("aim", "aim", self.name)
        self.writer = aim.Run(repo=self.aim_repo_path, **self.init_kwargs)
        self.writer.name = self.run_name

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.writer["hparams"] = plain_values(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in plain_values(values).items():
            self.writer.track(value, name=key, step=step, **kwargs)

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
