"""The launch engine: start ranks, stream what they do into the driver, collect the outcome.

Knows nothing of notebooks or training; the fronts (``notebook_launcher``, the ``%%distributed``
pool, ``nbaccel.testing.run_on_ranks``) pass the renderer, the worker hooks and the modules to
preload. Reading order: ``plan`` (what a launch is: defaults, validation, announcement, rank
environment), ``run`` (one-shot launches), ``driver`` (the one call loop), ``group`` (the process
engine), ``launchers/`` (how ranks start: forkserver, spawn, fork, xla; ssh and slurm from
``remote/``: one agent per host, a CURVE hub in the kernel, rank connections tunnelled to the
group's listener), ``labels`` (``rank 5 @ node2``), ``spec`` and
``worker`` (the rank side), ``channel``/``transport``/``protocol`` (the wire), ``render``,
``errors`` and ``processes`` (what the user sees of a failure).
"""
