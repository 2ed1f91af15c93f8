"""What ./scripts/quickstart runs: notebooks/quickstart.ipynb, executed in a real kernel
(nbclient)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbaccel.notebook.kernel.run_headless import execute_notebook, output_text

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quickstart():
    nb = execute_notebook(ROOT / "notebooks" / "quickstart.ipynb", timeout=180)
    return [c for c in nb.cells if c.cell_type == "code"]


def _text(cell) -> str:
    return "".join(output_text(o) for o in cell.outputs)


def test_state_and_collectives_on_two_ranks(quickstart):
    text = _text(quickstart[1])
    assert "Launching on 2 CPU processes (gloo)." in text
    for rank in (0, 1):
        assert f"[rank {rank}] hello from rank {rank} of 2 on cpu (MULTI_CPU, gloo)" in text
    assert "[rank 0] my prompts: ['a dog', 'a cat']" in text
    assert "[rank 1] my prompts: ['a chicken']" in text
    assert "{'rank': 0, 'sum': 3.0, 'gathered': [1.0, 2.0]}" in text
    assert "{'rank': 1, 'sum': 3.0, 'gathered': [1.0, 2.0]}" in text


def test_progress_results(quickstart):
    assert "[199990000, 199990000]" in _text(quickstart[2])


def test_error_is_original_type_naming_rank_with_cell_traceback(quickstart):
    errors = [o for o in quickstart[3].outputs if o.output_type == "error"]
    assert len(errors) == 1
    assert errors[0].ename == "ValueError"
    assert errors[0].evalue == "rank 1 could not find its data shard"
    traceback = "\n".join(errors[0].traceback)
    assert "\nraised on rank 1" in traceback
    assert "Traceback from rank 1" in traceback
    assert 'raise ValueError("rank 1 could not find its data shard")' in traceback


def test_launch_after_failure_works(quickstart):
    assert "['still here', 'still here']" in _text(quickstart[4])
