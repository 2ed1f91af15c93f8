"""DVCLive (``pip install dvclive``)."""

from __future__ import annotations

import warnings
from typing import Any

from nbaccel.training.tracking.trackers import GeneralTracker, plain_values, require


class DVCLiveTracker(GeneralTracker):
    """Logs through a ``dvclive.Live`` (``live=`` an existing one, else one built from
    ``**kwargs``). Numbers and strings become metrics (other values are skipped with a
    warning); ``step`` sets the Live step."""

    name = "dvclive"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any) -> None:
        super().__init__(run_name or "run")
        self.live = live
        self.init_kwargs = kwargs

    def start(self) -> None:
        if self.live is None:
            dvclive = require("dvclive", "dvclive", self.name)
            self.live = dvclive.Live(**self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.live

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.live.log_params(plain_values(values))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.live.step = step
        from dvclive.plots import Metric

        for key, value in plain_values(values).items():
            if Metric.could_log(value):  # numbers and strings, as DVCLive records them
                self.live.log_metric(key, value, **kwargs)
            else:
                warnings.warn(
                    f"DVCLive cannot log {key!r} ({type(value).__name__}): skipped.", stacklevel=2
                )
        self.live.next_step()

    def finish(self) -> None:
        if self.live is not None:
            self.live.end()
