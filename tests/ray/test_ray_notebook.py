"""notebooks/ray.ipynb runs top to bottom on a real 2-node Ray cluster on this machine (the
cluster is named to the kernel by ``RAY_ADDRESS``, as the notebook expects)."""

from __future__ import annotations

from pathlib import Path

from ray_cluster import RayCluster

from nbaccel.notebook.kernel.run_headless import execute_notebook, output_text

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "ray.ipynb"


def test_ray_notebook(monkeypatch):
    with RayCluster(cpus=(2, 2)) as cluster:
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        nb = execute_notebook(NOTEBOOK, timeout=300, allow_errors=False)
    texts = ["".join(output_text(o) for o in c.outputs) for c in nb.cells if c.cell_type == "code"]
    assert "2 nodes, 4 CPUs" in texts[0]
    assert "4 ranks, final loss" in texts[1] and "every rank agrees: True" in texts[1]
    assert "on 2 Ray nodes" in texts[1] and "@ " in texts[1]
    assert "same losses: True" in texts[2]
    assert "caught: KeyError 'a column only the last rank lacks' | raised on rank 3 @ " in texts[3]
    assert "sum of ranks: 6.0" in texts[6]
    assert "CPUs free: True" in texts[7]
