"""SwanLab (``pip install swanlab``)."""

from __future__ import annotations

from nbaccel.training.tracking.backends.project_run import ProjectRunTracker


class SwanLabTracker(ProjectRunTracker):
    """Logs to a SwanLab run whose project is ``run_name``; ``**kwargs`` go to ``swanlab.init``."""

    name = "swanlab"
    library = "swanlab"
    config_on_run = False  # swanlab.config: the current run's
