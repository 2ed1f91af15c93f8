"""Ranks on other hosts, driven from this kernel: the ``ssh``, ``slurm`` and ``ray`` launcher
variants (``ray``: the sub-package ``ray``, whose agents start in Ray actors; ``ray_options`` its
options, checked without Ray).

Reading order: ``hosts`` (which hosts, how many ranks each, checked before anything starts),
``options`` (python, cwd, env, ssh/srun arguments), ``launcher`` (the variant both share: take
each host's agent, begin the launch on it, turn each rank's spec into its host's), ``warm`` (the
kernel's agents, one per host, kept for the kernel's life), ``ssh`` and ``slurm`` (how the agents
start), ``agent`` (the per-host process: a fork server with torch preloaded, a tunnel for the
ranks' connections, one session per launch), ``hub`` (the kernel's ZeroMQ CURVE server),
``wire`` (the messages), ``relay`` (one tunnelled connection), ``process`` (the kernel's handle
on a remote rank).
"""
