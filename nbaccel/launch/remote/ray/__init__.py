"""Ranks on a Ray cluster: the ``ray`` launcher variant, the ssh/slurm design on Ray actors.

Reading order: ``connect`` (the cluster: ``ray_address``, ``RAY_ADDRESS`` or the one
``ray.init`` connected to; Ray imported only here, only when asked), ``allocation`` (one
placement group per launch or pool, a bundle per rank, refused before anything starts when the
cluster cannot hold it; kept warm for the next launch, removed after), ``keeper`` (the actor that
holds one rank's bundle; the first of each node runs that node's agent, the per-host process
of ``nbaccel.launch.remote.agent``), ``actor_process`` (the kernel's handle on an agent run by an
actor), ``launcher`` (the variant: ``RemoteLauncher`` whose agents start in actors).

Everything past the agents' start is the remote design shared with ssh and SLURM: ranks forked
from each node's torch-preloaded server, connecting back to the kernel over ZeroMQ CURVE, output
labelled ``[rank 5 @ node]``, the stop button, ``timeout=``, a node lost named with its ranks.
"""
