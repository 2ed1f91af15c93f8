"""Planning device maps (infer_auto_device_map, device_map strings, check_device_map)."""

import pytest
import torch
from _bigmodel_nets import TiedNet
from torch import nn

from nbaccel.bigmodel import (
    check_device_map,
    clean_device_map,
    compute_module_sizes,
    get_device_map,
    infer_auto_device_map,
    init_empty_weights,
)


def empty_net(**kwargs) -> TiedNet:
    with init_empty_weights():
        return TiedNet(**kwargs)


class Chain(nn.Module):
    """Layers of given sizes (in float32 elements) in order."""

    def __init__(self, sizes):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(s, 1, bias=False) for s in sizes)


def chain_bytes(n: int) -> int:
    return 4 * n


def _devices_of(model, device_map):
    """Device of every tensor name, resolved through the map (also proves coverage)."""
    out = {}
    for name, _ in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers()
    ):
        key = name
        while key not in device_map:
            key = key.rpartition(".")[0] if "." in key else ""
        out[name] = device_map[key]
    return out


def test_everything_fits_on_gpu0_is_one_entry():
    model = empty_net()
    assert infer_auto_device_map(model, max_memory={0: 10**9, "cpu": 10**9}) == {"": 0}
    assert infer_auto_device_map(model, max_memory={"cpu": 10**9}) == {"": "cpu"}


def test_spills_gpu_then_cpu_then_disk_keeping_blocks_whole():
    model = empty_net(n=6)
    sizes = compute_module_sizes(model)
    block = sizes["blocks.0"]
    dm = infer_auto_device_map(
        model,
        max_memory={0: 2 * block + 4000, 1: 2 * block, "cpu": 2 * block},
        no_split_module_classes=["Block"],
        clean_result=False,
        offload_aware=True,
    )
    devices = _devices_of(model, dm)
    order = [dm[f"blocks.{i}"] for i in range(6)]
    assert order == sorted(order, key=lambda d: (isinstance(d, str), str(d)))  # sequential
    assert order[:2] == [1, 1] and "cpu" in order and order[-1] == "disk"
    # GPU 0 runs the offloaded blocks: it keeps two blocks free (running + prefetched) and only
    # takes the small embedding (with its tied head).
    assert devices["embed.weight"] == 0
    # No Block is split: every tensor of a block has the block's device.
    for i in range(6):
        block_devs = {v for k, v in devices.items() if k.startswith(f"blocks.{i}.")}
        assert len(block_devs) == 1
    # Tied weights share a device.
    assert devices["embed.weight"] == devices["head.weight"]
    # Budgets respected on each GPU (with tied weights counted once).
    for gpu, budget in ((0, 2 * block + 4000), (1, 2 * block)):
        used = sum(sizes[k] for k, v in dm.items() if v == gpu)
        assert used <= budget


def test_tied_partner_is_pulled_to_the_same_device():
    model = empty_net(n=2)
    sizes = compute_module_sizes(model)
    # Room on GPU 0 for the embedding and the first block only.
    budget = sizes["embed"] + sizes["blocks.0"] + 8
    dm = infer_auto_device_map(model, max_memory={0: budget, "cpu": 10**9}, clean_result=False)
    assert dm["embed"] == 0 and dm["head"] == 0
    assert dm["blocks.1"] == "cpu"


def test_clean_result_merges_and_unclean_lists_pieces():
    model = empty_net(n=4)
    sizes = compute_module_sizes(model)
    budget = sizes["embed"] + 2 * sizes["blocks.0"] + 8
    clean = infer_auto_device_map(model, {0: budget, "cpu": 10**9}, ["Block"])
    raw = infer_auto_device_map(model, {0: budget, "cpu": 10**9}, ["Block"], clean_result=False)
    assert raw == {
        "embed": 0,
        "head": 0,
        "blocks.0": 0,
        "blocks.1": "cpu",
        "blocks.2": "cpu",
        "blocks.3": "cpu",
        "norm": "cpu",
    }
    assert clean == raw  # "blocks" holds two devices: nothing to merge
    everything_on_cpu = infer_auto_device_map(model, {0: 8, "cpu": 10**9}, clean_result=False)
    assert len(everything_on_cpu) == 4
    assert infer_auto_device_map(model, {0: 8, "cpu": 10**9}) == {"": "cpu"}
    assert _devices_of(model, clean) == _devices_of(model, raw)


def test_clean_device_map_like_accelerate():
    assert clean_device_map({"a": 0, "b": 0, "c": 0}) == {"": 0}
    assert clean_device_map({"a.x": 0, "a.y": 0, "b.x": 1, "b.y": 1, "c": 1}) == {
        "a": 0,
        "b": 1,
        "c": 1,
    }
    nested = {"a.x": 0, "a.y": 0, "b.x.0": 1, "b.x.1": 1, "b.y.0": 2, "b.y.1": 2, "c": 2}
    assert clean_device_map(nested) == {"a": 0, "b.x": 1, "b.y": 2, "c": 2}
    # A single piece under a module is left as it is (there is nothing to merge).
    assert clean_device_map({"a.x": 0}) == {"a.x": 0}


def test_first_layer_bigger_than_gpu0_does_not_push_everything_to_cpu():
    model = Chain([1000, 10, 10, 10, 10])  # the first layer is larger than GPU 0
    accelerate_like = infer_auto_device_map(model, max_memory={0: chain_bytes(100), "cpu": 10**6})
    assert accelerate_like == {"": "cpu"}  # Accelerate's fill gives GPU 0 up at the first layer
    dm = infer_auto_device_map(
        model, max_memory={0: chain_bytes(100), "cpu": 10**6}, offload_aware=True
    )
    assert dm["layers.0"] == "cpu"
    assert all(dm.get(f"layers.{i}", dm.get("layers")) == 0 for i in range(1, 5))


def test_reserve_is_the_real_offloaded_layer_not_the_largest():
    # A large layer that fits on GPU 0 comes first; only small layers end up offloaded.
    # Reserving the largest layer (1000) would leave GPU 0 almost empty.
    model = Chain([1000] + [50] * 20)
    budget = chain_bytes(1600)
    dm = infer_auto_device_map(
        model, max_memory={0: budget, "cpu": 10**6}, clean_result=False, offload_aware=True
    )
    on_gpu = [k for k, v in dm.items() if v == 0]
    offloaded = [k for k, v in dm.items() if v == "cpu"]
    assert "layers.0" in on_gpu and offloaded
    used = sum(chain_bytes(1000 if k == "layers.0" else 50) for k in on_gpu)
    # Two offloaded layers (running + prefetched) are kept free, not 1000 elements.
    assert used + 2 * chain_bytes(50) <= budget
    assert len(on_gpu) >= 10


def test_offloaded_buffers_are_counted_on_the_main_device():
    model = empty_net(n=4)
    sizes = compute_module_sizes(model)
    mm = {0: sizes["embed"] + sizes["blocks.0"] + 64, "cpu": 10**9}
    keep = infer_auto_device_map(model, mm, ["Block"], clean_result=False)
    off = infer_auto_device_map(model, mm, ["Block"], clean_result=False, offload_buffers=True)
    gpu_keep = [k for k, v in keep.items() if v == 0]
    gpu_off = [k for k, v in off.items() if v == 0]
    assert len(gpu_off) >= len(gpu_keep)


def test_no_room_anywhere_raises_with_fix():
    model = Chain([100])
    with pytest.raises(ValueError, match="fits on no device"):
        infer_auto_device_map(model, max_memory={0: 10, "cpu": 10, "disk": 10}, offload_aware=True)
    # Accelerate's fill never counts the disk as full.
    assert infer_auto_device_map(model, max_memory={0: 10, "cpu": 10, "disk": 10}) == {
        "layers.0": "disk"
    }


def test_dtype_changes_the_plan():
    model = Chain([100] * 4)
    fp32 = infer_auto_device_map(model, {0: chain_bytes(200), "cpu": 10**6}, clean_result=False)
    fp16 = infer_auto_device_map(
        model, {0: chain_bytes(200), "cpu": 10**6}, dtype=torch.float16, clean_result=False
    )
    on_gpu = [sum(v == 0 for v in _devices_of(model, dm).values()) for dm in (fp32, fp16)]
    assert on_gpu == [1, 4]  # fp32: one layer + room to run an offloaded one


@pytest.mark.parametrize("strategy", ["auto", "balanced", "balanced_low_0", "sequential"])
def test_device_map_strings(strategy):
    model = empty_net(n=8)
    mm = {0: 10**6, 1: 10**6, 2: 10**6, "cpu": 10**6}
    dm = get_device_map(model, strategy, max_memory=mm, no_split_module_classes=["Block"])
    check_device_map(model, dm)
    used = {
        d: sum(1 for i in range(8) if _devices_of(model, dm)[f"blocks.{i}.fc1.weight"] == d)
        for d in (0, 1, 2)
    }
    if strategy == "sequential":
        assert used == {0: 8, 1: 0, 2: 0}
    elif strategy == "balanced_low_0":
        assert used[0] == 0 and used[1] >= 3 and used[2] >= 3
    else:
        assert all(2 <= used[d] <= 4 for d in (0, 1, 2))


def test_device_map_single_device_and_unknown_strings():
    model = empty_net()
    assert get_device_map(model, "disk") == {"": "disk"}
    assert get_device_map(model, "cuda:1") == {"": 1}
    with pytest.raises(ValueError, match="Unknown device_map 'fastest'"):
        get_device_map(model, "fastest")


def test_check_device_map_names_every_missing_tensor():
    model = empty_net(n=2)
    with pytest.raises(ValueError) as err:
        check_device_map(model, {"embed": 0, "blocks.0": 0, "blocks.1.fc1": 1})
    text = str(err.value)
    for name in (
        "blocks.1.fc2.weight",
        "blocks.1.ln.weight",
        "blocks.1.scale",
        "norm.weight",
        "head.weight",
    ):
        assert name in text
    assert "blocks.0.fc1.weight" not in text
    assert "Add an entry" in text


def test_check_device_map_unknown_names_and_devices():
    model = empty_net(n=1)
    # Like Accelerate: an unknown name is a warning, not an error (the map still covers all).
    with pytest.warns(UserWarning, match="do not match any submodules.*'blocks.7'"):
        check_device_map(model, {"": 0, "blocks.7": 0})
    with pytest.raises(ValueError, match="Unknown device 'gpu'.*for 'embed'"):
        check_device_map(model, {"": 0, "embed": "gpu"})
    check_device_map(model, {"": "disk"})
    check_device_map(
        model, {"embed": "cuda:0", "blocks": torch.device("cpu"), "norm": "disk", "head": 1}
    )


class MoE(nn.Module):
    def __init__(self, layers: int, experts: int, d: int = 8):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.experts = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(experts))
            layer.router = nn.Linear(d, experts, bias=False)
            self.layers.append(layer)


class _CountingChildren(dict):
    """A module's ``_modules`` that counts how often its children are listed."""

    visits = 0

    def items(self):
        _CountingChildren.visits += 1
        return super().items()

    def values(self):
        _CountingChildren.visits += 1
        return super().values()


@pytest.mark.parametrize("no_split", [None, ["Module"]])
def test_planning_lists_each_module_a_bounded_number_of_times(no_split):
    # Linear time: the fill must not walk the whole queue again after every split (it did:
    # about 6 listings per module here, growing with the number of devices and splits).
    with init_empty_weights():
        model = MoE(24, 32)
    total = compute_module_sizes(model)[""]
    modules = list(model.modules())
    for module in modules:
        module.__dict__["_modules"] = _CountingChildren(module._modules)
    _CountingChildren.visits = 0
    mm = {i: total // 8 for i in range(6)} | {"cpu": total}
    dm = infer_auto_device_map(model, max_memory=mm, no_split_module_classes=no_split)
    assert set(dm.values()) == {0, 1, 2, 3, 4, 5, "cpu"}
    assert _CountingChildren.visits <= 2 * len(modules), (_CountingChildren.visits, len(modules))


class ThreeLayers(nn.Module):
    """Accelerate's documented example: sizes 64, 72 and 100 bytes (236 in all)."""

    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)


@pytest.mark.parametrize(
    "max_memory, expected",
    [
        # GPU 0 keeps the largest layer (100 bytes) free: only linear1 fits there.
        ({0: 200, 1: 200}, {"linear1": 0, "batchnorm": 1, "linear2": 1}),
        ({0: 200, 1: 172, 2: 200}, {"linear1": 0, "batchnorm": 1, "linear2": 1}),
        ({0: 100, 1: 172, 2: 200}, {"linear1": 1, "batchnorm": 1, "linear2": 2}),
        ({0: 200, 1: 200, "cpu": 1000}, {"linear1": 0, "batchnorm": 1, "linear2": 1}),
        ({0: 10**6}, {"": 0}),
    ],
)
def test_map_is_accelerates_when_nothing_is_offloaded(max_memory, expected):
    assert infer_auto_device_map(ThreeLayers(), max_memory=max_memory) == expected


def test_no_split_class_and_tied_weights_match_accelerate():
    model = ThreeLayers()
    dm = infer_auto_device_map(
        model, max_memory={0: 250, 1: 400}, no_split_module_classes=["ThreeLayers"]
    )
    assert dm == {"": 0}
    tied = nn.Module()
    tied.a, tied.b, tied.c = nn.Linear(4, 4), ThreeLayers(), nn.Linear(4, 4)
    tied.c.weight = tied.a.weight
    dm = infer_auto_device_map(tied, max_memory={0: 300, 1: 1000})
    assert dm == {"a": 0, "c": 0, "b.linear1": 0, "b.batchnorm": 1, "b.linear2": 1}


def test_offloaded_buffers_warning_like_accelerate():
    model = ThreeLayers()
    model.linear1.register_buffer("b1", torch.zeros(10, 2))
    model.batchnorm.register_buffer("b2", torch.zeros(10, 3))
    model.linear2.register_buffer("b3", torch.zeros(10, 3))
    with pytest.warns(UserWarning, match="offload_buffers=True"):
        dm = infer_auto_device_map(model, max_memory={0: 400, "cpu": "1GB"})
    assert dm == {"linear1": 0, "batchnorm": "cpu", "linear2": "cpu"}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm = infer_auto_device_map(model, max_memory={0: 400, "cpu": "1GB"}, offload_buffers=True)
    assert dm == {"linear1": 0, "batchnorm": "cpu", "linear2": "cpu"}


def test_insufficient_memory_is_logged_and_fallback_fills_the_device(caplog):
    inner = nn.Sequential()
    inner.add_module("linear1", nn.Linear(10, 4))
    inner.add_module("linear2", nn.Linear(4, 4))
    inner.add_module("linear3", nn.Linear(4, 8))
    model = nn.Sequential()
    model.add_module("module", inner)
    with caplog.at_level("INFO"):
        dm = infer_auto_device_map(ThreeLayers(), max_memory={0: 100, 1: 172, 2: 200})
    assert dm == {"linear1": 1, "batchnorm": 1, "linear2": 2}
    assert "insufficient memory" in caplog.text and "0: 164 bytes" in caplog.text
    dm = infer_auto_device_map(model, max_memory={0: 256, 1: 400}, fallback_allocation=True)
    assert dm == {"module.linear2": 0, "module.linear1": 1, "module.linear3": 1}


def test_bool_tensors_count_one_bit():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = nn.Linear(3, 3)
            self.register_buffer("mask", torch.ones(80, dtype=torch.bool))

    from nbaccel.bigmodel import dtype_byte_size

    assert dtype_byte_size(torch.bool) == 1 / 8
    sizes = compute_module_sizes(Masked())
    assert sizes["mask"] == 10 and sizes[""] == 58
    # dtype never upcasts: an fp16 model planned as float32 keeps its fp16 size.
    half = ThreeLayers().half()
    assert compute_module_sizes(half, dtype=torch.float32)["linear2"] == 50
