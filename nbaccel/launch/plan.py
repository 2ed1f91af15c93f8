"""What a launch is: how many ranks, where, how they start, and each rank's environment.

Shared by ``notebook_launcher`` and the ``%%distributed`` pool, so both describe their ranks in
one place: the torchrun-style variables that ``PartialState`` reads (RANK, WORLD_SIZE, ...),
nbaccel's own (NBACCEL_LAUNCHER, NBACCEL_MIXED_PRECISION, NBACCEL_CPU), a free port and the
start method.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

__all__ = ["START_METHODS", "LaunchPlan", "free_port", "resolve_start_method", "worker_hooks"]

START_METHODS = ("auto", "forkserver", "spawn", "fork")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_start_method(start_method: str) -> str:
    """``auto`` becomes the fork server (spawn where fork does not exist); ``fork`` is refused
    once this process has initialised CUDA, since a forked child cannot use it."""
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}.")
    if start_method == "fork" and torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA is already initialised in this kernel, and a forked child cannot use it. "
            "Use start_method='auto' (nbaccel's fork server is CUDA-safe)."
        )
    if start_method == "auto":
        return "forkserver" if hasattr(os, "fork") else "spawn"
    return start_method


def worker_hooks(memory: bool) -> tuple:
    """The notebook's worker hooks (tqdm bridge, memory sampler); none if unavailable."""
    try:
        from nbaccel.notebook.rank.instrumentation import worker_setup
    except ImportError:
        return ()
    return worker_setup(memory=memory)


@dataclass(frozen=True)
class LaunchPlan:
    """The ranks of this node and the world they belong to."""

    num_processes: int
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    mixed_precision: str = "no"
    cpu: bool = False
    launcher: str = "notebook"  # NBACCEL_LAUNCHER: "notebook" or "pool"

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_nodes

    def global_rank(self, index: int) -> int:
        """The rank of this node's ``index``-th process in the whole world."""
        return self.node_rank * self.num_processes + index

    def rank_env(self, index: int, port: int) -> dict[str, str]:
        """The full environment of this node's ``index``-th process."""
        env = dict(os.environ)
        env.update(
            RANK=str(self.global_rank(index)),
            LOCAL_RANK=str(index),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.num_processes),
            GROUP_RANK=str(self.node_rank),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(port),
            NBACCEL_LAUNCHER=self.launcher,
            NBACCEL_MIXED_PRECISION=str(self.mixed_precision).lower(),
        )
        if self.cpu:
            env["NBACCEL_CPU"] = "1"
        return env
