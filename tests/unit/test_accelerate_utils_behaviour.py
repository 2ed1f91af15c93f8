"""``nbaccel.utils`` / big-model / tracker behaviour as Accelerate documents it: nested tensors
are not padded, tensor-parallel degree lookup, undoing an Accelerate-style forward wrapper,
logged shared-tensor removal, float8 offload round-trip, offload folders next to checkpoints,
tracker registration rules."""

import logging
import pickle
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from nbaccel.utils import (
    CannotPadNestedTensorWarning,
    convert_outputs_to_fp32,
    extract_model_from_parallel,
    get_model_tp_size,
    load_offloaded_weight,
    offload_weight,
    pad_across_processes,
    save,
)


def test_nested_tensor_is_returned_unpadded_with_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "prototype stage" notice
        nested = torch.nested.nested_tensor([[1, 2, 3], [1]])
    with pytest.warns(CannotPadNestedTensorWarning):
        assert pad_across_processes(nested) is nested
    plain = torch.ones(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pad_across_processes(plain) is plain


def test_model_tp_size_from_transformers_records():
    model = nn.Linear(2, 2)
    assert get_model_tp_size(model) is None
    model.tp_size = 2  # transformers < 5
    assert get_model_tp_size(model) == 2
    model.tp_size = None  # transformers >= 5: on the config, an object or a dict
    model.config = SimpleNamespace(distributed_config=SimpleNamespace(tp_size=4))
    assert get_model_tp_size(model) == 4
    model.config = SimpleNamespace(distributed_config={"tp_size": 8})
    assert get_model_tp_size(model) == 8


def test_accelerate_style_forward_wrapper_is_undone_and_model_pickles():
    model = nn.Linear(2, 2)
    model._original_forward = model.forward
    model.forward = convert_outputs_to_fp32(model.forward)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(model)  # the wrapped forward is a local function
    model = extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert "forward" not in model.__dict__ and "_original_forward" not in model.__dict__
    assert pickle.loads(pickle.dumps(model)).weight.shape == (2, 2)


def test_shared_tensors_removed_by_safetensors_save_are_logged(tmp_path, caplog):
    layer = nn.Linear(4, 4)
    state = {"a.weight": layer.weight, "b.weight": layer.weight}
    with caplog.at_level(logging.WARNING):
        save(state, tmp_path / "m.safetensors", safe_serialization=True)
    records = [r for r in caplog.records if "Removed shared tensor" in r.getMessage()]
    assert len(records) == 1 and "b.weight" in records[0].getMessage()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_offload_weight_round_trips_dtypes_numpy_lacks(tmp_path, dtype):
    weight = torch.randn(2, 3).to(dtype)
    index = offload_weight(weight, "w", tmp_path, {})
    assert index == {"w": {"shape": [2, 3], "dtype": str(dtype).split(".")[1]}}
    back = load_offloaded_weight(tmp_path / "w.dat", index["w"])
    assert back.dtype == dtype
    words = torch.int8 if weight.element_size() == 1 else torch.int16
    assert torch.equal(back.view(words), weight.view(words))  # bit for bit


def test_save_model_of_a_model_offloaded_into_its_checkpoint_folder(tmp_path):
    # Accelerate's check: offload_folder == the checkpoint folder, saved again, reloaded.
    from nbaccel import Accelerator, load_checkpoint_and_dispatch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 5)).eval()
    inputs = torch.randn(3, 3)
    expected = model(inputs)
    accelerator = Accelerator()
    accelerator.save_model(model, tmp_path)
    device_map = {"0": "cpu", "1": "disk", "2": "cpu"}
    load_checkpoint_and_dispatch(model, tmp_path, device_map=device_map, offload_folder=tmp_path)
    assert (tmp_path / "index.json").exists()  # the offload index sits beside the weights
    accelerator.save_model(model, tmp_path)
    load_checkpoint_and_dispatch(model, tmp_path)  # index.json is not taken for a weight map
    assert torch.allclose(model(inputs), expected, atol=1e-6)


def test_register_tracker_class_rules():
    from nbaccel.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, register_tracker_class

    class Nameless(GeneralTracker):
        requires_logging_directory = False

    class NoFlag(GeneralTracker):
        name = "compat_no_flag"

    class First(GeneralTracker):
        name = "compat_shadowed"
        requires_logging_directory = False

    class Second(GeneralTracker):
        name = "compat_shadowed"
        requires_logging_directory = False

    for bad in (dict, Nameless, NoFlag):
        with pytest.raises(ValueError):
            register_tracker_class(bad)
    try:
        register_tracker_class(First)
        with pytest.warns(UserWarning, match="compat_shadowed"):
            register_tracker_class(Second)
        assert LOGGER_TYPE_TO_CLASS["compat_shadowed"] is Second
    finally:
        LOGGER_TYPE_TO_CLASS.pop("compat_shadowed", None)
