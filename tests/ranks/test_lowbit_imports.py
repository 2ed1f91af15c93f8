"""Checks in child interpreters: bitsandbytes too old (a real older distribution first on the
path) is refused naming the version and the extra, before anything is loaded; and neither
bitsandbytes nor torchao is imported by nbaccel unless a model is quantized or trained in FP8."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch import nn

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def checkpoint(tmp_path) -> str:
    from safetensors.torch import save_file

    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 8))
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    return str(tmp_path / "model.safetensors")


def test_bitsandbytes_too_old_names_the_version(tmp_path, checkpoint) -> None:
    old = tmp_path / "old"
    (old / "bitsandbytes").mkdir(parents=True)
    (old / "bitsandbytes" / "__init__.py").write_text("__version__ = '0.42.0'\n")
    dist = old / "bitsandbytes-0.42.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bitsandbytes\nVersion: 0.42.0\n")
    script = textwrap.dedent(f"""
        import torch
        from torch import nn
        from nbaccel.bigmodel import init_empty_weights
        from nbaccel.bigmodel.quantization import BnbQuantizationConfig, load_and_quantize_model
        with init_empty_weights():
            model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 8))
        try:
            load_and_quantize_model(model, BnbQuantizationConfig(load_in_4bit=True), {checkpoint!r})
        except ImportError as err:
            print("REFUSED", err)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(old), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert "REFUSED" in out.stdout, out.stderr
    assert "0.42.0 is installed" in out.stdout and "nbaccel[bnb]" in out.stdout
    assert "bitsandbytes>=0.46.0" in out.stdout


def test_nothing_of_bitsandbytes_or_torchao_is_imported_unless_used() -> None:
    script = textwrap.dedent("""
        import sys
        import nbaccel
        from nbaccel import Accelerator
        from nbaccel.utils import (BnbQuantizationConfig, load_and_quantize_model,
            AORecipeKwargs, convert_model_to_fp8_ao, is_bnb_available, is_torchao_available)
        from nbaccel.utils.bnb import get_keys_to_not_convert
        BnbQuantizationConfig(load_in_4bit=True)
        assert is_bnb_available() and is_torchao_available()
        Accelerator(cpu=True, mixed_precision="bf16")
        print(sorted(m for m in sys.modules if m.split(".")[0] in
                     ("bitsandbytes", "torchao", "transformer_engine")))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr
