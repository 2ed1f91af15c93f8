"""Ranks on other hosts, driven from this kernel: the ``ssh`` and ``slurm`` launcher variants.

Reading order: ``hosts`` (which hosts, how many ranks each, checked before anything starts),
``options`` (python, cwd, env, ssh/srun arguments), ``launcher`` (the variant both share:
start one agent per host, turn each rank's spec into its host's), ``ssh`` and ``slurm`` (how the
agents start), ``agent`` (the per-host process: a fork server with torch preloaded, a tunnel for
the ranks' connections), ``hub`` (the kernel's ZeroMQ CURVE server), ``wire`` (the messages),
``relay`` (one tunnelled connection), ``process`` (the kernel's handle on a remote rank).
"""
