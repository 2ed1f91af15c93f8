"""ClearML tracker in ClearML's offline mode (skipped where clearml is not installed): scalars
named eval_/test_/train_ land in those series, values without a step are single values, tables
are reported, and the task the tracker created is closed by end_training()."""

import json
import os

import pytest

clearml = pytest.importorskip("clearml")


def test_clearml_offline_task_records_series_values_and_tables(tmp_path, monkeypatch):
    from clearml.config import get_offline_dir

    from nbaccel import Accelerator

    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path))
    clearml.Task.set_offline(True)
    accelerator = Accelerator(log_with="clearml")
    accelerator.init_trackers("nbaccel_clearml_test")
    accelerator.log({"eval_loss": 0.5, "lr": 0.1}, step=2)
    accelerator.log({"final": 1.5})
    tracker = accelerator.get_tracker("clearml")
    tracker.log_table("scores", columns=["a", "b"], data=[[1, 2]])
    with pytest.raises(ValueError, match="data="):
        tracker.log_table("empty")
    offline = get_offline_dir(task_id=tracker.tracker.id)
    accelerator.end_training()
    assert clearml.Task.current_task() is None  # the task it created is closed

    with open(os.path.join(offline, "metrics.jsonl")) as f:
        events = [e for line in f for e in json.loads(line)]
    scalars = {(e["metric"], e["variant"]): e["value"] for e in events if "value" in e}
    assert scalars[("loss", "eval")] == 0.5 and scalars[("lr", "train")] == 0.1
    assert scalars[("Summary", "final")] == 1.5
    assert any(e.get("metric") == "scores" and "plot_str" in e for e in events)
