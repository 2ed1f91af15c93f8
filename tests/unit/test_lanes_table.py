"""scripts/test-lanes' own logic: what a lane's output says, which lanes skip here and why, and
the table. Running the lanes themselves is the command's job (`scripts/test-lanes`)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lanes", ROOT / "scripts" / "lanes.py")
lanes = importlib.util.module_from_spec(_spec)
sys.modules["lanes"] = lanes
_spec.loader.exec_module(lanes)


def test_every_lane_script_exists_and_is_listed_once():
    names = [lane.name for lane in lanes.LANES]
    assert len(names) == len(set(names))
    scripts = sorted(p.name.removeprefix("test-") for p in (ROOT / "scripts").glob("test-*"))
    assert sorted(names) == sorted(s for s in scripts if s != "lanes")
    for lane in lanes.LANES:
        assert Path(lane.command[-1]).is_file()


def test_the_lane_verdict_is_its_last_count_line():
    out = [
        "....",
        "===== 3 failed, 24 passed, 7 deselected in 494.46s (0:08:14) =====",
        "hosts down",
    ]
    assert lanes.summary(out) == "3 failed, 24 passed, 7 deselected"
    assert lanes.summary(["ok   a", "browser lane: passed", "screenshots in x"]) == (
        "browser lane: passed"
    )
    assert lanes.summary(["", "nothing to count", ""]) == "nothing to count"
    assert lanes.summary(["....", "..sF.  [ 40%]", ""]) == "no verdict printed"


def test_a_lane_needing_what_is_missing_is_skipped_with_the_reason(capsys):
    missing = lanes.Lane("probe", "needs a thing", lambda: "needs a thing this machine lacks")
    left_out = lanes.Lane("other", "fits nowhere", not_in_ci="too long for CI")
    assert lanes.skip_reason(left_out, ci=False) is None
    rows = lanes.run_lanes([missing, left_out], ci=True)  # neither starts a process
    assert [(r.lane, r.result, r.detail) for r in rows] == [
        ("probe", "skipped", "needs a thing this machine lacks"),
        ("other", "skipped", "left out of CI: too long for CI"),
    ]
    assert "lane probe: skipped: needs a thing this machine lacks" in capsys.readouterr().out


def test_the_table_lines_up_its_columns():
    rows = [
        lanes.Row("hosts", "passed", "25 passed, 7 deselected", 301.4),
        lanes.Row("gpu", "skipped", "needs a CUDA GPU: no nvidia-smi on this machine", 0.0),
    ]
    text = lanes.table(rows).splitlines()
    assert text[0].split() == ["lane", "result", "seconds", "tests", "/", "reason"]
    assert text[1].split()[:3] == ["hosts", "passed", "301"]
    assert text[2].index("skipped") == text[1].index("passed")
    assert text[2].endswith("needs a CUDA GPU: no nvidia-smi on this machine")


def test_ci_leaves_out_the_tests_it_names_and_only_in_ci():
    left_out = {"tests/hosts/test_remote_hosts.py::test_many_hosts_notebook": "a reason"}
    hosts = lanes.Lane("hosts", "ssh hosts", ci_deselect=left_out)
    assert hosts.argv(ci=False) == hosts.command == ["bash", str(ROOT / "scripts/test-hosts")]
    extra = hosts.argv(ci=True)[len(hosts.command) :]
    assert extra == ["--deselect", "tests/hosts/test_remote_hosts.py::test_many_hosts_notebook"]
    for lane in lanes.LANES:  # what the real lanes leave out names real tests, with a reason
        for test, why in lane.ci_deselect.items():
            file, _, name = test.partition("::")
            assert f"def {name}(" in (ROOT / file).read_text() and why
