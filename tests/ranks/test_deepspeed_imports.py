"""Nothing of DeepSpeed (nor transformers, nor Accelerate) is imported by ``import nbaccel`` or by
building a plugin and its placeholders: checked in a fresh interpreter."""

import subprocess
import sys


def test_import_nbaccel_does_not_import_deepspeed():
    code = (
        "import sys, nbaccel\n"
        "from nbaccel import DeepSpeedPlugin\n"
        "from nbaccel.utils import DummyOptim, GatheredParameters, HfDeepSpeedConfig\n"
        "DeepSpeedPlugin(zero_stage=3)\n"
        "print(sorted(m for m in ('deepspeed', 'transformers', 'accelerate') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr
