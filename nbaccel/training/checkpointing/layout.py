"""The file layout of a training checkpoint, shared with Hugging Face Accelerate.

A checkpoint folder uses Accelerate's names, so either library resumes what the other saved:
``model.safetensors`` / ``pytorch_model.bin`` (``model_1...`` for the second model),
``optimizer.bin``, ``scheduler.bin``, ``dl_state_dict.bin`` (stateful loaders), ``scaler.pt``,
``custom_checkpoint_<i>.pkl`` and one ``random_states_<rank>.pkl`` per process holding
``step``, ``random_state``, ``numpy_random_seed``, ``torch_manual_seed`` (and
``torch_cuda_manual_seed`` / ``xm_seed``) as Accelerate reads them
(:func:`nbaccel.distributed.random.get_rng_states`).

nbaccel adds, and Accelerate ignores: ``dataloader_<i>.bin`` (the position of a plain prepared
loader: epoch, batches read, shuffling state) and the manifest ``nbaccel_checkpoint.json``
written last. A folder without the manifest is read as Accelerate's: the files the prepared
objects need must be there (a missing one is named).
"""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "accelerate_manifest",
    "indexed_name",
    "load_pickle",
]


def indexed_name(stem: str, index: int, ext: str) -> str:
    """``optimizer.bin``, ``optimizer_1.bin``, ... (Accelerate's numbering)."""
    return f"{stem}.{ext}" if index == 0 else f"{stem}_{index}.{ext}"


def _numpy_globals() -> list[Any]:
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    found = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        found.append(dtypes.UInt32DType)
    return found


def load_pickle(path: Path, trusted: bool = False) -> Any:
    """``torch.load`` of a checkpoint file on CPU: weights-only (numpy arrays of RNG states
    allowed) unless ``trusted`` (registered custom objects, as Accelerate does)."""
    if trusted:
        return torch.load(path, map_location="cpu", weights_only=False)
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)


# -- a folder Accelerate wrote ------------------------------------------------------------------
def accelerate_manifest(input_dir: Path, wanted: dict[str, int]) -> dict[str, Any] | None:
    """The manifest of a folder Accelerate's ``save_state`` wrote, or None if it is not one.

    ``wanted`` counts the prepared objects (models, optimizers, schedulers, custom_objects);
    raises ``FileNotFoundError`` naming the files they need that the folder lacks.
    """
    present = {p.name for p in input_dir.iterdir()}
    rng_files = sorted(n for n in present if n.startswith("random_states_") and n.endswith(".pkl"))
    safe = "model.safetensors" in present
    if not rng_files and not safe and "pytorch_model.bin" not in present:
        return None
    needed: list[str] = []
    for i in range(wanted.get("models", 0)):
        stem = "model" if safe else "pytorch_model"
        needed.append(indexed_name(stem, i, "safetensors" if safe else "bin"))
    needed += [indexed_name("optimizer", i, "bin") for i in range(wanted.get("optimizers", 0))]
    needed += [indexed_name("scheduler", i, "bin") for i in range(wanted.get("schedulers", 0))]
    needed += [f"custom_checkpoint_{i}.pkl" for i in range(wanted.get("custom_objects", 0))]
    missing = [name for name in needed if name not in present]
    if missing:
        raise FileNotFoundError(
            f"{input_dir} (a checkpoint in Accelerate's layout) lacks {missing} for the prepared "
            f"objects. Found: {sorted(present)}. Prepare (and register_for_checkpointing) the "
            "same objects, in the same order, as when saving."
        )
    step = 0
    if rng_files:
        step = int(load_pickle(input_dir / rng_files[0]).get("step", 0))
    return {
        "format": "accelerate",
        "num_processes": len(rng_files),
        "safe_serialization": safe,
        "step": step,
        **wanted,
    }
