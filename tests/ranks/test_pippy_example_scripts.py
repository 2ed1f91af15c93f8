"""Accelerate's pipeline-inference examples in their shape (inference/pippy/llama.py, gpt2.py
and bert.py; import swapped, small models from a config) run by ``nbaccel launch`` on 2 CPU ranks:
the example batch is traced whole as one micro-batch, a larger call is split and padded into
micro-batches, and the last rank's ``output[0]`` (the model's own output type) equals the unsplit
model's in one process. An encoder-decoder model (t5.py) is refused with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nbaccel.testing import RankFailures, run_on_ranks

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "fixtures" / "inference" / "pippy_llama.py"
sys.path.insert(0, str(SCRIPT.parent))
import pippy_llama  # noqa: E402


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
def test_pippy_example_gives_the_unsplit_output(tmp_path, kind):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "logits.pt"
    cmd = [sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu",
           str(SCRIPT), "--model", kind, "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got, ref = torch.load(out), pippy_llama.reference(kind)
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=1e-5)


def _t5() -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    from nbaccel import prepare_pippy

    config = T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=64)
    ids = torch.ones(2, 8, dtype=torch.long)
    prepare_pippy(T5ForConditionalGeneration(config), no_split_module_classes=["T5Block"],
                  example_kwargs={"input_ids": ids, "decoder_input_ids": ids})  # fmt: skip


def test_encoder_decoder_model_is_refused_with_the_reason():
    with pytest.raises(RankFailures, match="encoder-decoder model"):
        run_on_ranks(_t5, 2, timeout=120)
