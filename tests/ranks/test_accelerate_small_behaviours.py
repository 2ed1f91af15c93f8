"""Small behaviours code written for Accelerate relies on: ``end_training`` destroys the process
group, profiler traces are ``profile_<rank>.json``, TensorBoard runs keep
``<timestamp>/hparams.yml``, and two error messages tests match word for word."""

from __future__ import annotations

import pytest
import torch

from nbaccel.testing import run_on_ranks


def _profile_then_end(trace_dir: str) -> bool:
    import torch.distributed as dist

    from nbaccel import Accelerator
    from nbaccel.utils import ProfileKwargs

    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    with accelerator.profile(ProfileKwargs(output_trace_dir=trace_dir)):
        model(torch.ones(1, 2))
    accelerator.end_training()
    return dist.is_initialized()


def test_end_training_destroys_the_group_and_traces_are_named_as_accelerates(tmp_path):
    assert run_on_ranks(_profile_then_end, args=(str(tmp_path),)) == [False, False]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile_0.json", "profile_1.json"]


def test_tensorboard_keeps_the_hyperparameters_in_a_yaml_file(tmp_path):
    pytest.importorskip("tensorboard", reason="the TensorBoard tracker needs tensorboard")
    import yaml

    from nbaccel import Accelerator

    accelerator = Accelerator(log_with="tensorboard", project_dir=tmp_path)
    accelerator.init_trackers("run", config={"lr": 0.1, "epochs": 3})
    accelerator.end_training()
    (found,) = (tmp_path / "run").glob("*/hparams.yml")
    float(found.parent.name)  # a time.time() stamp, as Accelerate names the folder
    assert yaml.safe_load(found.read_text()) == {"lr": 0.1, "epochs": 3}


def test_set_module_tensor_to_device_shape_mismatch_says_what_accelerate_says():
    from nbaccel.utils import set_module_tensor_to_device

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with pytest.raises(ValueError) as caught:
        set_module_tensor_to_device(model, "0.weight", "cpu", value=torch.ones(5, 5))
    assert str(caught.value) == (
        'Trying to set a tensor of shape torch.Size([5, 5]) in "weight" (which has shape '
        "torch.Size([2, 3])), this looks incorrect."
    )
    with torch.device("meta"):
        empty = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"\(which has shape torch.Size\(\[2, 3\]\)\)"):
        set_module_tensor_to_device(empty, "weight", "cpu", value=torch.ones(5, 5))


def test_recursively_apply_names_the_unsupported_type_as_accelerate_does():
    from nbaccel.utils import recursively_apply

    with pytest.raises(TypeError) as caught:
        recursively_apply(torch.neg, (torch.tensor(1), 1), error_on_other_type=True)
    assert str(caught.value) == (
        "Unsupported types (<class 'int'>) passed to `neg`. Only nested list/tuple/dicts of "
        "objects that are valid for `is_torch_tensor` should be passed."
    )


def test_unwrap_model_removes_a_users_data_parallel_under_torch_compile():
    from nbaccel import Accelerator

    model = torch.nn.Linear(2, 4)
    compiled = torch.compile(torch.nn.DataParallel(model))  # compiles lazily: nothing runs
    accelerator = Accelerator()
    assert accelerator.unwrap_model(compiled, keep_torch_compile=False) is model
    kept = accelerator.unwrap_model(torch.compile(torch.nn.DataParallel(model)))
    assert kept._orig_mod is model
