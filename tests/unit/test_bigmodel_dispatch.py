"""dispatch_model, cpu_offload, cpu_offload_with_hook and disk_offload on real CPU models."""

import os

import pytest
import torch
from _bigmodel_nets import reference
from torch import nn

from nbaccel.bigmodel import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    has_offloaded_params,
    remove_hook_from_module,
)


def test_cpu_offload_matches_and_keeps_weights_out():
    model, ids, out = reference()
    cpu_offload(model, "cpu")
    assert model.blocks[2].fc1.weight.device.type == "meta"
    assert has_offloaded_params(model.blocks[2].fc1)
    for _ in range(3):
        assert torch.allclose(model(ids), out, atol=1e-6)
    assert model.blocks[2].fc1.weight.device.type == "meta"
    assert model._nbaccel_prefetcher.hits > 0


def test_cpu_offload_without_prefetch_gives_the_same_result():
    model, ids, out = reference()
    cpu_offload(model, "cpu", prefetch=False)
    assert torch.allclose(model(ids), out, atol=1e-6)
    assert model._nbaccel_prefetcher.hits == 0


def test_disk_offload_writes_once_and_matches(tmp_path):
    model, ids, out = reference()
    folder = tmp_path / "off"
    disk_offload(model, folder, execution_device="cpu")
    files = sorted(os.listdir(folder))
    assert files == ["index.json", "offload.safetensors"]
    mtime = os.path.getmtime(folder / "offload.safetensors")
    assert torch.allclose(model(ids), out, atol=1e-6)
    assert torch.allclose(model(ids), out, atol=1e-6)
    # A second model pointed at the same folder reuses it instead of rewriting.
    again, _, _ = reference()
    disk_offload(again, folder)
    assert os.path.getmtime(folder / "offload.safetensors") == mtime
    assert torch.allclose(again(ids), out, atol=1e-6)


def test_disk_offload_non_persistent_buffers_survive(tmp_path):
    model, ids, out = reference()
    disk_offload(model, tmp_path / "off")
    assert torch.equal(model.blocks[0].gate, torch.arange(16.0) / 16)


def test_dispatch_in_memory_model_with_disk_entries_writes_them(tmp_path):
    model, ids, out = reference()
    device_map = {"embed": "cpu", "blocks": "disk", "norm": "cpu", "head": "cpu"}
    with pytest.raises(ValueError, match="offload_dir"):
        dispatch_model(reference()[0], device_map)
    dispatch_model(model, device_map, offload_dir=tmp_path / "off")
    assert model.hf_device_map == device_map
    assert model.blocks[0].fc1.weight.device.type == "meta"
    assert model.embed.weight is model.head.weight
    assert torch.allclose(model(ids), out, atol=1e-6)


def test_dispatch_single_device_is_a_plain_move_keeping_ties():
    model, ids, out = reference()
    dispatch_model(model, {"": "cpu"})
    assert not hasattr(model, "_hf_hook")
    assert model.embed.weight is model.head.weight
    assert torch.equal(model(ids), out)
    model, ids, out = reference()
    dispatch_model(model, {"": "cpu"}, force_hooks=True)
    assert model._hf_hook.io_same_device and torch.equal(model(ids), out)


def test_cpu_offload_with_external_state_dict():
    model, ids, out = reference()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cpu_offload(model, "cpu", state_dict=state)
    assert torch.allclose(model(ids), out, atol=1e-6)


def test_dispatch_rejects_gpu_ids_without_cuda_and_bad_maps():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    model, _, _ = reference()
    with pytest.raises(ValueError, match="CUDA is not available"):
        dispatch_model(model, {"": 0})
    with pytest.raises(ValueError, match="does not place"):
        dispatch_model(model, {"embed": "cpu"})


def test_remove_hooks_after_offload_restores_a_plain_model():
    model, ids, out = reference()
    cpu_offload(model, "cpu")
    remove_hook_from_module(model, recurse=True)
    assert model.blocks[0].fc1.weight.device.type == "cpu"
    assert not any(hasattr(m, "_hf_hook") for m in model.modules())
    assert torch.allclose(model(ids), out, atol=1e-6)


def test_cpu_offload_with_hook_chain():
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(2, 4)
    expected = second(first(x))
    first, hook1 = cpu_offload_with_hook(first, "cpu")
    second, hook2 = cpu_offload_with_hook(second, "cpu", prev_module_hook=hook1)
    hidden = first(x)
    assert hook1.hook.on_execution_device
    assert torch.allclose(second(hidden), expected)
    assert not hook1.hook.on_execution_device  # offloaded by the next model's forward
    assert hook2.hook.on_execution_device
    hook2.offload()
    assert not hook2.hook.on_execution_device
    hook2.remove()
    assert not hasattr(second, "_hf_hook")


@pytest.mark.gpu
def test_gpu_cpu_offload_prefetch_matches():
    model, ids, out = reference()
    cpu_offload(model, 0)
    got = model(ids)
    assert got.device.type == "cpu" and torch.allclose(got, out, atol=1e-5)
    assert torch.allclose(model(ids), out, atol=1e-5)


@pytest.mark.gpu
def test_gpu_cpu_disk_map(tmp_path):
    from _bigmodel_nets import TiedNet
    from safetensors.torch import save_model

    from nbaccel.bigmodel import init_empty_weights, load_checkpoint_and_dispatch

    model, ids, out = reference()
    save_model(model, str(tmp_path / "m.safetensors"))
    with init_empty_weights():
        empty = TiedNet()
    device_map = {
        "embed": 0,
        "blocks.0": 0,
        "blocks.1": "cpu",
        "blocks.2": "disk",
        "blocks.3": "disk",
        "norm": 0,
        "head": 0,
    }
    empty = load_checkpoint_and_dispatch(empty, str(tmp_path / "m.safetensors"), device_map)
    assert empty.embed.weight.device.type == "cuda"
    assert torch.allclose(empty(ids).cpu(), out, atol=1e-5)
    assert torch.allclose(empty(ids).cpu(), out, atol=1e-5)
