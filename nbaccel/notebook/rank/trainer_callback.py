"""Worker side: what transformers' ``Trainer`` logs, sent to the notebook's metrics plot.

:class:`NotebookMetricsCallback` is a ``TrainerCallback`` that sends the scalars the Trainer logs
on the main process (loss, learning rate, gradient norm, eval metrics) as ``metrics`` events,
which the launch's renderer plots live (one plot per run, titled by ``TrainingArguments.run_name``,
else "Trainer"). Ranks of ``notebook_launcher``, ``%%distributed`` and detached runs add it to
every Trainer by themselves (:mod:`nbaccel.notebook.rank.trainer_bridge`): training code needs no
change. Outside nbaccel's ranks it sends nothing.

This module imports transformers: only the bridge imports it, once transformers is loaded.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from nbaccel.notebook.rank.metrics_sender import MetricsSender, scalars

__all__ = ["NotebookMetricsCallback"]

#: logged values that are not curves: the step counter and throughput/timing figures
_NOT_CURVES = ("epoch", "total_flos", "step")
_NOT_CURVE_ENDINGS = ("_runtime", "_per_second")


def _curves(logs: dict[str, Any]) -> dict[str, float]:
    return scalars(
        {
            key: value
            for key, value in logs.items()
            if key not in _NOT_CURVES and not key.endswith(_NOT_CURVE_ENDINGS)
        }
    )


class NotebookMetricsCallback(TrainerCallback):
    """Sends what a ``Trainer`` logs on the main process to the notebook's metrics plot."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self._sender: MetricsSender | None = None
        self._training = False

    def _finish(self) -> None:
        if self._sender is not None:
            self._sender.flush(final=True)
            self._sender = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._training = True

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero or not logs or "train_runtime" in logs:
            return  # other ranks log the same values; the end-of-training summary is no curve
        values = _curves(logs)
        if not values:
            return
        if self._sender is None:
            run = getattr(args, "run_name", None) or "Trainer"
            self._sender = MetricsSender(run, self.interval)
        self._sender.add(state.global_step, values)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._training:  # trainer.evaluate() on its own: its values are all there is
            self._finish()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._training = False
        self._finish()
