"""trackio (``pip install trackio``): a local-first, wandb-compatible tracker."""

from __future__ import annotations

from nbaccel.training.tracking.backends.project_run import ProjectRunTracker


class TrackioTracker(ProjectRunTracker):
    """Logs to a trackio run whose project is ``run_name``; ``**kwargs`` go to ``trackio.init``."""

    name = "trackio"
    library = "trackio"
    config_on_run = False  # trackio.config: the current run's
    config_keywords = {"allow_val_change": True}  # read only
