"""wandb, SwanLab and trackio share one life cycle (``ProjectRunTracker``): ``init(project=)``
in ``start``, the settings to the run's or the library's ``config``, ``log`` with the step,
``finish``. None of the three libraries is installed here, so each is played by a module that
records what it is asked (the real libraries' own behaviour is theirs); a missing library is
skipped by the Accelerator with a warning naming its pip package, and the tracker's own
``start()`` raises the ImportError naming it, both checked in tests/ranks/test_trackers.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from nbaccel.training.tracking.backends import SwanLabTracker, TrackioTracker, WandBTracker


class _Config:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def update(self, values, **kwargs) -> None:
        self.calls.append(("config", values, kwargs))


class _Run:
    def __init__(self, calls: list) -> None:
        self.calls = calls
        self.config = _Config(calls)

    def log(self, values, step=None, **kwargs) -> None:
        self.calls.append(("log", values, step, kwargs))

    def finish(self) -> None:
        self.calls.append(("finish",))


def _library(name: str, calls: list) -> types.ModuleType:
    module = types.ModuleType(name)
    module.config = _Config(calls)

    def init(**kwargs):
        calls.append(("init", kwargs))
        return _Run(run_calls)

    run_calls: list = []
    module.init, module.run_calls = init, run_calls
    return module


@pytest.mark.parametrize(
    ("tracker_cls", "config_on", "keywords"),
    [
        (WandBTracker, "run", {"allow_val_change": True}),
        (SwanLabTracker, "library", {}),
        (TrackioTracker, "library", {"allow_val_change": True}),
    ],
)
def test_the_life_cycle_each_library_is_driven_through(
    monkeypatch, tracker_cls, config_on, keywords
):
    calls: list = []
    library = _library(tracker_cls.name, calls)
    monkeypatch.setitem(sys.modules, tracker_cls.name, library)
    tracker = tracker_cls("my-project", entity="team")
    assert tracker.tracker is None  # nothing opened before start()
    tracker.start()
    assert calls == [("init", {"project": "my-project", "entity": "team"})]
    tracker.store_init_configuration({"lr": torch.tensor(0.5)})
    tracker.log({"loss": torch.tensor(2.0)}, step=3, commit=False)
    tracker.finish()
    config_call = ("config", {"lr": 0.5}, keywords)
    run_calls = library.run_calls
    if config_on == "run":
        assert run_calls[0] == config_call and calls[1:] == []
        run_calls = run_calls[1:]
    else:
        assert calls[1:] == [config_call]
    assert run_calls == [("log", {"loss": 2.0}, 3, {"commit": False}), ("finish",)]
    assert tracker.tracker is not None and not tracker.requires_logging_directory
