"""Weights & Biases (``pip install wandb``): one wandb run per ``init_trackers`` call."""

from __future__ import annotations

from nbaccel.training.tracking.backends.project_run import ProjectRunTracker


class WandBTracker(ProjectRunTracker):
    """Logs to a wandb run whose project is ``run_name``; ``**kwargs`` go to ``wandb.init``."""

    name = "wandb"
    library = "wandb"
    config_keywords = {"allow_val_change": True}  # read only
