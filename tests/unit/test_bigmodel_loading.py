"""Loading checkpoints into empty models and dispatching them (real files in tmp_path)."""

import logging
import os

import pytest
import torch
from _bigmodel_nets import TiedNet, reference, save_sharded, unique_state
from safetensors.torch import save_file, save_model

from nbaccel.bigmodel import (
    CheckpointMismatchError,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
)

MIXED = {
    "embed": "cpu",
    "blocks.0": "disk",
    "blocks.1": "cpu",
    "blocks.2": "disk",
    "blocks.3": "disk",
    "norm": "cpu",
    "head": "cpu",
}


def empty(**kwargs) -> TiedNet:
    with init_empty_weights():
        return TiedNet(**kwargs)


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, ref):
    model = ref[0]
    root = tmp_path_factory.mktemp("ckpt")
    save_model(model, str(root / "model.safetensors"))  # drops the tied duplicate
    torch.save(model.state_dict(), root / "model.bin")  # keeps both tied names
    return {
        "safetensors": str(root / "model.safetensors"),
        "bin": str(root / "model.bin"),
        "sharded_safetensors": save_sharded(model, root / "sharded_st"),
        "sharded_bin": save_sharded(model, root / "sharded_bin", fmt="bin"),
    }


@pytest.mark.parametrize("kind", ["safetensors", "bin", "sharded_safetensors", "sharded_bin"])
def test_load_every_format_keeps_the_tie(kind, checkpoints, ref):
    _, ids, out = ref
    model = empty()
    load_checkpoint_in_model(model, checkpoints[kind], strict=True)
    assert model.head.weight is model.embed.weight
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert torch.equal(model(ids), out)


@pytest.mark.parametrize("kind", ["safetensors", "sharded_bin"])
@pytest.mark.parametrize(
    "device_map", ["auto", "balanced", "balanced_low_0", "sequential", "cpu", "disk"]
)
def test_load_and_dispatch_every_map_string(kind, device_map, checkpoints, ref, tmp_path):
    _, ids, out = ref
    model = load_checkpoint_and_dispatch(
        empty(), checkpoints[kind], device_map=device_map, offload_folder=tmp_path / "off"
    )
    assert isinstance(model.hf_device_map, dict)
    if device_map != "disk":
        assert model.head.weight is model.embed.weight
    assert torch.allclose(model(ids), out, atol=1e-6)


@pytest.mark.parametrize("kind", ["safetensors", "bin", "sharded_safetensors"])
def test_mixed_cpu_disk_map_matches_in_memory(kind, checkpoints, ref, tmp_path):
    _, ids, out = ref
    folder = tmp_path / "off"
    model = load_checkpoint_and_dispatch(
        empty(), checkpoints[kind], device_map=MIXED, offload_folder=folder
    )
    assert model.blocks[0].fc1.weight.device.type == "meta"
    assert model.blocks[1].fc1.weight.device.type == "cpu"
    assert model.hf_device_map == MIXED
    for _ in range(2):
        assert torch.allclose(model(ids), out, atol=1e-6)
    written = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))
    if "safetensors" in kind:
        assert written == []  # read in place from the checkpoint
    else:
        assert written == ["model.safetensors"]  # .bin written once, as safetensors
    # Prefetching ran: the second forward found the next layer's weights ready.
    assert model._nbaccel_prefetcher.hits > 0


def test_whole_model_on_disk_without_offload_folder(checkpoints, ref):
    _, ids, out = ref
    model = load_checkpoint_and_dispatch(
        empty(), checkpoints["safetensors"], device_map={"": "disk"}
    )
    assert all(p.device.type == "meta" for p in model.parameters())
    assert torch.equal(model.blocks[0].gate, torch.arange(16.0) / 16)  # buffers kept
    assert torch.allclose(model(ids), out, atol=1e-6)


def test_disk_from_bin_needs_a_folder(checkpoints):
    with pytest.raises(ValueError, match="offload_folder"):
        load_checkpoint_in_model(empty(), checkpoints["bin"], device_map={"": "disk"})


def test_auto_with_small_cpu_budget_spills_to_disk(checkpoints, ref):
    _, ids, out = ref
    model = load_checkpoint_and_dispatch(
        empty(),
        checkpoints["safetensors"],
        device_map="auto",
        # Accelerate's plan keeps the largest block (4.5 kB) free on the CPU.
        max_memory={"cpu": 12000},
        no_split_module_classes=["Block"],
    )
    assert "disk" in model.hf_device_map.values() and "cpu" in model.hf_device_map.values()
    assert torch.allclose(model(ids), out, atol=1e-6)


def test_strict_lists_missing_and_unexpected(tmp_path, ref):
    state = unique_state(ref[0])
    state.pop("blocks.1.fc1.bias")
    state.pop("norm.weight")
    state["extra.weight"] = torch.zeros(2)
    path = str(tmp_path / "bad.safetensors")
    save_file(state, path)
    with pytest.raises(CheckpointMismatchError) as err:
        load_checkpoint_in_model(empty(), path, strict=True)
    text = str(err.value)
    assert "missing keys" in text and "blocks.1.fc1.bias" in text and "norm.weight" in text
    assert "unexpected keys" in text and "extra.weight" in text
    assert "head.weight" not in text  # tied to embed.weight, which is present


def test_non_strict_warns_and_dispatch_names_the_meta_tensors(tmp_path, ref, caplog):
    state = unique_state(ref[0])
    state.pop("norm.weight")
    path = str(tmp_path / "partial.safetensors")
    save_file(state, path)
    model = empty()
    with caplog.at_level(logging.WARNING):
        load_checkpoint_in_model(model, path)
    assert "norm.weight" in caplog.text
    with pytest.raises(CheckpointMismatchError, match="missing keys .*: norm.weight; "):
        load_checkpoint_and_dispatch(empty(), path, device_map={"": "cpu"})


def test_shape_mismatch_error_lists_keys(tmp_path, ref):
    state = unique_state(ref[0])
    state["norm.weight"] = torch.zeros(3)
    state["surplus"] = torch.zeros(1)
    path = str(tmp_path / "shape.safetensors")
    save_file(state, path)
    with pytest.raises(CheckpointMismatchError) as err:
        load_checkpoint_in_model(empty(), path)
    text = str(err.value)
    assert "'norm.weight' has shape [3]" in text and "surplus" in text


def test_dtype_and_keep_in_fp32(checkpoints, ref):
    _, ids, out = ref
    model = empty()
    load_checkpoint_in_model(
        model, checkpoints["safetensors"], dtype=torch.float16, keep_in_fp32_modules=["norm"]
    )
    assert model.blocks[0].fc1.weight.dtype == torch.float16
    assert model.norm.weight.dtype == torch.float32
    assert model.head.weight is model.embed.weight


def test_disk_dtype_conversion_is_lazy(checkpoints, ref):
    _, ids, out = ref
    model = load_checkpoint_and_dispatch(
        empty(), checkpoints["safetensors"], device_map={"": "disk"}, dtype=torch.float64
    )
    index = model._nbaccel_offload_index
    assert index["blocks.0.fc1.weight"]["dtype"] == "float64"
    assert os.path.isabs(index["blocks.0.fc1.weight"]["safetensors_file"])


def test_missing_checkpoint_and_ambiguous_folder(tmp_path, ref):
    with pytest.raises(FileNotFoundError):
        load_checkpoint_in_model(empty(), tmp_path / "nope.safetensors")
    save_file(unique_state(ref[0]), str(tmp_path / "a.safetensors"))
    save_file(unique_state(ref[0]), str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match="no index"):
        load_checkpoint_in_model(empty(), tmp_path)


def test_plain_index_json_as_in_the_docs(tmp_path, ref):
    import json

    _, ids, out = ref
    state = unique_state(ref[0])
    names = list(state)
    torch.save({n: state[n] for n in names[:5]}, tmp_path / "first_state_dict.bin")
    torch.save({n: state[n] for n in names[5:]}, tmp_path / "second_state_dict.bin")
    index = {
        n: ("first_state_dict.bin" if i < 5 else "second_state_dict.bin")
        for i, n in enumerate(names)
    }
    (tmp_path / "index.json").write_text(json.dumps(index))
    model = empty()
    load_checkpoint_in_model(model, tmp_path, strict=True)
    assert torch.equal(model(ids), out)
