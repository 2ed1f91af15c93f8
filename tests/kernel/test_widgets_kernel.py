"""The notebook widgets in a real kernel (nbclient, widget state stored in the notebook)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from nbaccel.notebook.kernel.run_headless import execute_notebook, output_text

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

CELLS = [
    # 0
    "import os, time\nfrom nbaccel import notebook_launcher",
    # 1: two ranks, a bar each, a bar disabled on rank 1, a transient bar, some output
    """def train(n):
    import time
    from tqdm.auto import tqdm, trange
    from nbaccel import PartialState
    rank = PartialState().process_index
    print(f"starting on rank {rank}")
    for _ in tqdm(range(n), desc="train"):
        time.sleep(0.0005)
    for _ in trange(4, desc="eval", disable=rank == 1):
        pass
    for _ in trange(3, desc="scratch", leave=False):
        pass
    return rank
notebook_launcher(train, (1500,), num_processes=2)""",
    # 2: memory=False
    "notebook_launcher(train, (10,), num_processes=2, memory=False)",
    # 3: the plain-text renderer
    """os.environ["NBACCEL_RENDERER"] = "text"
try:
    notebook_launcher(train, (10,), num_processes=2, memory=False)
finally:
    del os.environ["NBACCEL_RENDERER"]""",
    # 4: device map of a meta model, as the last expression
    """from torch import nn
from nbaccel.bigmodel.empty import init_empty_weights
from nbaccel.notebook.kernel.widgets.device_map_view import show_device_map
with init_empty_weights():
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
placement = {"0": 0, "1": 0, "2": 0, "3": "cpu", "4": "cpu", "5": "disk", "6": "disk", "7": "disk"}
show_device_map(model, placement, max_memory={0: "4MiB", "cpu": "2GiB"})""",
    # 5: memory estimate
    """from nbaccel.bigmodel.memory_estimate import estimate_memory
estimate_memory(lambda: nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10)))""",
    # 6: notebook tracker on rank 0 of a launch
    """def fit():
    from nbaccel import Accelerator
    acc = Accelerator(log_with="notebook")
    acc.init_trackers("fit")
    for step in range(20):
        acc.log({"loss": 1.0 / (step + 1)}, step=step)
    acc.end_training()
notebook_launcher(fit, num_processes=2)""",
]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    path = Path(tmp_path_factory.mktemp("widgets")) / "widgets.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nbformat.write(nb, str(path))
    nb = execute_notebook(path, timeout=120)
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    return nb.cells, state


def _models(state: dict, cell) -> list[dict]:
    """Every widget model shown by ``cell`` (the displayed views and all their descendants)."""
    todo = [
        o.data[WIDGET_VIEW]["model_id"] for o in cell.outputs if WIDGET_VIEW in o.get("data", {})
    ]
    seen: list[dict] = []
    while todo:
        model = state[todo.pop()]
        seen.append(model)
        for child in model["state"].get("children", []):
            todo.append(child.removeprefix("IPY_MODEL_"))
    return seen


def _classes(models: list[dict], name: str) -> list[dict]:
    return [m for m in models if name in m["state"].get("_dom_classes", [])]


def _texts(models: list[dict]) -> list[str]:
    return [m["state"]["value"] for m in models if m["model_name"] == "HTMLModel"]


def _text(cell) -> str:
    return "".join(output_text(o) for o in cell.outputs)


def test_rank_labelled_progress_bars(executed):
    cells, state = executed
    models = _models(state, cells[1])
    bars = _classes(models, "nbaccel-bar")
    rows = {}
    for bar in bars:
        row = [state[c.removeprefix("IPY_MODEL_")] for c in bar["state"]["children"]]
        label, progress = row[0]["state"]["value"], row[1]["state"]
        rows[label] = progress
    # one row per rank and kept bar; rank 1's disabled bar and the leave=False bars are absent
    assert sorted(rows) == [
        "<b>rank 0</b> · eval",
        "<b>rank 0</b> · train",
        "<b>rank 1</b> · train",
    ]
    for label, progress in rows.items():
        total = 4 if "eval" in label else 1500
        assert progress["value"] == progress["max"] == total
        assert progress["bar_style"] == "success"
    status = _classes(models, "nbaccel-status")[0]["state"]["value"]
    assert "2 ranks" in status and "finished" in status


def test_memory_monitor_and_output_panel(executed):
    cells, state = executed
    models = _models(state, cells[1])
    rows = _classes(models, "nbaccel-memory-row")
    assert sorted(set(c for r in rows for c in r["state"]["_dom_classes"])) == [
        "nbaccel-memory-row",
        "nbaccel-rank-0",
        "nbaccel-rank-1",
    ]
    host = _classes(models, "nbaccel-host-bar")
    assert len(host) == 2 and all(0 < h["state"]["value"] < h["state"]["max"] for h in host)
    assert any("<svg" in t for t in _texts(models))  # the timeline
    tabs = next(m for m in models if m["model_name"] == "TabModel")
    assert tabs["state"]["titles"] == ["all ranks", "rank 0", "rank 1"]
    logs = "".join(t for t in _texts(models) if "<pre" in t)
    assert "<b>[rank 1]</b> starting on rank 1" in logs
    # memory=False: no monitor in that launch
    assert not _classes(_models(state, cells[2]), "nbaccel-memory")
    assert _classes(_models(state, cells[2]), "nbaccel-bar")


def test_text_twin_in_the_saved_notebook(executed):
    cells, _ = executed
    text = _text(cells[1])
    assert "Launching on 2 CPU processes (gloo)." in text
    assert "[rank 0] starting on rank 0" in text and "[rank 1] starting on rank 1" in text
    summary = next(
        o for o in cells[1].outputs if "nbaccel-summary" in o.get("data", {}).get("text/html", "")
    )
    plain = summary.data["text/plain"]
    assert "[rank 0] train: 100%" in plain and "1500/1500" in plain
    assert "[rank 0] eval: 100%" in plain and "[rank 1] eval" not in plain
    assert "scratch" not in plain
    assert "Memory peak per rank: rank 0: host RSS" in plain
    assert "peak host RSS" in summary.data["text/html"]
    assert "[0, 1]" in text
    for cell in cells:
        assert "\r" not in _text(cell)


def test_text_renderer_fallback(executed):
    cells, _ = executed
    assert not [o for o in cells[3].outputs if WIDGET_VIEW in o.get("data", {})]
    text = _text(cells[3])
    assert "[rank 0] train: 100%" in text and "[rank 1] train: 100%" in text
    assert "[rank 0] eval: 100%" in text and "[rank 1] eval" not in text


def test_device_map_and_memory_estimate(executed):
    cells, _ = executed
    shown = [o for o in cells[4].outputs if o.output_type in ("display_data", "execute_result")]
    assert len(shown) == 1  # displayed once, not again as the cell's value
    html = shown[0].data["text/html"]
    assert 'class="nbaccel-device-map"' in html and "offloaded to" in html
    plain = shown[0].data["text/plain"]
    assert plain.startswith("Device map of Sequential (8.0 MiB)")
    assert "cuda:0 [" + "#" * 23 + "." * 7 + "] 3.0 MiB / 4.0 MiB" in plain
    assert "disk [" in plain and "3.0 MiB" in plain
    estimate = cells[5].outputs[0].data
    assert "nbaccel-memory-estimate" in estimate["text/html"]
    rows = [line.split() for line in estimate["text/plain"].splitlines()]
    assert ["float32", "3.8", "MiB", "3.9", "MiB", "15.4", "MiB"] in rows
    assert ["int4", "488.8", "KiB", "493.7", "KiB", "n/a"] in rows


def test_notebook_tracker_from_a_rank(executed):
    cells, state = executed
    images = [o for o in cells[6].outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1
    assert images[0].data["text/plain"] == "fit: 20 logged steps; last: loss=0.05"
    live = _classes(_models(state, cells[6]), "nbaccel-metrics")
    assert not live  # the live plot was replaced by the static one at the end
