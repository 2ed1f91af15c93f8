"""Every example notebook runs top to bottom in a real kernel and shows what it promises.

(quickstart.ipynb has its own file: it is the README's main job.)
"""

from __future__ import annotations

from pathlib import Path

from nbaccel.notebook.run_headless import execute_notebook, output_text

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _run(name: str) -> list[str]:
    nb = execute_notebook(NOTEBOOKS / name, timeout=300, allow_errors=False)
    return ["".join(output_text(o) for o in c.outputs) for c in nb.cells if c.cell_type == "code"]


def test_multi_node_two_drivers_one_world():
    texts = _run("multi_node.ipynb")
    assert "node 0 got [(0, 2, [0, 1])]" in texts[1]
    assert "node 1 got [(1, 2, [0, 1])]" in texts[1]
    assert "Launching on 1 CPU process (gloo) per node, 2 nodes." in texts[1]
