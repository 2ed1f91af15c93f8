"""An Accelerate fsdp2_fp8.py-style script (import swapped, a small local Llama) run by
``nbaccel launch`` on 2 CPU ranks: the FSDP2 plugin set to "fp8" gathers in bf16, the
``AORecipeKwargs`` handler alone turns torchao's ``Float8Linear`` on (every linear but the first
and last), the ``TorchDynamoPlugin`` compiles each decoder layer (regional compilation), the
wandb tracker (not installed) is skipped with a warning, and the launch says what ran. The losses
are those of torch's ``fully_shard`` and torchao driven directly on the same ranks. FP8 runs on
torch's CPU FP8 matmul where this torch has one, else emulated (NBACCEL_FP8_EMULATE=1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nbaccel.distributed.host_info import fp8_hardware_problem
from nbaccel.testing import run_on_ranks

pytest.importorskip("torchao")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "fixtures" / "parallel" / "fsdp2_fp8.py"
#: torch's CPU FP8 matmul where it exists; torchao's emulation elsewhere
ENV = {} if fp8_hardware_problem("cpu") is None else {"NBACCEL_FP8_EMULATE": "1"}
#: the example's AdamW (the optimizer is built before prepare, so it must follow the weights that
#: the FP8 conversion and the sharding replace)
ARGS: list[str] = []


def _direct(script: str, argv: list[str]) -> list[float]:
    import runpy

    from nbaccel.distributed.state import PartialState

    PartialState()  # the gloo group the ranks share
    return runpy.run_path(script)["direct"](argv)


@pytest.mark.timeout(600)
def test_fsdp2_fp8_script_trains_in_fp8_with_regional_compilation(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **ENV}
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu",
           str(SCRIPT), "--save-dir", str(out), *ARGS]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    assert result["fp8_enabled"] and result["fp8_backend"] == "AO"
    assert result["float8_linears"] == 13  # 2 layers x 7 linears + lm_head, less first and last
    assert result["compiled_blocks"] == 2  # each LlamaDecoderLayer compiled on its own
    assert result["param_dtype"] == "torch.bfloat16"
    output = done.stdout + done.stderr
    assert "Tracker 'wandb' is skipped" in output
    assert "precision fp8 (torchao Float8Linear: 13 layers" in output
    assert "compile eager, regional (2 regions)" in output
    direct = run_on_ranks(_direct, 2, args=(str(SCRIPT), ARGS), timeout=300, env=ENV)[0]
    assert result["losses"] == pytest.approx(direct, abs=1e-5)
    assert len(set(result["losses"])) == len(result["losses"])  # the weights moved each step
