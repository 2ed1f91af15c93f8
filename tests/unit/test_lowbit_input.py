"""Bad low-bit input is refused before anything is loaded, naming the fix: 8-bit and 4-bit at
once, an unknown quant type, bitsandbytes missing, 4-bit weights sent to disk, disk without a
folder, torchao int4 without mslk, FP8 where there is no FP8 matmul. (bitsandbytes too old and
the lazy imports are checked in child interpreters: tests/ranks/test_lowbit_imports.py.)"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from nbaccel.bigmodel import init_empty_weights
from nbaccel.bigmodel.quantization import (
    BnbQuantizationConfig,
    TorchAoConfig,
    load_and_quantize_model,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
        self.head = nn.Linear(128, 8)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.fixture()
def checkpoint(tmp_path) -> str:
    from safetensors.torch import save_file

    save_file(Net().state_dict(), str(tmp_path / "model.safetensors"))
    return str(tmp_path / "model.safetensors")


def empty() -> Net:
    with init_empty_weights():
        return Net()


def test_config_refuses_contradictions_and_unknown_types() -> None:
    with pytest.raises(ValueError, match="both True: choose one"):
        BnbQuantizationConfig(load_in_8bit=True, load_in_4bit=True)
    with pytest.raises(ValueError, match="Neither load_in_8bit nor load_in_4bit"):
        BnbQuantizationConfig()
    with pytest.raises(ValueError, match="Unknown bnb_4bit_quant_type 'int3'.*'nf4'"):
        BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_quant_type="int3")
    with pytest.raises(ValueError, match="bnb_4bit_compute_dtype.*'bf16'"):
        BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_compute_dtype="fp64")
    with pytest.raises(ValueError, match="Unknown torchao quant_type 'int2'"):
        TorchAoConfig("int2")
    config = BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_compute_dtype="bf16")
    assert config.torch_dtype == torch.bfloat16 and config.target_dtype == "int4"
    assert BnbQuantizationConfig(load_in_8bit=True).torch_dtype == torch.float16


def test_4bit_to_disk_is_refused_before_any_file_is_written(checkpoint, tmp_path) -> None:
    folder = tmp_path / "offload"
    config = BnbQuantizationConfig(load_in_4bit=True)
    model = empty()
    with pytest.raises(ValueError, match="4-bit weights cannot be offloaded.*load_in_8bit=True"):
        load_and_quantize_model(
            model, config, checkpoint, device_map={"body": "disk", "head": "cpu"},
            offload_folder=folder,
        )  # fmt: skip
    assert not folder.exists()
    assert model.body[0].weight.device.type == "meta"  # nothing was loaded


def test_disk_without_offload_folder_and_missing_checkpoint(checkpoint, tmp_path) -> None:
    config = BnbQuantizationConfig(load_in_8bit=True)
    with pytest.raises(ValueError, match="no offload_folder was given: pass offload_folder"):
        load_and_quantize_model(empty(), config, checkpoint, device_map={"": "disk"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_and_quantize_model(empty(), config, str(tmp_path / "nowhere"), device_map="cpu")
    with pytest.raises(ValueError, match="pass weights_location="):
        load_and_quantize_model(empty(), config, device_map="cpu")


def test_bitsandbytes_missing_names_the_extra(checkpoint, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # Python's way to make it unimportable
    model = empty()
    with pytest.raises(ImportError, match=r"bitsandbytes >= 0\.46\.0.*nbaccel\[bnb\]"):
        load_and_quantize_model(model, BnbQuantizationConfig(load_in_8bit=True), checkpoint)
    assert model.body[0].weight.device.type == "meta"


def test_torchao_int4_on_cpu_names_mslk(checkpoint) -> None:
    pytest.importorskip("torchao")
    import importlib.util

    if importlib.util.find_spec("mslk") is not None:
        pytest.skip("mslk is installed here: int4 runs")
    with pytest.raises(ImportError, match="mslk package >= 1.0.0.*int8_weight_only"):
        load_and_quantize_model(empty(), TorchAoConfig("int4"), checkpoint, device_map="cpu")


def test_fp8_hardware_check() -> None:
    from nbaccel.distributed.host_info import fp8_hardware_problem

    assert fp8_hardware_problem("cpu") is None  # torch >= 2.13 has an FP8 matmul on the CPU
    assert fp8_hardware_problem("xla", emulate=True) is None
    assert "AORecipeKwargs(emulate=True)" in fp8_hardware_problem("xla")
