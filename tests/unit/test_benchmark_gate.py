"""benchmarks/gate's verdicts on made-up measurements (pure logic, no timing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
pytest.importorskip("tomllib", reason="gate.toml is read with tomllib (Python >= 3.11)")

from gate_check import Measured, combine, exit_code, judge, load_thresholds, render  # noqa: E402

TOML = """
[gate]
noise = 0.1

[launch]
figure = "no-op launch"
peer = "accelerate"
max = 0.25

[cell]
figure = "warm cell"
peer = "plain cell"
kind = "difference"
unit = "ms"
max = 1.0
noise = 0.5

[steps]
figure = "steps/s"
peer = "hand DDP"
min = 0.97
noise = 0.03
"""


@pytest.fixture
def thresholds(tmp_path):
    path = tmp_path / "gate.toml"
    path.write_text(TOML)
    return load_thresholds(path)


def _verdicts(rows):
    return {r.key: r.verdict for r in rows}


def test_inside_the_bound_passes_inside_the_noise_passes_as_noise(thresholds):
    rows = judge(
        {
            "launch": Measured(0.05, 0.2),  # 0.25: on the bound
            "cell": Measured(7.3, 6.0, "ms"),  # +1.3 ms: inside the 0.5 ms margin
            "steps": Measured(9.5, 10.0, "steps/s"),  # 0.95 >= 0.97 * 0.97
        },
        thresholds,
    )
    assert _verdicts(rows) == {"launch": "pass", "cell": "pass (noise)", "steps": "pass (noise)"}
    assert exit_code(rows) == 0
    assert rows[0].value == pytest.approx(0.25) and rows[1].value == pytest.approx(1.3)


def test_a_regression_fails_the_gate(thresholds):
    rows = judge(
        {
            "launch": Measured(0.1, 0.2),  # 0.5 > 0.25 * 1.1
            "cell": Measured(8.0, 6.0, "ms"),  # +2 ms > 1.5
            "steps": Measured(9.0, 10.0),  # 0.9 < 0.97 * 0.97
        },
        thresholds,
    )
    assert _verdicts(rows) == {"launch": "FAIL", "cell": "FAIL", "steps": "FAIL"}
    assert exit_code(rows) == 1


def test_skipped_peers_are_notices_and_our_errors_fail(thresholds):
    rows = judge(
        {
            "launch": Measured(skipped="accelerate is not installed"),
            "cell": Measured(error="magics: RuntimeError: boom"),
        },
        thresholds,
    )
    verdicts = _verdicts(rows)
    assert verdicts["launch"] == "skipped: accelerate is not installed"
    assert verdicts["cell"].startswith("ERROR: magics")
    assert verdicts["steps"] == "skipped: not measured in this run"
    assert exit_code(rows) == 1
    assert exit_code(judge({"launch": Measured(skipped="x")}, thresholds)) == 0


def test_a_repeated_gate_judges_each_figure_by_its_median_over_the_runs(thresholds):
    runs = [
        {
            "launch": Measured(0.08, 0.2),
            "cell": Measured(9.0, 6.0, "ms"),
            "steps": Measured(9.0, 10.0),
        },
        {
            "launch": Measured(0.05, 0.25),
            "cell": Measured(6.4, 6.0, "ms"),
            "steps": Measured(error="x"),
        },
        {
            "launch": Measured(0.03, 0.2),
            "cell": Measured(5.8, 5.0, "ms"),
            "steps": Measured(10.0, 10.0),
        },
    ]
    combined = combine(runs, thresholds)
    rows = {r.key: r for r in judge(combined, thresholds)}
    # ratios 0.4, 0.2, 0.15: one slow run does not fail the gate, the median (0.2) passes
    assert rows["launch"].value == pytest.approx(0.2) and rows["launch"].verdict == "pass"
    assert "median of 3 runs: 0.150 to 0.400" in rows["launch"].detail
    assert combined["launch"].ours == pytest.approx(0.05) and combined["launch"].peer == 0.2
    # differences +3.0, +0.4, +0.8 ms: the median difference, not the difference of medians
    assert rows["cell"].value == pytest.approx(0.8) and rows["cell"].verdict == "pass"
    # our side failing in any run is an error of the figure
    assert rows["steps"].verdict == "ERROR: x"
    assert exit_code(list(rows.values())) == 1


def test_a_repeated_gate_keeps_notices_and_judges_the_runs_that_measured(thresholds):
    runs = [
        {"launch": Measured(skipped="accelerate is not installed"), "cell": Measured(8.0, 6.0)},
        {"launch": Measured(skipped="accelerate is not installed"), "cell": Measured(skipped="y")},
    ]
    rows = {r.key: r for r in judge(combine(runs, thresholds), thresholds)}
    assert rows["launch"].verdict == "skipped: accelerate is not installed"
    assert rows["cell"].value == pytest.approx(2.0) and rows["cell"].verdict == "FAIL"
    assert rows["steps"].verdict == "skipped: not measured in this run"


def test_table_has_one_line_per_figure_with_its_threshold(thresholds):
    rows = judge({"launch": Measured(0.04, 0.2), "cell": Measured(6.5, 6.0, "ms")}, thresholds)
    text = render(rows)
    lines = text.splitlines()
    assert lines[0].split()[:5] == ["figure", "peer", "ratio", "threshold", "verdict"]
    assert len(lines) == 2 + 3
    assert "<= 0.25 (noise 10%)" in lines[2] and "0.200" in lines[2]
    assert "<= 1 ms (noise 0.5 ms)" in lines[3] and "0.500" in lines[3]


def test_the_real_gate_toml_is_well_formed():
    figures = load_thresholds(ROOT / "benchmarks" / "gate.toml")
    assert {"first_step_first", "first_step_later", "launch_2", "launch_8"} <= set(figures)
    assert list(figures)[0] == "first_step_first"  # the headline: real work
    for spec in figures.values():  # a ratio's margin is a fraction, a difference's an amount
        assert spec["noise"] > 0 and (spec["kind"] == "difference" or spec["noise"] < 1)


def test_a_threshold_needs_exactly_one_bound(tmp_path):
    path = tmp_path / "gate.toml"
    path.write_text('[x]\nfigure = "x"\n')
    with pytest.raises(ValueError, match="exactly one of max or min"):
        load_thresholds(path)


@pytest.mark.parametrize(
    "body,names",
    [
        ('max = 1.0\nkind = "diff"', "kind = 'diff'"),
        ('max = "0.25"', "max = '0.25'"),
        ("max = 0.25\nnoise = -0.1", "noise = -0.1"),
        ("min = true", "min = True"),
    ],
)
def test_a_malformed_threshold_is_named_with_the_fix(tmp_path, body, names):
    path = tmp_path / "gate.toml"
    path.write_text(f'[x]\nfigure = "x"\n{body}\n')
    with pytest.raises(ValueError, match="gate.toml \\[x\\]") as raised:
        load_thresholds(path)
    assert names in str(raised.value) and (
        "use" in str(raised.value) or "give" in str(raised.value)
    )


def test_the_trainer_rows_are_nbaccels_medians_over_accelerates_same_kind_of_front():
    import bench_first_step

    figures = load_thresholds(ROOT / "benchmarks" / "gate.toml")
    keys = bench_first_step.TRAINER_GATE
    assert set(keys) == {k for k in figures if k.startswith("trainer_")}
    medians = {  # seconds: first step, then train_runtime per step
        "nbaccel_notebook": {"first_step_s": 9.0, "step_s": 0.026},
        "accelerate_notebook": {"first_step_s": 10.0, "step_s": 0.025},
        "nbaccel_launch": {"first_step_s": 14.0, "step_s": 0.030},
        "accelerate_launch": {"first_step_s": 10.0, "step_s": 0.030},
    }
    measured = {
        key: Measured(*pair) for key, pair in bench_first_step.trainer_figures(medians).items()
    }
    rows = {r.key: r for r in judge(measured, figures) if r.key in keys}
    assert rows["trainer_first_step_notebook"].value == pytest.approx(0.9)
    assert rows["trainer_first_step_notebook"].verdict == "pass"
    assert rows["trainer_step_notebook"].value == pytest.approx(1.04)
    assert rows["trainer_step_notebook"].verdict == "pass (noise)"
    assert rows["trainer_first_step_script"].verdict == "FAIL"  # 1.4 > 1.0 * 1.25
    assert rows["trainer_step_script"].value == pytest.approx(1.0)
