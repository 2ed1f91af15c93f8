"""Ranks on other hosts, driven from this kernel: the ``ssh``, ``slurm`` and ``ray`` launcher
variants (``ray``: the sub-package ``ray``, whose agents start in Ray actors; its options are
checked without Ray in :mod:`nbaccel.launch.options.ray`).

Reading order: ``hosts`` (which hosts, how many ranks each, checked before anything starts),
``options`` (python, cwd, env, ssh/srun arguments), ``launcher`` (the variant both share: take
each host's agent, begin the launch on it, turn each rank's spec into its host's), ``warm`` (the
kernel's agents, one per host, kept for the kernel's life), ``ssh`` and ``slurm`` (how the agents
start), ``agent`` (the per-host process: a fork server with torch preloaded, a tunnel for the
ranks' connections, one session per launch), ``hub`` (the kernel's ZeroMQ CURVE server),
``messages`` (what kernel and agents say), ``relay`` (one tunnelled connection), ``process``
(the kernel's handle on a remote rank).
"""
