"""A max_memory key naming a GPU this machine does not have: planned for by default (plan here,
run where it exists) or left out with absent_gpus="drop"; one warning line either way, once per
call even when one planner calls another."""

import logging

import pytest
import torch
from torch import nn

from nbaccel.bigmodel import get_device_map, get_max_memory, infer_auto_device_map
from nbaccel.bigmodel.empty import init_empty_weights
from nbaccel.notebook.kernel.widgets.device_map_view import DeviceMapView, show_device_map

LOGGER = "nbaccel.bigmodel.planning.absent_devices"
ABSENT = torch.cuda.device_count()  # the first GPU id this machine does not have
NAME = f"cuda:{ABSENT}"
MiB = 2**20


def _model() -> nn.Module:
    with init_empty_weights():
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])  # 8 x 257 KiB


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


@pytest.fixture
def caplog_absent(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    return caplog


def test_default_plans_for_the_absent_gpu_and_says_so_in_one_line(caplog_absent) -> None:
    budgets = {ABSENT: "1MiB", "cpu": "10MiB"}
    device_map = infer_auto_device_map(_model(), max_memory=budgets)
    assert ABSENT in set(device_map.values())
    [line] = _lines(caplog_absent)
    assert "\n" not in line
    assert f"max_memory names {NAME}, which this machine does not have" in line
    assert "planned for as given" in line and "absent_gpus='drop'" in line


def test_drop_leaves_the_absent_gpu_out_and_names_the_devices_used(caplog_absent) -> None:
    budgets = {ABSENT: "1MiB", "cpu": "1MiB"}
    device_map = infer_auto_device_map(_model(), max_memory=budgets, absent_gpus="drop")
    assert set(device_map.values()) == {"cpu", "disk"}
    [line] = _lines(caplog_absent)
    assert "\n" not in line
    assert f"names {NAME}" in line and "left out of the plan" in line
    assert line.endswith("which uses cpu, disk.")
    assert get_max_memory(budgets, absent_gpus="drop") == {"cpu": MiB}


@pytest.mark.parametrize("strategy", ["auto", "balanced", "balanced_low_0", "sequential"])
def test_one_line_when_one_planner_calls_another(caplog_absent, strategy) -> None:
    budgets = {ABSENT: "1MiB", ABSENT + 1: "1MiB", "cpu": "10MiB"}
    get_device_map(_model(), strategy, max_memory=budgets)
    [line] = _lines(caplog_absent)
    assert f"names {NAME}, cuda:{ABSENT + 1}," in line


def test_device_map_view_says_it_once_and_marks_the_plan(caplog_absent) -> None:
    view = DeviceMapView(_model(), max_memory={ABSENT: "1MiB", "cpu": "10MiB"})
    assert len(_lines(caplog_absent)) == 1
    assert view.planned_absent == [ABSENT] and ABSENT in view.devices
    assert f"{NAME}: not on this machine" in view.text()
    assert 'class="nbaccel-device-planned"' in view._repr_html_()
    caplog_absent.clear()
    dropped = show_device_map(
        _model(), max_memory={ABSENT: "1MiB", "cpu": "10MiB"}, absent_gpus="drop"
    )
    assert len(_lines(caplog_absent)) == 1
    assert dropped.planned_absent == [] and ABSENT not in dropped.devices
    assert "nbaccel-device-planned" not in dropped._repr_html_()


def test_devices_that_are_here_say_nothing(caplog_absent) -> None:
    infer_auto_device_map(_model(), max_memory={"cpu": "1MiB", "disk": "1GiB"})
    get_max_memory()
    assert _lines(caplog_absent) == []


def test_an_unknown_mode_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"absent_gpus='keep': use 'plan' .* or 'drop'"):
        get_max_memory({"cpu": "1MiB"}, absent_gpus="keep")
