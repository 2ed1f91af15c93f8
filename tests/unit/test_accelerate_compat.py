"""Code written for Hugging Face Accelerate runs with ``accelerate`` replaced by ``nbaccel``.

The user functions below follow the examples of Accelerate's documentation (quick tour,
logging, big-model inference, tracking, utilities reference) with the import lines exactly as
users write them and the word swapped literally. They run for real: 2 gloo ranks through
``nbaccel.testing.run_on_ranks``, real files for offload and checkpoints.

The first half checks the façade itself: every path of the alias table imports, every name it
lists resolves to the object of nbaccel's own tree, and the table holds no implementation.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import os
import pickle
from pathlib import Path
from unittest import mock

import pytest
import torch

import nbaccel
from nbaccel.compat.aliases import ALIASES

FACADE_PATHS = sorted(k for k in ALIASES if k != "nbaccel")


# -- the façade ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path", FACADE_PATHS)
def test_every_alias_path_imports_and_every_name_resolves(path):
    module = importlib.import_module(path)
    assert module.__all__, f"{path} exposes no names"
    for name in module.__all__:
        obj = getattr(module, name)
        owner = getattr(obj, "__module__", None)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            # The object lives in nbaccel's own tree (or is a std/torch object), never in a façade.
            assert owner not in ALIASES, f"{path}.{name} is defined in the façade {owner}"
    for source in module.__nbaccel_sources__:
        assert source not in ALIASES and importlib.import_module(source)


def test_top_level_extra_names_resolve():
    for source in ALIASES["nbaccel"]:
        for item in source.partition(":")[2].split(","):
            assert getattr(nbaccel, item.partition("=")[0])
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        nbaccel.not_a_name  # noqa: B018


def test_facade_objects_are_nbaccels_own():
    from nbaccel.big_modeling import dispatch_model
    from nbaccel.bigmodel.dispatch import dispatch_model as real_dispatch
    from nbaccel.distributed.collectives import gather as real_gather
    from nbaccel.utils.operations import gather

    assert gather is real_gather and dispatch_model is real_dispatch
    import nbaccel.utils.dataclasses as dataclasses_path
    from nbaccel.utils import DistributedType

    assert dataclasses_path.DistributedType is DistributedType is nbaccel.DistributedType
    # Pickles name the real module, so they load without the façade.
    from nbaccel.utils import ProjectConfiguration

    blob = pickle.dumps(ProjectConfiguration(project_dir="x"))
    assert b"nbaccel.training.config.configuration" in blob and b"nbaccel.utils" not in blob


def test_alias_table_is_data_only():
    import nbaccel.compat.aliases as aliases

    tree = ast.parse(Path(aliases.__file__).read_text())
    defined = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)]
    assert defined == []


def test_mock_patch_on_a_facade_path():
    import nbaccel.utils.other

    with mock.patch("nbaccel.utils.other.is_port_in_use", return_value=True) as patched:
        assert nbaccel.utils.other.is_port_in_use(1) is True
    assert patched.called
    assert nbaccel.utils.other.is_port_in_use is not patched


def test_logging_path_does_not_shadow_the_standard_library():
    import nbaccel.distributed.logging as implementation
    import nbaccel.logging as nb_logging

    assert nb_logging is not logging and implementation.logging is logging
    assert Path(logging.__file__).parent.name != "nbaccel"
    assert nb_logging.get_logger is implementation.get_logger


# -- names of the stacks nbaccel does not drive -------------------------------------------------
def test_unsupported_stacks_import_check_and_refuse():
    from nbaccel import DeepSpeedPlugin
    from nbaccel.utils import (
        FP8RecipeKwargs,
        GPTTrainStep,
        is_deepspeed_available,
        load_and_quantize_model,
    )
    from nbaccel.utils.deepspeed import DummyOptim

    model = torch.nn.Linear(2, 2)
    plugin = None
    # Typical user code: branch on availability, type-check the optimizer.
    if is_deepspeed_available():
        plugin = DeepSpeedPlugin(zero_stage=2)
    assert plugin.zero_stage == 2 and not isinstance(
        torch.optim.SGD(model.parameters()), DummyOptim
    )
    with pytest.raises(ImportError, match="Transformer Engine.*AORecipeKwargs"):
        FP8RecipeKwargs(backend="te")  # FP8 with TE needs TE installed; torchao's runs here
    with pytest.raises(NotImplementedError, match="megatron_lm_plugin=MegatronLMPlugin"):
        GPTTrainStep()  # Megatron-LM's own train step: refused, naming the supported path
    with pytest.raises(TypeError, match="BnbQuantizationConfig"):
        load_and_quantize_model(model, None)


def test_distributed_type_lists_every_stack():
    from nbaccel import DistributedType

    accelerator_types = (
        DistributedType.MULTI_GPU,
        DistributedType.MULTI_NPU,
        DistributedType.MULTI_MLU,
        DistributedType.MULTI_SDAA,
        DistributedType.MULTI_MUSA,
        DistributedType.MULTI_HPU,
        DistributedType.MULTI_NEURON,
        DistributedType.MULTI_XPU,
    )
    assert nbaccel.PartialState(cpu=True).distributed_type not in accelerator_types
    assert DistributedType("MULTI_NPU") is DistributedType.MULTI_NPU


# -- utilities reference ------------------------------------------------------------------------
def test_environment_helpers():
    from nbaccel.utils import clear_environment, patch_environment, purge_nbaccel_environment

    os.environ.pop("NBACCEL_COMPAT_X", None)
    with patch_environment(nbaccel_compat_x=1, path="/nowhere"):
        assert os.environ["NBACCEL_COMPAT_X"] == "1" and os.environ["PATH"] == "/nowhere"
    assert "NBACCEL_COMPAT_X" not in os.environ and os.environ["PATH"] != "/nowhere"
    with clear_environment():
        assert dict(os.environ) == {}
        os.environ["SET_INSIDE"] = "1"
    assert "SET_INSIDE" not in os.environ and "PATH" in os.environ

    @purge_nbaccel_environment
    def sets_a_variable():
        os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"

    sets_a_variable()
    assert "ACCELERATE_MIXED_PRECISION" not in os.environ


def test_probes_and_versions():
    from nbaccel.utils import (
        compare_versions,
        is_bf16_available,
        is_cuda_available,
        is_tensorboard_available,
        is_torch_version,
        is_wandb_available,
    )

    assert is_torch_version(">=", "2.0") and not is_torch_version("<", "1.0")
    assert compare_versions("torch", ">=", "2.0")
    with pytest.raises(ValueError, match="operation"):
        compare_versions("torch", "~=", "2.0")
    assert is_cuda_available() == torch.cuda.is_available()
    assert is_bf16_available() is True  # CPUs compute in bf16
    assert isinstance(is_tensorboard_available(), bool) and isinstance(is_wandb_available(), bool)


def test_structure_helpers():
    from nbaccel.utils import listify, pad_input_tensors
    from nbaccel.utils.operations import honor_type, is_namedtuple

    batch = {"a": torch.tensor([1.5, 2.0], dtype=torch.bfloat16), "b": [torch.ones(2, 2)]}
    assert listify(batch) == {"a": [1.5, 2.0], "b": [[[1.0, 1.0], [1.0, 1.0]]]}
    assert pad_input_tensors(torch.ones(3, 4), 3, 2).shape == (4, 4)
    assert pad_input_tensors(torch.ones(4, 2), 4, 3).shape == (6, 2)
    assert pad_input_tensors(torch.ones(3, 2), 3, 4)[3].sum() == 0  # zero rows appended
    Point = __import__("collections").namedtuple("Point", "x y")
    assert is_namedtuple(Point(1, 2)) and not is_namedtuple((1, 2))
    assert honor_type(Point(1, 2), iter([3, 4])) == Point(3, 4)


def test_save_and_load_write_once_and_load_safely(tmp_path):
    import numpy as np

    from nbaccel.utils import load, save

    nbaccel.PartialState(cpu=True)
    state = {"weights": torch.arange(3.0), "rng": np.random.get_state()}
    save(state, tmp_path / "state.pt")
    back = load(tmp_path / "state.pt")
    assert torch.equal(back["weights"], state["weights"]) and back["rng"][0] == "MT19937"
    save({"w": torch.ones(2)}, tmp_path / "w.safetensors", safe_serialization=True)
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], torch.ones(2))


def test_write_basic_config(tmp_path):
    import json

    from nbaccel.utils import write_basic_config

    path = write_basic_config(mixed_precision="bf16", save_location=str(tmp_path / "c.yaml"))
    config = json.loads(Path(path).read_text())
    assert config["mixed_precision"] == "bf16" and config["num_processes"] >= 1
    assert write_basic_config(save_location=str(path)) is False  # never overwrites
    with pytest.raises(ValueError, match="fp16"):
        write_basic_config(mixed_precision="fp4", save_location=str(tmp_path / "d.yaml"))


def test_torch_dynamo_plugin_reads_the_environment():
    from nbaccel.utils import DynamoBackend, TorchDynamoPlugin, patch_environment

    with patch_environment(
        ACCELERATE_DYNAMO_BACKEND="inductor", ACCELERATE_DYNAMO_MODE="max-autotune"
    ):
        plugin = TorchDynamoPlugin()
    assert plugin.backend is DynamoBackend.INDUCTOR and plugin.mode == "max-autotune"
    assert plugin.to_dict()["backend"] == "inductor"


# -- big-model inference (docs: "Big Model Inference", "offload") ---------------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = torch.nn.Linear(4, 8)
        self.batchnorm = torch.nn.BatchNorm1d(8)
        self.linear2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.linear2(self.batchnorm(self.linear1(x)))


def test_offload_helpers_and_offloaded_state_dict(tmp_path):
    from nbaccel import cpu_offload, disk_offload, init_empty_weights
    from nbaccel.utils import (
        extract_submodules_state_dict,
        load_offloaded_weight,
        offload_weight,
    )
    from nbaccel.utils.modeling import (
        compute_module_total_buffer_size,
        get_state_dict_offloaded_model,
    )

    index = offload_weight(torch.arange(6.0).view(2, 3), "w", tmp_path, index={})
    assert index == {"w": {"dtype": "float32", "shape": [2, 3]}}
    assert torch.equal(
        load_offloaded_weight(tmp_path / "w.dat", index["w"]), torch.arange(6.0).view(2, 3)
    )

    model = _Net().eval()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    assert set(extract_submodules_state_dict(reference, ["linear1"])) == {
        "linear1.weight",
        "linear1.bias",
    }
    assert compute_module_total_buffer_size(model) == 8 * 4 * 2 + 8  # running stats + counter
    disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    saved = get_state_dict_offloaded_model(model)
    assert set(saved) == set(reference)
    assert all(torch.equal(saved[k], reference[k]) for k in reference)

    with init_empty_weights():
        empty = _Net()
    assert empty.linear1.weight.device.type == "meta"
    cpu_offload(_Net(), execution_device="cpu")


def test_layerwise_casting_keeps_storage_small():
    from nbaccel.big_modeling import attach_layerwise_casting_hooks
    from nbaccel.hooks import LayerwiseCastingHook
    from nbaccel.utils.constants import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING

    model = _Net().eval()
    attach_layerwise_casting_hooks(model, storage_dtype=torch.float16, compute_dtype=torch.float32)
    assert (
        model.linear1.weight.dtype == torch.float16
        and model.batchnorm.weight.dtype == torch.float32
    )
    assert isinstance(model.linear1._hf_hook, LayerwiseCastingHook)
    assert isinstance(model.linear2, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING)
    out = model(torch.randn(3, 4))
    assert out.dtype == torch.float32 and model.linear2.weight.dtype == torch.float16


def test_skip_data_loader():
    from nbaccel.data_loader import SkipDataLoader

    loader = SkipDataLoader(list(range(10)), skip_batches=2, batch_size=3)
    assert [b.tolist() for b in loader] == [[6, 7, 8], [9]] and len(loader) == 2


def test_get_logger_needs_the_state_first():
    from nbaccel.logging import get_logger

    with pytest.raises(RuntimeError, match="PartialState"):
        get_logger("compat.nostate").info("too early")


def test_test_utils_facade():
    from nbaccel.test_utils import RegressionDataset, RegressionModel, require_cpu, slow
    from nbaccel.test_utils.testing import AccelerateTestCase, get_launch_command

    data = RegressionDataset(length=8, seed=0)
    model = RegressionModel(a=2, b=3)
    item = data[0]
    assert abs(model(torch.tensor(item["x"])).item() - item["y"]) < 0.5
    assert get_launch_command(num_processes=2, cpu=True) == [
        "nbaccel",
        "launch",
        "--num_processes=2",
        "--cpu",
    ]
    assert issubclass(AccelerateTestCase, __import__("unittest").TestCase)
    assert callable(require_cpu(lambda: None)) and callable(slow(lambda: None))
