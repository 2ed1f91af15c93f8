"""Output at volume and partial lines, in a real kernel: bounded, announced, never lost.

A ``%%distributed`` cell or a launch shows at most the output budget (lines, characters per line,
characters per call); the rest goes to a log file named by a notice, which holds every line.
Partial lines (``print(..., end="")``) are shown at the end of their own cell.
"""

from __future__ import annotations

import glob
import os
import re

from kernel import cell_errors, cell_text, run_notebook

from nbaccel.launch.driver.output_budget import OutputBudget

VOLUME = """%%distributed -n 2
import sys
for i in range(20_000):
    print(f"line {i}")
sys.stderr.write("E" * 1_000_000 + "\\n")
print("last line")
"""


def test_a_flood_is_bounded_and_the_log_holds_every_line(tmp_path):
    nb = run_notebook(
        ["%load_ext nbaccel", VOLUME, "%%distributed -n 2\nprint('after')"],
        timeout=300,
        env={"NBACCEL_LOG_DIR": str(tmp_path), "NBACCEL_KEEP_LOGS": "1"},
    )
    assert not cell_errors(nb.cells[1])
    text = cell_text(nb.cells[1])
    assert len(text) < 300_000  # 40k lines and 2 MB of stderr were printed
    notices = re.findall(r"the full output is in (\S+\.log)", text)
    assert notices, text[-2000:]
    with open(notices[0]) as handle:
        log = handle.read()
    for rank in (0, 1):
        assert log.count(f"[rank {rank}] line ") == 20_000
        assert f"[rank {rank}] line 19999\n" in log
        assert f"[rank {rank}] last line\n" in log
        pieces = re.findall(rf"^\[rank {rank}\] \(stderr\)( \(continued\))? (E+)$", log, re.M)
        assert sum(len(e) for _, e in pieces) == 1_000_000
    assert "[rank 0] after" in cell_text(nb.cells[2])  # the next cell starts afresh
    assert "output limit" not in cell_text(nb.cells[2])
    assert glob.glob(os.path.join(tmp_path, "*.log")) == notices[:1]


PARTIAL = """%%distributed -n 2
import sys
print("no newline", end="")
sys.stderr.write("stderr without newline")
"""


def test_partial_lines_end_with_their_cell():
    nb = run_notebook(
        ["%load_ext nbaccel", PARTIAL, "%%distributed -n 2\nprint('next cell')"], timeout=180
    )
    first, second = cell_text(nb.cells[1]), cell_text(nb.cells[2])
    for rank in (0, 1):
        assert f"[rank {rank}] no newline" in first
        assert f"[rank {rank}] stderr without newline" in first
        assert f"[rank {rank}] next cell" in second
    assert "no newline" not in second


def test_long_lines_are_cut_for_display_and_kept_whole_in_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("NBACCEL_LOG_DIR", str(tmp_path))
    notices: list[str] = []
    budget = OutputBudget(max_lines=3, max_line_chars=10, notice=notices.append)
    budget.begin("launch")
    shown = [budget.take(0, "stdout", text, False, True) for text in ("a", "b" * 50, "c", "d")]
    budget.end()
    assert shown[0] == "a" and shown[2] == "c" and shown[3] is None
    assert shown[1].startswith("b" * 10 + " ... [line cut")
    assert "1 of 4 lines not shown; 1 long line(s) cut" in notices[-1]
    with open(budget_path(notices)) as handle:
        assert handle.read().splitlines() == [
            "[rank 0] a",
            f"[rank 0] {'b' * 50}",
            "[rank 0] c",
            "[rank 0] d",
        ]


def test_a_call_within_the_budget_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("NBACCEL_LOG_DIR", str(tmp_path))
    budget = OutputBudget(notice=lambda text: None)
    budget.begin("cell")
    assert budget.take(1, "stderr", "fine", False, True) == "fine"
    budget.end()
    assert os.listdir(tmp_path) == []


def budget_path(notices: list[str]) -> str:
    return re.search(r"the full output is in (\S+\.log)", notices[-1]).group(1)
