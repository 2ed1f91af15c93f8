"""Randomness across ranks: seed every generator, share rank 0's state, save and restore it.

``set_seed`` seeds ``random``, numpy, torch (CPU, CUDA, XLA) in this process.

``synchronize_rng_states`` copies rank 0's generator state to every rank (prepared dataloaders do
it at the start of each epoch, so every rank shuffles the same way). ``get_rng_states`` /
``set_rng_states`` capture and restore one process's generators for checkpoints, in the record
Accelerate writes and reads (``random_states_<rank>.pkl``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from typing import Any

import torch

from nbaccel.distributed import xla_runtime
from nbaccel.distributed.state import PartialState

__all__ = [
    "get_rng_states",
    "set_seed",
    "set_rng_states",
    "synchronize_rng_state",
    "synchronize_rng_states",
]


def synchronize_rng_state(rng_type: str, generator: torch.Generator | None = None) -> None:
    """Give every process rank 0's state of one generator: torch, cuda, xla or generator."""
    partial = PartialState()
    rng_type = str(getattr(rng_type, "value", rng_type))
    if partial.num_processes <= 1:
        return
    if rng_type == "xla":
        xla_runtime.synchronize_rng_state(partial.device, partial.is_main_process)
        return
    # rank 0's generator state (a uint8 tensor) through the run's communicator
    share = partial.communicator.broadcast_host_tensor
    if rng_type == "torch":
        torch.set_rng_state(share(torch.get_rng_state()))
    elif rng_type == "cuda":
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(share(torch.cuda.get_rng_state()))
    elif rng_type == "generator":
        if generator is not None:
            generator.set_state(share(generator.get_state()))
    else:
        raise ValueError(
            f"Unknown rng type {rng_type!r}; use 'torch', 'cuda', 'xla' or 'generator'."
        )


def synchronize_rng_states(
    rng_types: Iterable[str], generator: torch.Generator | None = None
) -> None:
    """``synchronize_rng_state`` for each of ``rng_types``."""
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator=generator)


def get_rng_states(step: int = 0) -> dict[str, Any]:
    """This process's generators as Accelerate records them in ``random_states_<rank>.pkl``:
    ``step``, ``random_state``, ``numpy_random_seed``, ``torch_manual_seed`` (and
    ``torch_cuda_manual_seed``, ``xm_seed``)."""
    states: dict[str, Any] = {
        "step": int(step),
        "random_state": random.getstate(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    try:
        import numpy as np

        states["numpy_random_seed"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    device = PartialState().communicator.device_rng_states()
    if "xla" in device:
        states["xm_seed"] = device["xla"]
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_states` (or Accelerate) recorded; also reads nbaccel's earlier
    ``{python, numpy, torch}`` record."""
    if "python" in states:
        py = states["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
        torch.set_rng_state(states["torch"])
        if "numpy" in states:
            import numpy as np

            n = states["numpy"]
            keys = n["keys"].numpy().astype(np.uint32)
            np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached"]))
        if "cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])
        if "xla" in states:
            xla_runtime.set_rng_state(states["xla"])
        return
    random.setstate(states["random_state"])
    torch.set_rng_state(states["torch_manual_seed"])
    if "numpy_random_seed" in states:
        import numpy as np

        np.random.set_state(states["numpy_random_seed"])
    if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
    if "xm_seed" in states:
        xla_runtime.set_rng_state(states["xm_seed"])


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, ``numpy``, ``torch`` (CPU, CUDA and XLA) in this process.

    Args:
        seed: the seed.
        device_specific: add the process index, so each rank draws different numbers.
        deterministic: also ask torch for deterministic algorithms.
    """
    if device_specific:
        seed += PartialState().process_index
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if os.environ.get("PJRT_DEVICE"):
        try:
            xla_runtime.set_rng_state(seed)
        except ImportError:  # PJRT_DEVICE set without torch-xla installed
            pass
    if deterministic:
        torch.use_deterministic_algorithms(True)
