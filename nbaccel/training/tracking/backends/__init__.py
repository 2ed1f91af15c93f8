"""Trackers for third-party experiment-tracking libraries, one file per library, with
Accelerate's class names and arguments. Each library is imported in ``start()`` (so building
the tracker costs nothing) and a missing one is an ImportError naming the pip package."""

from nbaccel.training.tracking.backends.aim import AimTracker
from nbaccel.training.tracking.backends.clearml import ClearMLTracker
from nbaccel.training.tracking.backends.comet import CometMLTracker
from nbaccel.training.tracking.backends.dvclive import DVCLiveTracker
from nbaccel.training.tracking.backends.mlflow import MLflowTracker
from nbaccel.training.tracking.backends.swanlab import SwanLabTracker
from nbaccel.training.tracking.backends.trackio import TrackioTracker
from nbaccel.training.tracking.backends.wandb import WandBTracker

__all__ = [
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "MLflowTracker",
    "SwanLabTracker",
    "TrackioTracker",
    "WandBTracker",
]
