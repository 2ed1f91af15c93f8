"""The modules the notebook fronts have the fork server import before forking ranks.

Standard library only: ``nbaccel/_warm_up.py`` reads this list while the kernel imports nbaccel,
before torch is imported here.
"""

from __future__ import annotations

__all__ = ["POOL_PRELOAD", "WORKER_PRELOAD"]

#: the worker hooks (tqdm bridge, memory sampler) and the pool's cell runner
WORKER_PRELOAD = (
    "nbaccel.notebook.rank.instrumentation",
    "nbaccel.notebook.rank.pool_worker",
)

#: what a pool's ranks import as they start, on top: IPython's display machinery (each rank
#: routes ``display`` to the notebook and builds a formatter; about 35 ms of CPU per rank when
#: every rank imports it itself). A host without IPython skips it quietly, as the ranks do.
POOL_PRELOAD = (
    *WORKER_PRELOAD,
    "IPython.core.display_functions",
    "IPython.core.display",
    "IPython.display",
    "IPython.core.formatters",
)
