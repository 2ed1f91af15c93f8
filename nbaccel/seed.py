"""Reproducible randomness across processes."""

from __future__ import annotations

import os
import random

import torch

__all__ = ["set_seed"]


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, ``numpy``, ``torch`` (CPU, CUDA and XLA) in this process.

    Args:
        seed: the seed.
        device_specific: add the process index, so each rank draws different numbers.
        deterministic: also ask torch for deterministic algorithms.
    """
    if device_specific:
        from nbaccel.state import PartialState

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
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(seed)
        except ImportError:
            pass
    if deterministic:
        torch.use_deterministic_algorithms(True)
