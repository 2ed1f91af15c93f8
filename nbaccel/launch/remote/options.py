"""What a launch over several hosts needs beyond a local one, checked before anything starts."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from nbaccel.launch.options.ray import RayOptions, ray_options
from nbaccel.launch.remote.hosts import HostLayout, parse_hosts, slurm_layout
from nbaccel.launch.wire.protocol import LaunchKind

__all__ = ["REMOTE_KINDS", "RemoteOptions", "remote_options"]

REMOTE_KINDS = (LaunchKind.SSH.value, LaunchKind.SLURM.value, LaunchKind.RAY.value)


@dataclass(frozen=True)
class RemoteOptions:
    """How the agents start and what the ranks get.

    Args:
        kind: ``ssh`` (one ``ssh host`` per host), ``slurm`` (one ``srun`` for the allocation)
            or ``ray`` (one actor per node of a Ray cluster).
        layout: the hosts and their ranks (a Ray launch: None until its placement group is
            placed, when the plan is made).
        python: the interpreter on the hosts (default: this kernel's, same path everywhere; on
            Ray, empty: each node's own, the one its Ray workers run).
        cwd: the ranks' working directory on the hosts (default: the kernel's where it
            exists, else the login directory).
        cwd_required: ``cwd`` was asked for: a host without it is an error.
        env: variables set on every rank, on top of the host's own environment.
        ssh_args: extra ``ssh`` arguments (``["-p", "2222", "-i", key]``; jump hosts and the
            rest are best kept in ``~/.ssh/config``).
        srun_args: extra ``srun`` arguments.
        channel_address: the address of this machine the hosts connect back to (default: the
            one on the route to the first host).
        ray: the cluster, resources and placement of a ``ray`` launch.
        num_processes: the ranks asked for (a ``ray`` launch before its placement; None: the
            front's default).
        allocation: the id of the placed reservation (a ``ray`` launch, once placed).
    """

    kind: LaunchKind
    layout: HostLayout | None
    python: str
    cwd: str
    cwd_required: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    ssh_args: tuple[str, ...] = ()
    srun_args: tuple[str, ...] = ()
    channel_address: str | None = None
    ray: RayOptions | None = None
    num_processes: int | None = field(default=None, compare=False)
    allocation: str | None = field(default=None, compare=False)


def _env(env: Mapping[str, str] | Iterable[str] | None) -> dict[str, str]:
    """``env`` as values: a mapping as is; a list of names forwards the kernel's values."""
    if env is None:
        return {}
    if isinstance(env, Mapping):
        bad = [k for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ValueError(f"env values must be strings; fix {', '.join(map(repr, bad))}.")
        return dict(env)
    if isinstance(env, str):
        env = [name for name in env.split(",") if name]
    names = list(env)
    missing = [name for name in names if name not in os.environ]
    if missing:
        raise ValueError(
            f"env names {', '.join(missing)}, which this kernel's environment does not have; "
            "set them first, or pass env={'NAME': 'value'}."
        )
    return {name: os.environ[name] for name in names}


def _args(name: str, value: Sequence[str] | str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ValueError(
            f"{name} must be a list of arguments such as ['-p', '2222'], got {value!r}."
        )
    return tuple(value)


def remote_options(
    kind: str,
    num_processes: int | None,
    hosts: str | Sequence[str] | None = None,
    *,
    python: str | None = None,
    cwd: str | None = None,
    env: Mapping[str, str] | Iterable[str] | None = None,
    ssh_args: Sequence[str] | None = None,
    srun_args: Sequence[str] | None = None,
    channel_address: str | None = None,
    ray_address: str | None = None,
    ray_resources: Mapping[str, float] | str | None = None,
    ray_placement: str | None = None,
    ray_keep_warm: float | None = None,
) -> RemoteOptions:
    """Validate a many-hosts launch; raises ValueError naming the problem and the fix."""
    if kind not in REMOTE_KINDS:
        raise ValueError(f"launcher must be one of {', '.join(REMOTE_KINDS)}, got {kind!r}.")
    layout: HostLayout | None = None
    ray_given = (ray_address, ray_resources, ray_placement, ray_keep_warm) != (None,) * 4
    ray = None
    if kind == LaunchKind.RAY:
        if hosts is not None or ssh_args is not None or srun_args is not None:
            raise ValueError(
                "launcher='ray' runs on the Ray cluster's nodes, placed by Ray: leave hosts, "
                "ssh_args and srun_args out (ray_placement='spread' puts ranks on separate "
                "nodes; ray_resources picks what each rank reserves)."
            )
        ray = ray_options(ray_address, ray_resources, ray_placement, ray_keep_warm)
    elif ray_given:
        raise ValueError(
            "the ray_* options apply to launcher='ray' only: add launcher='ray', or leave them out."
        )
    elif kind == LaunchKind.SSH:
        if hosts is None:
            raise ValueError("an ssh launch needs hosts=['node1:4', 'node2:4'].")
        layout = parse_hosts(hosts, num_processes)
    else:
        if hosts is not None:
            raise ValueError(
                "launcher='slurm' runs on the allocation's nodes; leave hosts out (or use "
                "hosts=[...] without launcher='slurm' to go over ssh)."
            )
        layout = slurm_layout(num_processes)
    if python is not None and (not isinstance(python, str) or not python.strip()):
        raise ValueError(f"python must be the interpreter's path on the hosts, got {python!r}.")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.strip()):
        raise ValueError(f"cwd must be a directory path on the hosts, got {cwd!r}.")
    return RemoteOptions(
        kind=LaunchKind(kind),
        layout=layout,
        # a Ray node's agent runs the node's own interpreter unless one is named
        python=python
        or ("" if ray else os.environ.get("NBACCEL_REMOTE_PYTHON") or _default_python()),
        cwd=cwd or os.getcwd(),
        cwd_required=cwd is not None,
        env=_env(env),
        ssh_args=_args("ssh_args", ssh_args),
        srun_args=_args("srun_args", srun_args),
        channel_address=channel_address,
        ray=ray,
        num_processes=num_processes if ray else None,
    )


def _default_python() -> str:
    import sys

    return sys.executable
