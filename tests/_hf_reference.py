"""Accelerate's own launcher running ``_hf_trainer`` on 2 CPU ranks: the reference that the
Trainer cases of the hosts and Ray lanes compare nbaccel's ranks with, and the comparison.

    from _hf_reference import accelerate_records, records, same_training
    theirs = accelerate_records(folder)                # accelerate launch, bf16, "plain"
    same_training(theirs, records(prefix), "bf16")     # precision, engine, losses within 1e-4
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

__all__ = ["TRAINER", "accelerate_records", "hf_lane", "records", "same_training"]

TRAINER = Path(__file__).resolve().with_name("_hf_trainer.py")
ACCELERATE = Path(sys.executable).with_name("accelerate")
#: the hf lane's cases (``scripts/test-hf`` sets NBACCEL_HF_FULL=1); the default suite skips them
hf_lane = pytest.mark.skipif(
    os.environ.get("NBACCEL_HF_FULL") != "1",
    reason="long: pairs of transformers launches (run scripts/test-hf)",
)


def records(prefix: Path, ranks: int = 2) -> list[dict]:
    """What each rank of ``_hf_trainer.train(str(prefix), ...)`` wrote, by rank."""
    return [json.loads(Path(f"{prefix}.{rank}.json").read_text()) for rank in range(ranks)]


def accelerate_records(
    folder: Path, cases: str = "plain", mixed_precision: str = "bf16"
) -> list[dict]:
    """``accelerate launch --multi_gpu --num_processes 2 --mixed_precision ...`` of
    ``_hf_trainer.py`` in ``folder``, each rank's record. Without a GPU, Accelerate's torchrun
    ranks run MULTI_CPU over gloo (its ``--cpu`` with 2 processes would go through mpirun).
    ``HF_HOME`` is ``folder``: no ``accelerate config`` file of this machine is read."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(folder))
    flags = ["--multi_gpu", "--num_processes", "2", "--mixed_precision", mixed_precision]
    argv = [str(ACCELERATE), "launch", *flags, str(TRAINER), str(folder / "t"), cases]
    done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return records(folder / "t")


def same_training(theirs: list[dict], ours: list[dict], precision: str) -> None:
    """Rank by rank, each case of ``ours`` ran Accelerate's ``Accelerator`` in ``precision`` on a
    world of 2 CPU ranks (MULTI_CPU), with the losses of ``theirs`` (within 1e-4)."""
    assert len(theirs) == len(ours) == 2
    for their_rank, our_rank in zip(theirs, ours, strict=True):
        cases = [case for case, record in our_rank.items() if isinstance(record, dict)
                 and "losses" in record]  # fmt: skip
        assert cases, our_rank
        for case in cases:
            record = our_rank[case]
            assert record["mixed_precision"] == precision, (case, record)
            assert record["distributed_type"] == "DistributedType.MULTI_CPU", (case, record)
            assert record["num_processes"] == 2, (case, record)
            reference = their_rank[case]["losses"]
            assert len(reference) == len(record["losses"]) > 0, (case, reference, record)
            assert record["losses"] == pytest.approx(reference, abs=1e-4), case
