"""Hook semantics (nbaccel.bigmodel.hooks.model_hook) on real CPU modules."""

import pytest
import torch
from _bigmodel_nets import Block, reference
from torch import nn

from nbaccel.bigmodel import (
    AlignDevicesHook,
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    align_module_device,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    has_offloaded_params,
    remove_hook_from_module,
    remove_hook_from_submodules,
)


class AddHook(ModelHook):
    """Adds ``value`` to the input and doubles the output, recording the calls."""

    def __init__(self, value: float):
        self.value = value
        self.calls: list[str] = []

    def init_hook(self, module):
        self.calls.append("init")
        return module

    def pre_forward(self, module, x):
        self.calls.append("pre")
        return (x + self.value,), {}

    def post_forward(self, module, output):
        self.calls.append("post")
        return output * 2

    def detach_hook(self, module):
        self.calls.append("detach")
        return module


def identity_linear() -> nn.Linear:
    lin = nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(3))
    return lin


def test_hook_wraps_forward_and_remove_restores_it():
    lin = identity_linear()
    hook = AddHook(1.0)
    add_hook_to_module(lin, hook)
    x = torch.zeros(1, 3)
    assert torch.equal(lin(x), torch.full((1, 3), 2.0))
    assert hook.calls == ["init", "pre", "post"]
    assert lin._hf_hook is hook and "forward" in lin.__dict__
    remove_hook_from_module(lin)
    assert hook.calls[-1] == "detach"
    assert "forward" not in lin.__dict__ and not hasattr(lin, "_hf_hook")
    assert not hasattr(lin, "_old_forward")
    assert torch.equal(lin(x), x)


def test_add_hook_replaces_unless_append():
    lin = identity_linear()
    x = torch.zeros(1, 3)
    add_hook_to_module(lin, AddHook(1.0))
    add_hook_to_module(lin, AddHook(10.0))  # replaces
    assert torch.equal(lin(x), torch.full((1, 3), 20.0))
    add_hook_to_module(lin, AddHook(1.0), append=True)  # (x + 10) * 2 -> +1 -> *2 ... pre chain
    assert isinstance(lin._hf_hook, SequentialHook)
    # pre: x+10 then +1; post: *2 then *2
    assert torch.equal(lin(x), torch.full((1, 3), 44.0))
    remove_hook_from_module(lin)
    assert torch.equal(lin(x), x)


def test_no_grad_hook():
    lin = identity_linear()

    class NoGrad(ModelHook):
        no_grad = True

    add_hook_to_module(lin, NoGrad())
    assert not lin(torch.ones(1, 3)).requires_grad


def test_remove_recurse_and_submodules():
    block = Block(4)
    for module in (block, block.fc1, block.fc2):
        add_hook_to_module(module, AddHook(0.0))
    remove_hook_from_submodules(block)
    assert hasattr(block, "_hf_hook") and not hasattr(block.fc1, "_hf_hook")
    add_hook_to_module(block.fc1, AddHook(0.0))
    remove_hook_from_module(block, recurse=True)
    assert not any(hasattr(m, "_hf_hook") for m in block.modules())


def test_align_devices_hook_io_same_device_records_the_input_device():
    lin = identity_linear()
    hook = AlignDevicesHook(execution_device="cpu", io_same_device=True)
    add_hook_to_module(lin, hook)
    out = lin(torch.ones(1, 3))
    assert hook.input_device == torch.device("cpu") and out.device.type == "cpu"


def test_align_devices_hook_offload_keeps_weights_out_of_the_module():
    block = Block(4)
    x = torch.randn(2, 4)
    expected = block(x)
    hook = AlignDevicesHook(execution_device="cpu", offload=True, place_submodules=True)
    add_hook_to_module(block, hook)
    assert block.fc1.weight.device.type == "meta"
    assert block.scale.device.type == "cpu"  # buffers are not offloaded by default
    assert has_offloaded_params(block)
    assert torch.allclose(block(x), expected)
    assert block.fc1.weight.device.type == "meta"  # offloaded again after the forward
    remove_hook_from_module(block)
    assert block.fc1.weight.device.type == "cpu"  # weights back on detach
    assert torch.allclose(block(x), expected)
    assert not has_offloaded_params(block)


def test_offload_buffers_too():
    block = Block(4)
    x = torch.randn(2, 4)
    expected = block(x)
    add_hook_to_module(
        block, AlignDevicesHook("cpu", offload=True, offload_buffers=True, place_submodules=True)
    )
    assert block.scale.device.type == "meta"
    assert torch.allclose(block(x), expected)


def test_attach_align_device_hook_per_leaf_and_preload():
    model, ids, out = reference()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    attach_align_device_hook(model, "cpu", offload=True, weights_map=state)
    assert isinstance(model.blocks[0].fc1._hf_hook, AlignDevicesHook)
    assert not hasattr(model.blocks, "_hf_hook")  # no tensors of its own
    assert hasattr(model.blocks[0], "_hf_hook")  # owns buffers
    assert torch.allclose(model(ids), out)
    remove_hook_from_module(model, recurse=True)

    model, ids, out = reference()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    attach_align_device_hook(
        model, "cpu", offload=True, weights_map=state, preload_module_classes=["Block"]
    )
    assert model.blocks[0]._hf_hook.place_submodules
    assert not hasattr(model.blocks[0].fc1, "_hf_hook")
    assert torch.allclose(model(ids), out)


def test_attach_on_blocks_offloads_only_mapped_blocks():
    model, ids, out = reference()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    execution = {"embed": "cpu", "blocks": "cpu", "norm": "cpu", "head": "cpu"}
    offload = {"embed": False, "blocks": True, "norm": False, "head": False}
    attach_align_device_hook_on_blocks(model, execution, offload, weights_map=state)
    assert model.embed.weight.device.type == "cpu"
    assert model.blocks[1].fc2.weight.device.type == "meta"
    assert has_offloaded_params(model.blocks[1].fc2) and not has_offloaded_params(model.norm)
    assert torch.allclose(model(ids), out)


def test_align_module_device_materialises_offloaded_weights():
    block = Block(4)
    weight = block.fc1.weight.detach().clone()
    add_hook_to_module(block.fc1, AlignDevicesHook("cpu", offload=True))
    assert block.fc1.weight.device.type == "meta"
    with align_module_device(block.fc1):
        assert torch.equal(block.fc1.weight, weight)
    assert block.fc1.weight.device.type == "meta"
    with align_module_device(block.ln, "cpu"):  # plain module: moved and restored
        assert block.ln.weight.device.type == "cpu"


def test_offloaded_meta_tensor_without_weights_is_named():
    with torch.device("meta"):
        lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"\['bias'\]"):
        add_hook_to_module(
            lin, AlignDevicesHook("cpu", offload=True, weights_map={"weight": torch.zeros(2, 2)})
        )


def test_gpu_device_string_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        AlignDevicesHook(execution_device=0)


@pytest.mark.gpu
def test_io_same_device_moves_outputs_back_from_gpu():
    lin = identity_linear()
    add_hook_to_module(
        lin, AlignDevicesHook(execution_device=0, io_same_device=True, place_submodules=True)
    )
    assert lin.weight.device.type == "cuda"
    out = lin(torch.ones(1, 3))
    assert out.device.type == "cpu"
