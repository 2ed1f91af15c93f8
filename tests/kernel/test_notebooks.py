"""Every example notebook runs top to bottom in a real kernel and shows what it promises.

(quickstart.ipynb has its own file: it is what ./scripts/quickstart runs.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from nbaccel.notebook.kernel.run_headless import execute_notebook, output_text

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


@pytest.fixture(autouse=True)
def _nothing_left_in_tmp(tmp_path, monkeypatch):
    """The kernel's temporary folder is private to the test; the examples' own folders
    (tempfile.mkdtemp(prefix="nbaccel-<example>-")) are gone when the notebook ends."""
    private = tmp_path / "kernel-tmp"
    private.mkdir()
    monkeypatch.setenv("TMPDIR", str(private))
    yield
    left = sorted(p.name for p in private.glob("nbaccel-*-*") if p.is_dir())
    assert not [n for n in left if n.split("-")[1] in ("big", "fsdp", "training")], left


def _run(name: str) -> list[str]:
    nb = execute_notebook(NOTEBOOKS / name, timeout=300, allow_errors=False)
    return ["".join(output_text(o) for o in c.outputs) for c in nb.cells if c.cell_type == "code"]


def test_multi_node_two_drivers_one_world():
    texts = _run("multi_node.ipynb")
    assert "node 0 got [(0, 2, [0, 1])]" in texts[1]
    assert "node 1 got [(1, 2, [0, 1])]" in texts[1]
    assert "Launching on 1 CPU process (gloo) per node, 2 nodes." in texts[1]


def test_magics_notebook():
    nb = execute_notebook(NOTEBOOKS / "magics.ipynb", timeout=300)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    texts = ["".join(output_text(o) for o in c.outputs) for c in cells]
    assert "[rank 0] rank 0 of 2: x = [1.0, 1.0, 1.0]" in texts[1]
    assert "[rank 1] rank 1 of 2: x = [2.0, 2.0, 2.0]" in texts[1]
    assert "[rank 0] tensor([3., 3., 3.])" in texts[2]
    assert "[rank 1] tensor([3., 3., 3.])" in texts[2]
    assert texts[3].strip() == "[rank 1] only rank 1 runs this"
    assert "y from rank 1: [31.0, 31.0, 31.0]" in texts[6]
    errors = [o for o in cells[7].outputs if o.output_type == "error"]
    assert [(e.ename, e.evalue) for e in errors] == [("KeyError", "'missing_column'")]
    assert "\nraised on rank 1" in "\n".join(errors[0].traceback)
    assert "still alive on rank 1" in texts[8]
    assert "idle" in texts[9]
    assert "Pool shut down." in texts[10]


def test_training_notebook():
    texts = _run("training.ipynb")
    assert "GPT-2 with" in texts[0] and "40 evaluation blocks of 64 bytes" in texts[0]
    assert "[rank 0] epoch 2: eval loss" in texts[1]
    assert "on 40 evaluation blocks" in texts[1]  # gather_for_metrics: exactly the eval set
    assert "'seen': 40, 'world': 2, 'precision': 'bf16', 'type': 'MULTI_CPU'" in texts[1]
    first, last = (float(v) for v in texts[2].split("loss went from ")[1].split(" to "))
    assert last < first - 1.0  # a byte-level model starts near ln 256 and learns the text
    assert "same evaluation loss after resume: True" in texts[3]


def test_fsdp_notebook():
    texts = _run("fsdp.ipynb")
    for rank in (0, 1):
        assert f"[rank {rank}] FSDP: this rank holds 50% of the parameters" in texts[1]
    assert "pytorch_model_fsdp_0" in texts[1]
    assert "merged file: model.safetensors | loads into a plain Net: True" in texts[2]
    assert "UserWarning" not in texts[2]


def test_big_model_notebook():
    nb = execute_notebook(NOTEBOOKS / "big_model.ipynb", timeout=300, allow_errors=False)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    texts = ["".join(output_text(o) for o in c.outputs) for c in cells]
    assert "checkpoint: ['config.json', 'generation_config.json', 'model.safetensors']" in texts[0]
    assert "parameters live on: {'meta'}" in texts[1]
    assert "Memory estimate for LlamaForCausalLM" in texts[1] and "training (Adam)" in texts[1]
    assert "Device map of LlamaForCausalLM" in texts[3]
    assert "cpu [" in texts[3] and "disk [" in texts[3] and "model.layers.5" in texts[3]
    assert "tied head and embedding: True" in texts[4]
    assert "same tokens as the model held in memory: True" in texts[4]
    assert "new tokens: [" in texts[4] and "as text: b'Big models" in texts[4]
    assert "Device map of LlamaForCausalLM" in texts[5]  # the loaded model's own map
    in_ram, whole = (
        float(v) for v in re.findall(r"in RAM: ([\d.]+) MiB of ([\d.]+) MiB", texts[6])[0]
    )
    assert 0 < in_ram < whole  # some layers stay on disk
    # the pictures: the memory estimate, the device map (HTML and figure), RAM against disk
    pictures = [
        i for i, c in enumerate(cells) if any("image/png" in o.get("data", {}) for o in c.outputs)
    ]
    assert pictures == [2, 5, 6]
    assert any("text/html" in o.get("data", {}) for o in cells[3].outputs)


def test_widgets_notebook_stores_live_widgets():
    nb = execute_notebook(NOTEBOOKS / "widgets.ipynb", timeout=300, allow_errors=False)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    texts = ["".join(output_text(o) for o in c.outputs) for c in cells]
    assert "[rank 0] rank 0: training 600 steps" in texts[1]
    assert "600/600" in texts[1]  # the final progress state, exact
    assert "Device map of Sequential" in texts[2]
    for gpu in ("cuda:0", "cuda:1"):  # planned for, here or not: the notebook plans for a cluster
        assert f"{gpu} [" in texts[2]
    if torch.cuda.device_count() == 0:  # GPUs this machine lacks are named in one line
        assert texts[2].count("max_memory names cuda:0, cuda:1, which this machine does not") == 1
    assert "Memory estimate for Sequential" in texts[3]
    assert "fit: 60 logged steps" in texts[4]
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    bars = [m["state"] for m in state.values() if m["model_name"] == "FloatProgressModel"]
    assert bars and any(b.get("value") == b.get("max") for b in bars)


def test_transformers_trainer_notebook():
    texts = _run("transformers_trainer.ipynb")
    assert "391 blocks of 64 bytes; a Llama with 361,088 parameters" in texts[0]
    assert "[rank 0] 100%" in texts[2] and "60/60" in texts[2]  # the Trainer's bar, rank 0's
    assert "[rank 1] 100%" not in texts[2]  # one run on 2 ranks: rank 1 shows no bar
    assert "Trainer: 12 logged steps; last: loss=" in texts[2]  # the metrics plot
    first, last = (float(v) for v in texts[3].split("loss went from ")[1].split()[0:3:2])
    assert last < first - 1.0  # a byte-level model starts near ln 256 and learns the text
    generated = texts[3].split("\n", 1)[1]
    assert generated.startswith("The fork server ") and len(generated.strip()) > 40
