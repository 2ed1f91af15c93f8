"""Loading from mapped safetensors files: what is mapped and what is copied, the GPU staging
path's CPU dry run, and every bad checkpoint refused with its file and tensor named, leaving
nothing half-loaded. Real files in ``tmp_path``, real mappings (read from /proc/self/maps)."""

from __future__ import annotations

import gc
import json
import os
import struct

import pytest
import torch
from torch import nn

from nbaccel.bigmodel import init_empty_weights, load_checkpoint_and_dispatch
from nbaccel.bigmodel.loading.checkpoint import CheckpointMismatchError, load_checkpoint_in_model
from nbaccel.bigmodel.loading.host_to_device import HostToDevice
from nbaccel.storage.safetensors_file import CorruptCheckpointError, SafetensorsFile
from nbaccel.storage.weights import write_weights


class Net(nn.Module):
    def __init__(self, width: int = 64, vocab: int = 100) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in many language models
        self.register_buffer("scale", torch.ones(width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)) * self.scale)


def _save(tmp_path, shard: str = "40KB") -> tuple[Net, str]:
    torch.manual_seed(0)
    net = Net().eval()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    write_weights(net.state_dict(), folder, max_shard_size=shard)
    return net, str(folder)


def _mapped_ranges(folder: str) -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if folder in line:
                lo, hi = line.split()[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def _is_mapped(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    return any(lo <= t.data_ptr() < hi for lo, hi in ranges)


def _empty() -> Net:
    with init_empty_weights():
        return Net().eval()


IDS = torch.tensor([[1, 5, 7, 99]])


def test_cpu_load_uses_the_mapped_bytes_without_copying(tmp_path):
    net, folder = _save(tmp_path)
    model = load_checkpoint_and_dispatch(_empty(), folder, device_map={"": "cpu"})
    ranges = _mapped_ranges(folder)
    assert ranges, "the shards are mapped"
    for name, p in model.named_parameters():
        assert _is_mapped(p, ranges), f"{name} was copied"
    assert model.head.weight is model.embed.weight  # still tied, one tensor
    with torch.no_grad():
        assert torch.equal(model(IDS), net(IDS))


def test_a_dtype_cast_is_copied_and_its_pages_released(tmp_path):
    net, folder = _save(tmp_path)
    model = _empty()
    load_checkpoint_in_model(model, folder, dtype=torch.bfloat16)
    ranges = _mapped_ranges(folder)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert not _is_mapped(p, ranges), f"{name} should be a cast copy"
        assert torch.equal(p, net.get_parameter(name).to(torch.bfloat16))


def test_loaded_model_keeps_working_after_its_files_are_deleted(tmp_path):
    """On Linux a mapping holds the file's inode: deleting the checkpoint while the model lives
    frees nothing until the model goes; the weights stay readable."""
    net, folder = _save(tmp_path)
    model = load_checkpoint_and_dispatch(_empty(), folder, device_map={"": "cpu"})
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)
    gc.collect()
    with open("/proc/self/maps") as maps:
        assert any("(deleted)" in line for line in maps if folder in line)
    with torch.no_grad():
        assert torch.equal(model(IDS), net(IDS))
    for name, p in model.named_parameters():
        assert torch.equal(p, net.get_parameter(name))


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_anonymous_memory_does_not_grow_by_the_model(tmp_path, safe):
    torch.manual_seed(0)
    big = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(16)))  # 64 MiB of fp32
    folder = tmp_path / "big"
    folder.mkdir()
    write_weights(big.state_dict(), folder, max_shard_size="16MB", safe_serialization=safe)
    with init_empty_weights():
        empty = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(16)))

    def anon_kb() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))

    before = anon_kb()
    load_checkpoint_in_model(empty, str(folder))
    assert torch.isfinite(sum(p.float().sum() for p in empty.parameters()))  # pages touched
    assert anon_kb() - before < 16 * 1024  # the 64 MiB model is the files' pages, not copies
    for (name, p), q in zip(empty.named_parameters(), big.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_staging_path_dry_run_copies_in_pieces_and_casts():
    src = torch.randn(1000, 37)
    stream = HostToDevice("cpu", buffer_bytes=4096, buffers=2)
    same = stream.copy(src)
    cast = stream.copy(src, torch.bfloat16)
    empty = stream.copy(torch.empty(0, 5))
    stream.finish()
    assert torch.equal(same, src) and same.data_ptr() != src.data_ptr()
    assert torch.equal(cast, src.to(torch.bfloat16))
    assert empty.shape == (0, 5)


# -- bad checkpoints -----------------------------------------------------------------------


def _shards(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith("tensors"))


def _assert_untouched(model: Net, originals: dict) -> None:
    for name, p in model.named_parameters(remove_duplicate=False):
        assert p is originals[name], f"{name} was replaced by a failed load"


def _real_model() -> tuple[Net, dict]:
    torch.manual_seed(1)
    model = Net()
    return model, dict(model.named_parameters(remove_duplicate=False))


def test_truncated_shard_is_refused_naming_file_and_tensor(tmp_path):
    _, folder = _save(tmp_path)
    last = _shards(folder)[-1]
    os.truncate(last, os.path.getsize(last) - 100)
    model, originals = _real_model()
    with pytest.raises(CorruptCheckpointError) as err:
        load_checkpoint_in_model(model, folder)
    text = str(err.value)
    assert last in text and "truncated" in text
    assert "tensor '" in text
    _assert_untouched(model, originals)


def test_corrupt_header_is_refused_naming_the_file(tmp_path):
    _, folder = _save(tmp_path)
    shard = _shards(folder)[1]
    with open(shard, "r+b") as f:
        f.seek(8)
        f.write(b"#garbage#")
    model, originals = _real_model()
    with pytest.raises(CorruptCheckpointError, match="not valid JSON") as err:
        load_checkpoint_in_model(model, folder)
    assert shard in str(err.value)
    _assert_untouched(model, originals)


def test_header_whose_bytes_do_not_fit_the_shape_is_refused(tmp_path):
    path = tmp_path / "one.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}})
    header += " " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(64))
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' \(F32, shape \[4, 4\]\)"):
        SafetensorsFile(path)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])  # mapped, or cast on threads
def test_shape_that_does_not_fit_names_file_and_tensor_and_puts_everything_back(tmp_path, dtype):
    _, folder = _save(tmp_path)

    class Wider(Net):
        def __init__(self) -> None:
            super().__init__()
            self.blocks[3] = nn.Linear(64, 64, bias=False)
            self.blocks[3].weight = nn.Parameter(torch.zeros(64, 32))

    torch.manual_seed(1)
    model = Wider()
    originals = dict(model.named_parameters(remove_duplicate=False))
    with pytest.raises(CheckpointMismatchError) as err:
        load_checkpoint_in_model(model, folder, dtype=dtype)
    text = str(err.value)
    assert "'blocks.3.weight' has shape [64, 64] in" in text and ".safetensors" in text
    _assert_untouched(model, originals)  # the tensors loaded before the failure were put back


def test_missing_shard_and_missing_key_are_named(tmp_path):
    _, folder = _save(tmp_path)
    index_path = os.path.join(folder, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    gone = _shards(folder)[0]
    os.remove(gone)
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        load_checkpoint_in_model(_real_model()[0], folder)
    assert gone in str(err.value)
    # an index that names a tensor its shard does not hold
    index["weight_map"] = {k: os.path.basename(_shards(folder)[0]) for k in index["weight_map"]}
    with open(index_path, "w") as f:
        json.dump(index, f)
    model, originals = _real_model()
    with pytest.raises(CheckpointMismatchError, match="which does not hold it") as err:
        load_checkpoint_in_model(model, folder)
    _assert_untouched(model, originals)
    # strict: a key the model has and the checkpoint lacks
    del index["weight_map"]["blocks.0.bias"]
    with open(index_path, "w") as f:
        json.dump(index, f)
    with pytest.raises(CheckpointMismatchError, match="blocks.0.bias"):
        load_checkpoint_in_model(_real_model()[0], folder, strict=True)


def test_a_file_changed_after_its_header_was_read_is_refused(tmp_path):
    _, folder = _save(tmp_path)
    shard = _shards(folder)[0]
    handle = SafetensorsFile(shard)
    name = handle.keys()[0]
    stat = os.stat(shard)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # rewritten
    with pytest.raises(CorruptCheckpointError, match="changed while it was being loaded") as err:
        handle.view(name)  # mapping it refuses a file that is not the one whose header was read
    assert shard in str(err.value)
    with pytest.raises(CorruptCheckpointError):
        handle.check_unchanged()


def test_quantized_load_refuses_a_truncated_shard_and_leaves_no_weights(tmp_path):
    pytest.importorskip("bitsandbytes")
    from nbaccel.bigmodel.quantization import BnbQuantizationConfig, load_and_quantize_model

    _, folder = _save(tmp_path, shard="20KB")
    last = _shards(folder)[-1]
    os.truncate(last, os.path.getsize(last) - 8)
    model = _empty()
    config = BnbQuantizationConfig(load_in_8bit=True, skip_modules=["embed", "head"])
    with pytest.raises(CorruptCheckpointError, match="truncated") as err:
        load_and_quantize_model(model, config, folder, device_map="cpu")
    assert last in str(err.value)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_quantized_load_failing_midway_leaves_no_half_loaded_model(tmp_path):
    pytest.importorskip("bitsandbytes")
    from nbaccel.bigmodel.quantization import BnbQuantizationConfig, load_and_quantize_model

    _, folder = _save(tmp_path, shard="20KB")
    with init_empty_weights():
        model = Net().eval()
        model.blocks[3] = nn.Linear(64, 32)  # the last block no longer fits its weights
    config = BnbQuantizationConfig(load_in_8bit=True, skip_modules=["embed", "head"])
    with pytest.raises(
        CheckpointMismatchError, match=r"'blocks\.3\.(weight|bias)' has shape"
    ) as err:
        load_and_quantize_model(model, config, folder, device_map="cpu")
    assert ".safetensors" in str(err.value)
    assert all(p.device.type == "meta" for p in model.parameters())


# -- torch (.bin) checkpoints ----------------------------------------------------------------


def _save_bin(tmp_path, legacy: bool = False) -> tuple[Net, str]:
    torch.manual_seed(0)
    net = Net().eval()
    folder = tmp_path / "bin"
    folder.mkdir()
    if legacy:  # torch's pre-1.6 format: a bare pickle, which cannot be mapped
        torch.save(
            net.state_dict(), folder / "pytorch_model.bin", _use_new_zipfile_serialization=False
        )
    else:
        write_weights(net.state_dict(), folder, max_shard_size="40KB", safe_serialization=False)
    return net, str(folder)


def test_bin_cpu_load_uses_the_mapped_bytes_and_gives_the_copied_loads_logits(tmp_path):
    net, folder = _save_bin(tmp_path)
    assert any(n.endswith(".bin") for n in os.listdir(folder))
    model = load_checkpoint_and_dispatch(_empty(), folder, device_map={"": "cpu"})
    ranges = _mapped_ranges(folder)
    assert ranges, "the .bin shards are mapped"
    for name, p in model.named_parameters():
        assert _is_mapped(p, ranges), f"{name} was copied"
    assert model.head.weight is model.embed.weight
    copied = Net().eval()  # the same checkpoint read into memory
    for path in sorted(os.listdir(folder)):
        if path.endswith(".bin"):
            copied.load_state_dict(
                torch.load(os.path.join(folder, path), weights_only=True), strict=False
            )
    with torch.no_grad():
        assert torch.equal(model(IDS), copied(IDS))
        assert torch.equal(model(IDS), net(IDS))
    cast = _empty()
    load_checkpoint_in_model(cast, folder, dtype=torch.bfloat16)  # a cast is a copy
    for name, p in cast.named_parameters():
        assert p.dtype == torch.bfloat16 and not _is_mapped(p, ranges), name
        assert torch.equal(p, net.get_parameter(name).to(torch.bfloat16))


def test_legacy_bin_is_read_into_memory(tmp_path):
    net, folder = _save_bin(tmp_path, legacy=True)
    model = load_checkpoint_and_dispatch(_empty(), folder, device_map={"": "cpu"})
    assert not _mapped_ranges(folder)  # cannot be mapped: read, and no error
    with torch.no_grad():
        assert torch.equal(model(IDS), net(IDS))


@pytest.mark.parametrize("legacy", [False, True])
def test_truncated_bin_is_refused_naming_the_file(tmp_path, legacy):
    _, folder = _save_bin(tmp_path, legacy=legacy)
    shard = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".bin"))[-1]
    os.truncate(shard, os.path.getsize(shard) - 100)
    model, originals = _real_model()
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt") as err:
        load_checkpoint_in_model(model, folder)
    assert shard in str(err.value)
    _assert_untouched(model, originals)
