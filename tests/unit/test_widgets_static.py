"""Device-map viewer, memory estimate (+ CLI) and notebook tracker, in process."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from nbaccel.bigmodel.empty import init_empty_weights
from nbaccel.bigmodel.memory_estimate import estimate_memory
from nbaccel.cli import main as cli_main
from nbaccel.notebook.kernel.widgets.device_map_view import DeviceMapView, show_device_map


def _net() -> nn.Module:
    return nn.Sequential(nn.Embedding(100, 64), nn.Linear(64, 64), nn.Linear(64, 10))


def test_device_map_view_of_a_meta_model() -> None:
    with init_empty_weights():
        model = _net()
    view = DeviceMapView(model, {"0": 0, "1": "cpu", "2": "disk"}, max_memory={0: "1MiB"})
    assert view.devices == [0, "cpu", "disk"]
    assert view.used(0) == 100 * 64 * 4 and view.used("disk") == (64 * 10 + 10) * 4
    assert view.capacity[0] == 2**20 and view.capacity["disk"] is None
    assert view.device_of("1.weight") == "cpu" and view.device_of("") == "mixed"
    html = view._repr_html_()
    assert html.count('class="nbaccel-device"') == 3 and "offloaded to cpu and disk" in html
    assert html.count("<details") == 1  # the root; leaves are plain rows
    text = view.text()
    assert "cuda:0 [" in text and "25.0 KiB / 1.0 MiB" in text
    fig = view.figure()
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["cuda:0", "cpu", "disk"]
    assert fig.axes[0].get_xlabel().startswith("MiB")  # the largest bar: the 1 MiB capacity
    # a bad max_memory is named, not drawn as "no capacity" (main swallowed it)
    with pytest.raises(ValueError, match=r"max_memory\[0\]: Invalid memory size '1 gig'"):
        DeviceMapView(model, {"": 0}, max_memory={0: "1 gig"})


def test_device_map_of_a_real_model_and_bad_maps(capsys) -> None:
    model = _net()
    view = show_device_map(model)  # no IPython here: printed as text
    assert view.device_map == {"": "cpu"}
    assert capsys.readouterr().out.startswith("Device map of Sequential (")
    with pytest.raises(ValueError, match="does not place"):
        DeviceMapView(model, {"0": "cpu"})
    model.hf_device_map = {"0": "cpu", "1": "cpu", "2": "disk"}
    assert DeviceMapView(model).devices == ["cpu", "disk"]


def test_estimate_memory_numbers() -> None:
    est = estimate_memory(_net, dtypes=("float32", "bfloat16", "int4"))
    params = 100 * 64 + 64 * 64 + 64 + 64 * 10 + 10
    assert est.parameters == params
    f32, bf16, int4 = est.rows
    assert f32.total == 4 * params and bf16.total == 2 * params and int4.total == params // 2
    assert f32.largest_layer == 100 * 64 * 4 and f32.largest_layer_names == ["0"]
    assert f32.training == 16 * params and int4.training is None
    assert "nbaccel-memory-estimate" in est._repr_html_()
    with pytest.raises(ValueError, match="Unknown dtype"):
        estimate_memory(_net, dtypes=("float8",))
    with pytest.raises(TypeError, match="not an nn.Module"):
        estimate_memory(lambda: 3)


def test_estimate_on_meta_allocates_nothing() -> None:
    def huge() -> nn.Module:  # 40 GB in float32 if it were allocated
        return nn.Sequential(*[nn.Linear(50_000, 50_000, bias=False) for _ in range(4)])

    est = estimate_memory(huge, dtypes=("float32",))
    assert est.rows[0].total == 4 * 4 * 50_000**2


def test_cli_estimate_memory(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "factories.py").write_text(
        "from torch import nn\ndef build():\n    return nn.Linear(1000, 100)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert cli_main(["estimate-memory", "factories:build", "--dtypes", "float32", "int8"]) == 0
    out = capsys.readouterr().out
    assert "Memory estimate for Linear (100.1K parameters)" in out and "int8" in out
    assert cli_main(["estimate-memory", "factories.py:build", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parameters"] == 100_100 and data["rows"][0]["total"] == 400_400
    assert cli_main(["estimate-memory", "factories:nope"]) == 2
    assert "has no attribute 'nope'" in capsys.readouterr().err


def test_notebook_tracker_is_registered_and_records() -> None:
    from nbaccel.training.tracking.registry import available_trackers, build_tracker

    assert "notebook" in available_trackers()
    tracker = build_tracker("notebook", "demo", None)
    for step in range(3):
        tracker.log({"loss": torch.tensor(2.0**-step), "name": "ignored"}, step=step)
    assert tracker.plot.history == {"loss": [(0.0, 1.0), (1.0, 0.5), (2.0, 0.25)]}
    assert tracker.plot.png().startswith(b"\x89PNG")
    tracker.finish()


def test_output_panel_stays_bounded() -> None:
    from nbaccel.notebook.kernel.widgets.output_panel import OutputPanel

    panel = OutputPanel(max_lines=100)
    for i in range(20_000):
        panel.add(i % 2, "stderr" if i % 1000 == 0 else "stdout", f"line {i} <tag>")
    panel.flush(force=True)
    assert panel.lines == 20_000
    assert panel.tabs.titles == ("all ranks", "rank 0", "rank 1")
    merged, rank0, _ = (w.value for w in panel.tabs.children)
    assert "9900 earlier lines not kept" in rank0 and "line 19998 &lt;tag&gt;" in rank0
    assert "19800 earlier lines not kept" in merged and "<b>[rank 1]</b> line 19999" in merged
    assert len(merged) < 20 * 200 * 2  # ~200 lines of ~40 characters, not 20k lines
