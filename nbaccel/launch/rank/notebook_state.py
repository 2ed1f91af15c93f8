"""The notebook's process state that ranks start from: what a fork of the kernel would give them.

Ranks are forked from a fork server that imported torch before the notebook ran a line, so a
rank would otherwise start from library defaults, whatever the notebook set: a model built
under ``torch.set_default_dtype(torch.float64)`` came out float32 on the ranks, and
``set_seed(42)`` (or ``torch.manual_seed``, ``random.seed``, ``np.random.seed``) before a launch
did not seed them. A function called in the notebook sees that state, and so do ranks forked
from the kernel itself (Accelerate's ``notebook_launcher``). What travels:

- torch: the default dtype, the CPU generator's state, deterministic-algorithms mode, the
  float32 matmul precision;
- the global generators of ``random`` and of NumPy (when the notebook imported it);
- the ``warnings`` filters (``filterwarnings("ignore", ...)`` silences the ranks too).

Every rank starts where the notebook's generators stand, as after a fork: seed per rank inside
the function where ranks must differ. Nothing is read of a library the notebook has not
imported, and a piece that cannot be rebuilt in a rank is skipped with a word on its stderr, never
fatal.
"""

from __future__ import annotations

import pickle
import random
import sys
from typing import Any

from nbaccel.launch.rank import warning_filters

__all__ = ["apply", "capture", "modules"]


def capture() -> dict[str, Any]:
    """This process's state worth giving to ranks (what :func:`apply` takes)."""
    state: dict[str, Any] = {"random": random.getstate(), "warnings": warning_filters.capture()}
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_default_dtype"):
        state["torch"] = {
            "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
            "rng": torch.random.get_rng_state().numpy().tobytes(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "matmul_precision": torch.get_float32_matmul_precision(),
        }
    # sys.modules, not hasattr(numpy, "random"): NumPy imports its submodules on first access,
    # so asking would import numpy.random here (about 0.1 s) and, through apply(), in every rank
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None and hasattr(numpy_random, "get_state"):
        state["numpy"] = pickle.dumps(numpy_random.get_state())
    return state


def modules(state: dict[str, Any]) -> tuple[str, ...]:
    """The modules :func:`apply` imports for ``state`` beyond the engine's (torch): worth
    preloading in the fork server, or each rank imports them as it starts (``numpy.random``
    is a noticeable part of a rank's start on few cores)."""
    return ("numpy.random",) if "numpy" in state else ()


def apply(state: dict[str, Any]) -> list[str]:
    """Make this process's state ``state`` (what :func:`capture` read in the notebook); the
    pieces that could not be restored, each as a line for the user (the rank's stderr, once
    it reaches the notebook)."""
    problems: list[str] = []
    if "random" in state:
        random.setstate(state["random"])
    warning_filters.install(state.get("warnings", []))
    if "torch" in state:
        _apply_torch(state["torch"])
    if "numpy" in state:
        problems += _apply_numpy(state["numpy"])
    return problems


def _apply_numpy(pickled: bytes) -> list[str]:
    """NumPy's global RNG state from the notebook, or why it could not be had (NumPy missing
    or of another version here): the ranks' ``np.random`` draws then differ from a fork of
    the notebook, and the user must know."""
    try:
        import numpy.random

        numpy.random.set_state(pickle.loads(pickled))
    except Exception as exc:
        return [
            "nbaccel: NumPy's random state of the notebook could not be restored in this rank "
            f"({type(exc).__name__}: {exc}); np.random draws here differ from the notebook's. "
            "Seed every rank explicitly (nbaccel.set_seed(seed), or "
            "np.random.seed(seed) in the function) where draws must match."
        ]
    return []


def _apply_torch(settings: dict[str, Any]) -> None:
    import torch

    torch.set_default_dtype(getattr(torch, settings["default_dtype"]))
    torch.random.set_rng_state(torch.frombuffer(bytearray(settings["rng"]), dtype=torch.uint8))
    if settings["deterministic"] or torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(
            settings["deterministic"], warn_only=settings["deterministic_warn_only"]
        )
    torch.set_float32_matmul_precision(settings["matmul_precision"])
