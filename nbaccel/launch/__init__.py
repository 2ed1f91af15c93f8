"""The launch engine: start ranks, stream what they do into the driver, collect the outcome.

Knows nothing of notebooks or training; the fronts (``notebook_launcher``, the ``%%distributed``
pool, ``nbaccel.testing.run_on_ranks``) pass the renderer, the worker hooks and the modules to
preload. Reading order:

- ``request`` (every launch option, defined once) with ``options/`` (how an option is defined,
  the engines' and variants' option tables), ``plan`` (what a launch is: defaults, validation,
  announcement, rank environment), ``run`` (one-shot launches), ``registry`` (kind -> variant);
- ``driver/`` (the kernel's side: the worker group ``group``, the one call loop ``loop``, the
  output reader, the renderer interface and its text form ``renderer``, ``child_failed``);
- ``launchers/`` (how ranks start here: ``forkserver/``, spawn, fork, xla) and ``remote/`` (ssh,
  slurm and ``ray/``: one agent per host, a CURVE hub in the kernel, rank connections tunnelled
  to the group's listener);
- ``rank/`` (the rank side: ``worker``), ``wire/`` (what both sides share: ``protocol``,
  ``channel``, ``transport``, ``spec``, ``labels``, ``errors``), ``host/`` (this machine:
  ``processes``, ports, capacity), ``detached/`` (runs that outlive the kernel).
"""
