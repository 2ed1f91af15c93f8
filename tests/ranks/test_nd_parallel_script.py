"""An Accelerate nd_parallel.py-style script (import swapped, a small local Llama) run by
``nbaccel launch`` on 4 CPU ranks: --tp-size 2 --dp-shard-size 2 from the script's own flags,
and HSDP 2x2 from the launcher's --parallelism_config_* flags; both give the one-process losses
and weights, skip the wandb tracker the script asks for (not installed) with a warning, and the
script's own ``model.save_pretrained`` writes the full one-process weights. Two launches (one
per layout)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "fixtures" / "parallel" / "nd_parallel.py"
sys.path.insert(0, str(SCRIPT.parent))
import nd_parallel  # noqa: E402


def _launch(tmp_path: Path, launcher_flags: list[str], script_flags: list[str]):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "nbaccel", "launch", "--num_processes", "4", "--cpu",
           *launcher_flags, str(SCRIPT), "--save-dir", str(out), *script_flags]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "losses.json").read_text()), torch.load(out / "final.pt"), done


@pytest.mark.parametrize(
    ("launcher_flags", "script_flags", "mesh"),
    [
        ([], ["--tp-size", "2", "--dp-shard-size", "2"], ["dp_shard", "tp"]),
        (
            [
                "--parallelism_config_dp_replicate_size",
                "2",
                "--parallelism-config-dp-shard-size",
                "2",
            ],
            ["--from-launcher", "--dp-replicate-size", "2", "--dp-shard-size", "2"],
            ["dp_replicate", "dp_shard"],
        ),
    ],
    ids=["tp2-x-dp_shard2", "hsdp-2x2-from-launch-flags"],
)
def test_nd_parallel_script_gives_the_single_process_losses(
    tmp_path, launcher_flags, script_flags, mesh
):
    result, state, done = _launch(tmp_path, launcher_flags, script_flags)
    ref_losses, ref_state = nd_parallel.reference(nd_parallel.parse_args(script_flags))
    assert result["mesh"] == mesh
    assert result["losses"] == pytest.approx(ref_losses, abs=2e-5)
    assert max((state[k] - ref_state[k]).abs().max().item() for k in ref_state) < 1e-4
    assert "Training completed!" in done.stdout
    assert (tmp_path / "out" / "checkpoint-2").is_dir()
    output = done.stdout + done.stderr
    if importlib.util.find_spec("wandb") is None:
        assert "Tracker 'wandb' is skipped" in output
    saved = load_file(tmp_path / "out" / "model" / "model.safetensors")
    assert set(saved) == set(ref_state)
    assert max((saved[k] - ref_state[k]).abs().max().item() for k in ref_state) < 1e-4
