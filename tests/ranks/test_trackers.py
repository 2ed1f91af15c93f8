"""Trackers with Accelerate's names and life cycle: custom trackers are start()ed, TensorBoard
really writes event files, the library trackers not installed here fail with the pip name."""

import importlib.util

import pytest
import torch

from nbaccel.testing import run_on_ranks

LIBRARIES = {
    "wandb": ("wandb", "WandBTracker"),
    "comet_ml": ("comet_ml", "CometMLTracker"),
    "aim": ("aim", "AimTracker"),
    "mlflow": ("mlflow", "MLflowTracker"),
    "clearml": ("clearml", "ClearMLTracker"),
    "dvclive": ("dvclive", "DVCLiveTracker"),
    "swanlab": ("swanlab", "SwanLabTracker"),
    "trackio": ("trackio", "TrackioTracker"),
}


def _custom_tracker_run():
    from nbaccel import Accelerator
    from nbaccel.training.tracking.trackers import GeneralTracker

    class Recorder(GeneralTracker):  # written as for Accelerate: state opened in start()
        name = "recorder"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.events = []

        @property
        def tracker(self):
            return self.events

        def start(self):
            self.events.append("start")

        def store_init_configuration(self, values):
            self.events.append(("config", values))

        def log(self, values, step=None, **kwargs):
            self.events.append(("log", values, step))

        def finish(self):
            self.events.append("finish")

    recorder = Recorder()
    accelerator = Accelerator(log_with=recorder)
    accelerator.init_trackers("run", config={"lr": 0.1})
    accelerator.log({"loss": 1.5}, step=2)
    accelerator.end_training()
    return recorder.events


def test_custom_tracker_is_started_on_the_main_process():
    main, other = run_on_ranks(_custom_tracker_run, 2)
    assert main == [
        "start",
        ("config", {"lr": 0.1}),
        ("log", {"loss": 1.5}, 2),
        "finish",
    ]
    assert other == []  # trackers run on the main process only


def test_tensorboard_tracker_writes_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nbaccel import Accelerator
    from nbaccel.training.tracking.trackers import LoggerType

    accelerator = Accelerator(log_with=LoggerType.TENSORBOARD, project_dir=tmp_path)
    accelerator.init_trackers("tb_run", config={"lr": 0.5, "epochs": 3})
    for step in range(3):
        accelerator.log({"loss": torch.tensor(1.0 / (step + 1)), "note": "x"}, step=step)
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    assert writer.log_dir.startswith(str(tmp_path / "tb_run"))
    accelerator.end_training()
    events = EventAccumulator(str(tmp_path / "tb_run")).Reload()
    losses = [(e.step, round(e.value, 4)) for e in events.Scalars("loss")]
    assert losses == [(0, 1.0), (1, 0.5), (2, 0.3333)]


@pytest.mark.parametrize("name", sorted(LIBRARIES))
def test_missing_library_tracker_is_skipped_with_a_warning_naming_the_pip_package(name, tmp_path):
    module, cls_name = LIBRARIES[name]
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    from nbaccel import Accelerator
    from nbaccel.training.tracking import backends as tracker_backends

    # as Accelerate: the run goes on without it (Accelerate's nd_parallel.py asks for wandb)
    with pytest.warns(UserWarning, match=f"pip install {module}"):
        accelerator = Accelerator(log_with=[name], project_dir=tmp_path)
    accelerator.init_trackers("run")
    assert accelerator.trackers == []
    accelerator.log({"loss": 1.0})
    accelerator.end_training()
    # The class exists with Accelerate's name; building it imports nothing, start() explains.
    cls = getattr(tracker_backends, cls_name)
    assert cls.name == name
    tracker = cls("run") if name != "mlflow" else cls(experiment_name="run")
    with pytest.raises(ImportError, match=f"pip install {module}"):
        tracker.start()
