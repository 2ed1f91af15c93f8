"""transformers' ``Trainer`` on real ranks, as the notebook sees it: its tqdm bar arrives as
progress events (never as text), what it logs reaches the metrics plot, and an exception raised
inside ``trainer.train()`` arrives like any other rank's exception.

Two cases of how transformers got into the rank: imported by the function itself, and preloaded
by the fork server (what happens when the notebook imported transformers before the launch:
``transformers.trainer_callback`` then holds tqdm's class from before the bridge existed).
"""

from __future__ import annotations

import traceback

import pytest
from recorder import Recorder

from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.notebook.events import MetricsUpdate, ProgressUpdate

pytestmark = pytest.mark.timeout(600)


def _events(rec: Recorder, cls: type) -> list[tuple[int, object]]:
    return [(rank, p) for _, rank, _, p in rec.events if isinstance(p, cls)]


@pytest.mark.parametrize("preload", ["off", "transformers.trainer"])
def test_the_trainers_bar_and_logs_reach_the_notebook(preload, tmp_path):
    from _trainer import train_tiny

    if preload != "off":
        import transformers.trainer  # noqa: F401  (the server mirrors what this process holds)
    rec = Recorder()
    results = notebook_launcher(
        train_tiny, (str(tmp_path / "out"), 6, True), num_processes=2, cpu=True,
        renderer=rec, memory=False, preload=preload,
    )  # fmt: skip
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:  # every Trainer the rank builds carries the metrics callback, tqdm's bar
        assert r["callbacks"] == [
            "DefaultFlowCallback", "NotebookMetricsCallback", "Misbehave", "ProgressCallback",
        ]  # fmt: skip

    # the training bar: rank 0's (the Trainer shows it on the main process), exact at the end
    bars = _events(rec, ProgressUpdate)
    assert {rank for rank, _ in bars} == {0}
    training = [u for _, u in bars if u.total == 6]
    assert training and training[-1].final and training[-1].n == 6
    assert sum(u.final for u in training) == 1
    assert not any("it/s" in text or "\r" in text for _, _, text in rec.lines), rec.text()

    # the metrics: what the Trainer logged, point for point, from rank 0 only
    updates = _events(rec, MetricsUpdate)
    assert {rank for rank, _ in updates} == {0} and updates[-1][1].final
    assert all(u.run == "Trainer" for _, u in updates)
    points = [point for _, u in updates for point in u.points]
    expected = []
    for entry in results[0]["log_history"]:
        if "train_runtime" in entry:
            continue
        keep = {k: v for k, v in entry.items() if k in ("loss", "grad_norm", "learning_rate",
                                                         "eval_loss")}  # fmt: skip
        expected.append((float(entry["step"]), keep))
    assert [step for step, _ in points] == [2.0, 3.0, 4.0, 6.0, 6.0]
    assert points == expected
    assert set(points[0][1]) == {"loss", "grad_norm", "learning_rate"}
    assert set(points[1][1]) == {"eval_loss"}


def test_an_exception_inside_trainer_train_arrives_as_itself(tmp_path):
    from _trainer import train_tiny

    with pytest.raises(ValueError) as info:
        notebook_launcher(
            train_tiny, (str(tmp_path / "out"), 6, False, None, None, None, 3),
            num_processes=2, cpu=True, renderer=Renderer(), memory=False,
        )  # fmt: skip
    exc = info.value
    assert type(exc).__name__ == "ValueError" and exc.rank == 1
    assert str(exc) == "the loss went away at step 3" and exc.__notes__ == ["raised on rank 1"]
    remote = "".join(traceback.format_exception(exc))
    # the rank's own frames: through the Trainer's loop into the callback that raised
    assert "_inner_training_loop" in remote and "on_step_end" in remote, remote
