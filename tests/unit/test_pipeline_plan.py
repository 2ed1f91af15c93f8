"""Planning a pipeline without processes: generate_device_map cuts between whole decoder layers
with balanced stages, find_pippy_batch_size, and bad split points / too many stages refused
with the numbers and the fix."""

from __future__ import annotations

import pytest
import torch
from _llama import tiny_llama

from nbaccel.bigmodel.pipeline import (
    _check_split_points,
    find_pippy_batch_size,
    generate_device_map,
)


def test_device_map_cuts_at_decoder_layers_and_balances():
    model = tiny_llama(layers=4)
    device_map = generate_device_map(model, 2)
    stages = {name: rank for name, rank in device_map.items()}
    # every decoder layer sits whole on one stage; the cut is a layer start
    layers = [n for n in stages if n.startswith("model.layers.")]
    assert layers == [f"model.layers.{i}" for i in range(4)]
    first_on_1 = next(n for n, r in stages.items() if r == 1)
    assert first_on_1 in layers[1:]
    assert stages["model.embed_tokens"] == 0 and stages["lm_head"] == 1
    four = generate_device_map(model, 4)
    assert sorted(set(four.values())) == [0, 1, 2, 3]
    # without blocks named, a plain class list that the model lacks is refused
    with pytest.raises(ValueError, match="does not have: \\['GPT2Block'\\]"):
        generate_device_map(model, 2, no_split_module_classes=["GPT2Block"])


def test_too_many_stages_and_memory_caps_are_refused():
    model = tiny_llama(layers=2)
    with pytest.raises(ValueError, match="2 places to cut .* 4 pipeline stages need 3"):
        generate_device_map(model, 4)
    with pytest.raises(ValueError, match="Pipeline stage 0 needs .* max_memory\\[0\\] is 1000"):
        generate_device_map(model, 2, max_memory={0: 1000, 1: "1GB"})


def test_split_points_are_checked():
    model = tiny_llama(layers=2)
    with pytest.raises(ValueError, match="\\['model.layer.1'\\] are not modules of"):
        _check_split_points(model, ["model.layer.1"], 2)
    with pytest.raises(ValueError, match="2 split points make 3 stages, but the run has 2"):
        _check_split_points(model, ["model.layers.0", "model.layers.1"], 2)


def test_find_pippy_batch_size():
    assert find_pippy_batch_size((torch.zeros(5, 3),), None) == 5
    assert find_pippy_batch_size((), {"input_ids": torch.zeros(7, 2)}) == 7
    assert find_pippy_batch_size((3,), {}) is None
