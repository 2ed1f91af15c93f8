"""Worker side: transformers' ``Trainer`` on a rank shows its bar and its metrics in the notebook.

:func:`install_trainer_bridge` (a worker hook, like the tqdm bridge) waits for the rank to import
``transformers.trainer`` (or adapts it at once when the fork server preloaded it), and nothing
else: a rank that never imports transformers never loads it. Then, for every ``Trainer`` built on
the rank (``SFTTrainer`` and PEFT's models included, they build on it):

- its progress bar is transformers' tqdm ``ProgressCallback``, which the tqdm bridge turns into
  the launch's per-rank progress widget (a text line without widgets). transformers picks its
  HTML ``NotebookProgressCallback`` when the module was imported inside a kernel (a rank forked
  from the kernel inherits that choice); HTML displayed by a rank would not update in place.
- :class:`~nbaccel.notebook.rank.trainer_callback.NotebookMetricsCallback` joins its default
  callbacks, so what it logs (loss, learning rate, eval metrics) feeds the live metrics plot.
"""

from __future__ import annotations

from types import ModuleType

from nbaccel.notebook.rank.on_import import when_imported

__all__ = ["install_trainer_bridge"]

_TRAINER = "transformers.trainer"


def _adapt(trainer: ModuleType) -> None:
    from nbaccel.notebook.rank.trainer_callback import NotebookMetricsCallback

    progress = getattr(trainer, "DEFAULT_PROGRESS_CALLBACK", None)
    if progress is not None and progress.__name__ == "NotebookProgressCallback":
        from transformers.trainer_callback import ProgressCallback

        trainer.DEFAULT_PROGRESS_CALLBACK = ProgressCallback
    defaults = getattr(trainer, "DEFAULT_CALLBACKS", None)
    if isinstance(defaults, list) and NotebookMetricsCallback not in defaults:
        defaults.append(NotebookMetricsCallback)


class _Bridge:
    """Whether this process watches for transformers' Trainer already."""

    installed = False


_bridge = _Bridge()


def install_trainer_bridge() -> None:
    """Adapt transformers' Trainer on this rank once it is imported (idempotent)."""
    if _bridge.installed:
        return
    _bridge.installed = True
    when_imported({_TRAINER: _adapt})
