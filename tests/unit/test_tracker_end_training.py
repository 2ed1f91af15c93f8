"""After ``end_training()`` the trackers stay listed (finished once), as in Accelerate, so a
script can read their files or runs; a new ``init_trackers`` starts a fresh set. DVCLive (when
installed) records numbers and strings at the logged steps."""

import json
import os

import pytest


def _recorder_class():
    from nbaccel.tracking import GeneralTracker

    class Recorder(GeneralTracker):
        name = "recorder_end"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.events = []

        def log(self, values, step=None, **kwargs):
            self.events.append(("log", step))

        def finish(self):
            self.events.append("finish")

    return Recorder


def test_trackers_stay_listed_and_finish_once():
    from nbaccel import Accelerator

    tracker = _recorder_class()()
    accelerator = Accelerator(log_with=tracker)
    accelerator.init_trackers("run")
    accelerator.log({"a": 1}, step=1)
    accelerator.end_training()
    accelerator.end_training()
    assert accelerator.trackers == [tracker]
    assert tracker.events == [("log", 1), "finish"]
    accelerator.init_trackers("again")  # a new run: only the trackers it starts
    assert accelerator.trackers == [tracker] and tracker.events[-1] == "finish"
    accelerator.end_training()
    assert tracker.events.count("finish") == 2


def test_dvclive_logs_numbers_and_strings_at_steps(tmp_path):
    pytest.importorskip("dvclive")
    from dvclive.serialize import load_yaml

    from nbaccel import Accelerator

    accelerator = Accelerator(log_with="dvclive")
    options = {"dvclive": {"dir": str(tmp_path), "save_dvc_exp": False, "dvcyaml": None}}
    accelerator.init_trackers("run", {"lr": 0.1, "name": "x"}, options)
    values = {"loss": 0.5, "note": "text"}
    accelerator.log(values)
    accelerator.log(values, step=3)
    accelerator.end_training()
    live = accelerator.trackers[0].live
    assert load_yaml(live.params_file) == {"lr": 0.1, "name": "x"}
    with open(live.metrics_file) as f:
        assert json.load(f) == {"loss": 0.5, "note": "text", "step": 3}  # latest values
    with open(os.path.join(live.plots_dir, "metrics", "loss.tsv")) as f:
        steps = [line.split("\t")[0] for line in f.read().splitlines()[1:]]
    assert steps == ["0", "3"]
