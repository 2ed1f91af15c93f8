"""infer_auto_device_map gives Accelerate's map: expected maps written out (no accelerate
needed), and the same answer as accelerate itself on many random shapes when it is installed."""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict

import pytest
import torch
from _bigmodel_nets import MoeModel, random_case
from torch import nn

from nbaccel.bigmodel import compute_module_sizes, infer_auto_device_map, init_empty_weights


class ThreeLayers(nn.Module):
    """Sizes 64, 72 and 100 bytes (236 in all)."""

    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)


def _with_buffers(fourth: bool = False) -> ThreeLayers:
    model = ThreeLayers()
    model.linear1.register_buffer("b1", torch.zeros(10, 2))
    model.batchnorm.register_buffer("b2", torch.zeros(10, 3))
    model.linear2.register_buffer("b3", torch.zeros(10, 3))
    if fourth:
        model.linear3 = nn.Linear(4, 5)
        model.linear3.register_buffer("b4", torch.zeros(10, 2))
    return model


def _plan(model, **kwargs):
    """The map and the messages of the UserWarnings raised while planning it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm = infer_auto_device_map(model, **kwargs)
    return dm, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize(
    "memory, offload_buffers, expected, warns",
    [
        # Two GPUs: GPU 1 can hold the offloaded layers' buffers (200 bytes): no warning.
        ({0: 400, 1: 400, "cpu": "1GB"}, False, {"batchnorm": 1}, False),
        # Neither GPU can hold them: warn, the map is the same.
        ({0: 400, 1: 200, "cpu": "1GB"}, False, {"batchnorm": 1}, True),
        ({0: 400, 1: 200, "cpu": "1GB"}, True, {"batchnorm": 1}, False),
    ],
)
def test_buffer_check_across_several_devices(memory, offload_buffers, expected, warns):
    dm, messages = _plan(
        _with_buffers(fourth=True), max_memory=memory, offload_buffers=offload_buffers
    )
    assert dm == {"linear1": 0, **expected, "linear2": "cpu", "linear3": "cpu"}
    assert bool(messages) == warns
    if warns:
        assert "Current model requires 200 bytes of buffer" in messages[0]
        assert "offload_buffers=True" in messages[0]


def _nested(sizes: tuple[int, int, int]) -> nn.Module:
    inner = nn.Sequential(
        OrderedDict(
            [
                ("linear1", nn.Linear(sizes[0], 4)),
                ("linear2", nn.Linear(4, sizes[1])),
                ("linear3", nn.Linear(4, sizes[2])),
            ]
        )
    )
    return nn.Sequential(OrderedDict([("module", inner)]))


def test_fallback_allocation_fills_a_device_the_fill_would_leave_empty(caplog):
    model = _nested((10, 4, 8))
    with caplog.at_level(logging.INFO):
        dm, _ = _plan(model, max_memory={0: 256}, fallback_allocation=False)
    assert dm == {"": "disk"}
    assert "insufficient memory" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        dm, _ = _plan(model, max_memory={0: 256}, fallback_allocation=True)
    assert dm == {"module.linear1": "disk", "module.linear2": 0, "module.linear3": "disk"}
    assert "insufficient memory" not in caplog.text


def test_fallback_allocation_partial_fit_no_fit_and_tied():
    assert _plan(_nested((10, 10, 10)), max_memory={0: 30}, fallback_allocation=True)[0] == {
        "": "disk"
    }

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.submodule1 = nn.Linear(20, 20)
            self.submodule2 = nn.Linear(20, 20)

    model = nn.Sequential(OrderedDict([(f"module{i}", Two()) for i in (1, 2, 3)]))
    dm, _ = _plan(model, max_memory={0: 5000}, fallback_allocation=True)
    assert dm == {
        "module1.submodule1": 0,
        "module1.submodule2": "disk",
        "module2": "disk",
        "module3": "disk",
    }
    tied = nn.Module()
    tied.linear1, tied.linear2 = nn.Linear(10, 10), nn.Linear(10, 10)
    tied.linear2.weight = tied.linear1.weight
    assert _plan(tied, max_memory={0: 600}, fallback_allocation=True)[0] == {"": 0}


def test_fallback_allocation_with_buffers_warns():
    model = nn.Sequential(
        OrderedDict(
            [
                ("linear1", nn.Linear(10, 10)),
                ("bn", nn.BatchNorm1d(10)),
                ("linear2", nn.Linear(10, 10)),
            ]
        )
    )
    for name in ("linear1", "bn", "linear2"):
        getattr(model, name).register_buffer("extra", torch.zeros(5))
    dm, messages = _plan(model, max_memory={0: 678}, fallback_allocation=True)
    assert dm == {"bn": 0, "linear1": "disk", "linear2": "disk"}
    assert messages and "Current model requires 40 bytes of buffer" in messages[0]


# --- the same answer as accelerate, on random shapes ---------------------------------------


def test_same_map_and_warnings_as_accelerate_on_random_shapes():
    accelerate_utils = pytest.importorskip(
        "accelerate.utils", reason="accelerate is not installed (pip install -e '.[bench]')"
    )
    logging.getLogger("accelerate").setLevel(logging.ERROR)  # "Device 0 is not available"
    compared = 0
    for seed in range(200):
        model, kwargs = random_case(seed)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                theirs = accelerate_utils.infer_auto_device_map(model, **dict(kwargs))
        except Exception:  # shapes accelerate itself cannot plan are skipped
            continue
        their_warnings = len([w for w in caught if issubclass(w.category, UserWarning)])
        ours, messages = _plan(model, **dict(kwargs))
        assert dict(ours) == dict(theirs), (seed, kwargs)
        assert len(messages) == their_warnings, (seed, kwargs)
        compared += 1
    assert compared >= 120


@pytest.mark.parametrize("tie", [True, False])  # tied: the walk takes the head back out
@pytest.mark.parametrize("no_split", [["DecoderLayer"], None, ["Expert"]])
@pytest.mark.parametrize("share", [0.1, 0.3, 0.45])
def test_same_map_as_accelerate_on_moe_models(no_split, share, tie):
    accelerate_utils = pytest.importorskip(
        "accelerate.utils", reason="accelerate is not installed (pip install -e '.[bench]')"
    )
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    with init_empty_weights():
        model = MoeModel(6, 8, tie=tie)
    total = compute_module_sizes(model)[""]
    memory = {0: int(share * total), 1: int(share * total), 2: int(share * total), "cpu": total}
    kwargs = {"max_memory": memory, "no_split_module_classes": no_split}
    theirs = accelerate_utils.infer_auto_device_map(model, **kwargs)
    assert infer_auto_device_map(model, **kwargs) == dict(theirs)
