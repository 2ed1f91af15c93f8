"""The modules the notebook fronts have the fork server import before forking ranks.

Standard library only: ``nbaccel/_warm_up.py`` reads this list while the kernel imports nbaccel,
before torch is imported here.
"""

from __future__ import annotations

__all__ = ["WORKER_PRELOAD"]

#: the worker hooks (tqdm bridge, memory sampler) and the pool's cell runner
WORKER_PRELOAD = (
    "nbaccel.notebook.rank.instrumentation",
    "nbaccel.notebook.rank.pool_worker",
)
