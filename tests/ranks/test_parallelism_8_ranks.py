"""TP 2 x HSDP (dp_replicate 2 x dp_shard 2) on 8 gloo ranks, equal to one process over several
AdamW steps, and resumed from save_state to the uninterrupted result. Eight ranks are heavy for
the default suite on 2 cores: this file runs in its lane, `scripts/test-parallel-8`
(NBACCEL_EIGHT_RANKS=1), and skips elsewhere with that reason."""

from __future__ import annotations

import os

import pytest
from _llama import max_diff, reference_run
from test_parallelism_mesh import PER_RANK, _global_losses, _train

from nbaccel.testing import run_on_ranks

pytestmark = pytest.mark.skipif(
    os.environ.get("NBACCEL_EIGHT_RANKS") != "1",
    reason="8 ranks: run with scripts/test-parallel-8 (NBACCEL_EIGHT_RANKS=1)",
)


def _eight(root: str):
    return _train({"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}, root, clip=1.0)


def test_tp2_x_hsdp_2x2_on_8_ranks_equals_one_process(tmp_path):
    results = run_on_ranks(_eight, 8, args=(str(tmp_path / "ckpt"),), timeout=900)
    assert {r["mesh"] for r in results} == {(("dp_replicate", "dp_shard", "tp"), (2, 2, 2))}
    assert [r["dp"][1] for r in results] == [0, 0, 1, 1, 2, 2, 3, 3]
    ref_losses, ref_state = reference_run(4, 4 * PER_RANK, clip=1.0)
    assert _global_losses(results, "losses") == pytest.approx(ref_losses, abs=2e-5)
    assert _global_losses(results, "resumed") == pytest.approx(ref_losses[2:], abs=2e-5)

    assert max_diff(results[0]["state"], ref_state) < 1e-4
    assert results[0]["resumed_diff"] < 1e-6
