"""The part that wandb, SwanLab and trackio share: a library whose ``init(project=...)`` opens
a run that ``log``s and ``finish``es, with a ``config`` that takes the run's settings."""

from __future__ import annotations

from typing import Any

from nbaccel.training.tracking.trackers import GeneralTracker, plain_values, require

__all__ = ["ProjectRunTracker"]


class ProjectRunTracker(GeneralTracker):
    """Logs to a run of ``library`` whose project is ``run_name``; ``**kwargs`` go to
    ``library.init``. The library is imported in :meth:`start` (an ImportError names the pip
    package, ``library`` too).

    Subclasses set ``name`` and ``library``; ``config_on_run`` says where the run's settings
    go (``run.config``, else the library's module-level ``config``) and ``config_keywords``
    what its ``update`` takes besides them.
    """

    requires_logging_directory = False
    library = ""  # the module (and pip package) to import
    config_on_run = True
    config_keywords: dict[str, Any] = {}  # read only

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__(run_name)
        self.init_kwargs = kwargs
        self.run: Any = None

    def _library(self) -> Any:
        return require(self.library, self.library, self.name)

    def start(self) -> None:
        self.run = self._library().init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        config = self.run.config if self.config_on_run else self._library().config
        config.update(plain_values(values), **self.config_keywords)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(plain_values(values), step=step, **kwargs)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
