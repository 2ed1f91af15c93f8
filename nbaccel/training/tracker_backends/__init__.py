"""Trackers for third-party experiment-tracking libraries, one file per library, with
Accelerate's class names and arguments. Each library is imported in ``start()`` (so building
the tracker costs nothing) and a missing one is an ImportError naming the pip package."""

from nbaccel.training.tracker_backends.aim import AimTracker
from nbaccel.training.tracker_backends.clearml import ClearMLTracker
from nbaccel.training.tracker_backends.comet import CometMLTracker
from nbaccel.training.tracker_backends.dvclive import DVCLiveTracker
from nbaccel.training.tracker_backends.mlflow import MLflowTracker
from nbaccel.training.tracker_backends.swanlab import SwanLabTracker
from nbaccel.training.tracker_backends.trackio import TrackioTracker
from nbaccel.training.tracker_backends.wandb import WandBTracker

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
