"""transformers' ``Trainer`` logs, plotted live in the notebook.

:class:`NotebookMetricsCallback` is a ``TrainerCallback`` that hands the scalars the Trainer logs
(loss, learning rate, gradient norm, eval metrics) to a :class:`~nbaccel.notebook.tracker.
NotebookTracker`: on a rank of ``notebook_launcher``, ``%%distributed`` or a detached run they
reach the launch's metrics plot; in the kernel itself the tracker draws its own plot. Ranks add
it to every Trainer by themselves (``nbaccel.notebook.rank.trainer_bridge``), so training code
needs no change; elsewhere pass it: ``Trainer(..., callbacks=[NotebookMetricsCallback()])``.

This module imports transformers: nbaccel imports it only where transformers is loaded.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from nbaccel.notebook.tracker import NotebookTracker

__all__ = ["NotebookMetricsCallback"]

#: logged values that are not curves: the step counter and throughput/timing figures
_NOT_CURVES = ("epoch", "total_flos", "step")
_NOT_CURVE_ENDINGS = ("_runtime", "_per_second")


def _curves(logs: dict[str, Any]) -> dict[str, Any]:
    return {
        key: value
        for key, value in logs.items()
        if key not in _NOT_CURVES and not key.endswith(_NOT_CURVE_ENDINGS)
    }


class NotebookMetricsCallback(TrainerCallback):
    """Plots what a ``Trainer`` logs (on the main process) live in the notebook.

    Args:
        run_name: the plot's title (default: ``TrainingArguments.run_name``, else "Trainer").
        interval: seconds between two updates a rank sends (the plot redraws at most as often).
    """

    def __init__(self, run_name: str | None = None, interval: float = 1.0) -> None:
        self.run_name = run_name
        self.interval = interval
        self._tracker: NotebookTracker | None = None
        self._training = False

    def _log(self, args: Any, values: dict[str, Any], step: int) -> None:
        if self._tracker is None:
            name = self.run_name or getattr(args, "run_name", None) or "Trainer"
            self._tracker = NotebookTracker(name, interval=self.interval)
        self._tracker.log(values, step=step)

    def _finish(self) -> None:
        if self._tracker is not None:
            self._tracker.finish()
            self._tracker = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._training = True

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero or not logs or "train_runtime" in logs:
            return  # other ranks log the same values; the end-of-training summary is no curve
        values = _curves(logs)
        if values:
            self._log(args, values, state.global_step)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._training:  # trainer.evaluate() on its own: its values are all there is
            self._finish()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._training = False
        self._finish()
