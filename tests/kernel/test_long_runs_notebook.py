"""The long-runs example notebook runs top to bottom: a detached run, re-attached after the
handle is gone (standing for a kernel restart), returns its results; nothing is left."""

from __future__ import annotations

from pathlib import Path

from detached import runs_fixture  # noqa: F401 (the fixture `runs`)

from nbaccel.notebook.kernel.run_headless import execute_notebook, output_text

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "long_runs.ipynb"


def test_long_runs_notebook(runs, monkeypatch):
    _, _, env = runs
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    nb = execute_notebook(NOTEBOOK, timeout=300, allow_errors=False)
    texts = ["".join(output_text(o) for o in c.outputs) for c in nb.cells if c.cell_type == "code"]
    assert "detached run" in texts[0]
    assert "count" in texts[1]  # the listing names the run's function
    for rank in (0, 1):
        assert all(f"[rank {rank}] step {i}\n" in texts[2] for i in range(20)), texts[2]
    assert "[20, 120]" in texts[3]
    assert texts[4].strip() == "False"
