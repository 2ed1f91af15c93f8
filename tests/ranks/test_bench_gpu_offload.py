"""``benchmarks/bench_gpu_offload.py --dry-run``: the GPU benchmark's own code, on the CPU with a
tiny model, so that the script cannot rot between runs on GPU machines. Without accelerate it
still gives nbaccel's figures and marks the peer absent."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu_offload.py"
KEYS = {
    "device", "date", "torch", "cuda", "model", "blocks", "new_tokens", "tokens_per_s", "nbaccel",
    "accelerate", "accelerate_version", "ratio_vs_accelerate", "same_tokens",
    "pinned_h2d_bytes_per_s", "streamed_bytes_per_token", "nbaccel_stream_bytes_per_s",
    "fraction_of_pinned_bandwidth", "model_over_gpu", "capped_by",
}  # fmt: skip


def _dry_run(hide_accelerate: bool) -> dict:
    hide = "sys.modules['accelerate'] = None; " if hide_accelerate else ""
    code = (
        f"import runpy, sys; {hide}sys.argv = ['bench_gpu_offload.py', '--dry-run', "
        f"'--new-tokens', '2']; runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_dry_run_without_accelerate_gives_nbaccels_figures_and_marks_the_peer_absent():
    result = _dry_run(hide_accelerate=True)
    assert set(result) >= KEYS
    assert result["dry_run"] is True and result["device"] == "cpu (dry run)"
    assert result["tokens_per_s"] > 0 and result["nbaccel"]["tokens_per_s"] > 0
    assert len(result["nbaccel"]["tokens"]) == 3  # the untimed first token + 2 timed
    assert result["blocks"] == {"gpu": 2, "cpu_pinned": 2, "disk": 2}
    assert result["streamed_bytes_per_token"] > 0  # the disk blocks stream
    assert "accelerate is not installed" in result["accelerate"]["absent"]
    assert result["ratio_vs_accelerate"] is None and result["pinned_h2d_bytes_per_s"] is None


def test_dry_run_with_accelerate_runs_the_same_map_and_tokens():
    pytest.importorskip("accelerate", reason="the peer (accelerate) is not installed")
    result = _dry_run(hide_accelerate=False)
    assert set(result) >= KEYS
    assert result["accelerate"]["tokens_per_s"] > 0 and result["ratio_vs_accelerate"] > 0
    assert result["same_tokens"] is True
