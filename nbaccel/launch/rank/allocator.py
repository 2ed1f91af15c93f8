"""A rank keeps the memory it frees for its next step (glibc's ``malloc``, Linux).

A training step frees what the next one allocates again: gradients (``zero_grad``), the
optimizer's temporaries, activations. glibc gives a freed block at the top of its heap back to
the system once more than a threshold is free there (128 KiB at first, raised as it sees large
frees), and a block over its mmap threshold gets a mapping of its own, unmapped when freed. The
next step then faults in every 4 KiB page it touches again: thousands of page faults per step
of a small model, a good part of its time, or none, depending only on where the loop calls
``zero_grad`` (figures: ``benchmarks/bench_training.py``). Ranks forked from the fork server never
read the notebook's ``MALLOC_*_`` variables either: glibc reads them when a process starts.

So each rank, before the user's code runs, sets (``mallopt``): blocks under 8 MiB come from the
heap, and up to 32 MiB free at its top is kept for reuse. Larger blocks (an embedding table, its
gradient) keep a mapping of their own, given back when freed as glibc does: a rank's unique
memory after its first step stays what it was (``benchmarks/results/first_step_llama_uss.json``).
Where the notebook's environment has
its own ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_MMAP_MAX_``, those apply instead, as in a freshly started process. Nothing is set under
``NBACCEL_KEEP_FREED_MEMORY=0``, where ``GLIBC_TUNABLES`` tunes ``glibc.malloc``, where another
allocator is in ``LD_PRELOAD`` (jemalloc, tcmalloc, mimalloc), or elsewhere than glibc.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping

from nbaccel.values.booleans import parse_bool

__all__ = ["ENV", "apply", "settings"]

ENV = "NBACCEL_KEEP_FREED_MEMORY"

# mallopt's parameters (malloc.h) and the variables glibc reads for them at start
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -2, -3, -4
_VARIABLES = {
    "MALLOC_TRIM_THRESHOLD_": _M_TRIM_THRESHOLD,
    "MALLOC_TOP_PAD_": _M_TOP_PAD,
    "MALLOC_MMAP_THRESHOLD_": _M_MMAP_THRESHOLD,
    "MALLOC_MMAP_MAX_": _M_MMAP_MAX,
}
_MIB = 1 << 20
#: blocks under this come from the heap
MMAP_THRESHOLD = 8 * _MIB
#: free memory kept at the top of the heap
TRIM_THRESHOLD = 32 * _MIB
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def settings(env: Mapping[str, str]) -> dict[str, int]:
    """What :func:`apply` sets in a rank whose environment is ``env``, by variable name (empty:
    nothing). Raises ``ValueError``, naming the variable, for a value that is not understood."""
    wanted = env.get(ENV, "").strip()
    if wanted and not parse_bool(wanted, ENV):
        return {}
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return {}
    if any(name in env.get("LD_PRELOAD", "") for name in _OTHER_ALLOCATORS):
        return {}
    chosen: dict[str, int] = {}
    for name in _VARIABLES:
        text = env.get(name, "").strip()
        if not text:
            continue
        try:
            chosen[name] = int(text)
        except ValueError:
            raise ValueError(
                f"{name}={text!r} is not a number of bytes: set it to an integer "
                "(glibc's malloc reads it), or unset it."
            ) from None
    if chosen:  # the user's own tuning, as a fresh process would have it
        return chosen
    return {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, "MALLOC_TRIM_THRESHOLD_": TRIM_THRESHOLD}


def apply(env: Mapping[str, str]) -> dict[str, int]:
    """Tune this process's ``malloc`` as :func:`settings` says; what was set (empty where
    nothing was, or this is not glibc). Never raises: a rank starts either way."""
    if not sys.platform.startswith("linux"):
        return {}
    try:
        chosen = settings(env)
        mallopt = ctypes.CDLL(None).mallopt
    except (ValueError, OSError, AttributeError):
        return {}
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = {}
    for name, value in chosen.items():
        if mallopt(_VARIABLES[name], value) == 1:  # 1: accepted
            done[name] = value
    return done
