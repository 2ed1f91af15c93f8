"""What the notebook installs in every worker: the tqdm and Trainer bridges, the memory sampler.

``notebook_launcher`` and the ``%%distributed`` pool both pass :func:`worker_setup`'s callables
to ``WorkerGroup(setup=...)``; they run in each worker before the user's code.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from nbaccel.notebook.rank.memory_sampler import DEFAULT_INTERVAL, start_memory_sampler
from nbaccel.notebook.rank.progress_bridge import install_progress_bridge
from nbaccel.notebook.rank.trainer_bridge import install_trainer_bridge

__all__ = ["worker_setup"]


def worker_setup(
    memory: bool = True, progress: bool = True, interval: float = DEFAULT_INTERVAL
) -> tuple[Callable[[], None], ...]:
    """Importable setup hooks for workers: the progress bridge and the Trainer bridge (its bar
    and logged metrics), and the memory sampler (every ``interval`` seconds) when ``memory`` is
    true."""
    hooks: list[Callable[[], None]] = []
    if progress:
        hooks += (install_progress_bridge, install_trainer_bridge)
    if memory:
        hooks.append(partial(start_memory_sampler, interval))
    return tuple(hooks)
