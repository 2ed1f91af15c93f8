"""Sizes, memory budgets and empty init (nbaccel.bigmodel.sizes / empty)."""

import pytest
import torch
from _bigmodel_nets import Block, DecoderLayer, TiedNet
from torch import nn

from nbaccel.bigmodel import (
    calculate_maximum_sizes,
    compute_module_sizes,
    convert_file_size_to_int,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
    init_empty_weights,
    init_on_device,
    named_module_tensors,
    retie_parameters,
)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("10GiB", 10 * 2**30),
        ("5GB", 5 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", int(1.5 * 2**30)),
        ("800mb", 800 * 10**6),
        ("100", 100),
        (1234, 1234),
    ],
)
def test_convert_file_size(text, expected):
    assert convert_file_size_to_int(text) == expected


@pytest.mark.parametrize("bad", ["10 gigs", "GiB", "-5GB", "5XB", -1, True])
def test_convert_file_size_rejects_garbage_with_the_fix(bad):
    with pytest.raises(ValueError, match="Invalid memory size"):
        convert_file_size_to_int(bad)


def test_get_max_memory_orders_and_parses():
    got = get_max_memory({"disk": "1GB", "cpu": "2GiB", 1: 100, "cuda:0": "1KiB", "mps": 7})
    assert list(got) == [0, 1, "mps", "cpu", "disk"]
    assert got == {0: 1024, 1: 100, "mps": 7, "cpu": 2 * 2**30, "disk": 10**9}


def test_get_max_memory_errors_name_the_key():
    with pytest.raises(ValueError, match=r"max_memory\['cpu'\].*Invalid memory size"):
        get_max_memory({"cpu": "lots"})
    with pytest.raises(ValueError, match="Unknown device 'gpu0'"):
        get_max_memory({"gpu0": 10})
    with pytest.raises(ValueError, match="twice"):
        get_max_memory({0: 10, "cuda:0": 10})


def test_get_max_memory_default_has_cpu():
    got = get_max_memory()
    assert got["cpu"] > 0
    assert list(got)[-1] == "cpu"


def test_init_empty_weights_meta_params_real_buffers():
    with init_empty_weights():
        model = TiedNet()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
    assert model.head.weight is model.embed.weight  # the tie survives empty init
    assert torch.equal(model.blocks[0].gate, torch.arange(16.0) / 16)
    with init_empty_weights(include_buffers=True):
        model = TiedNet()
    assert all(b.device.type == "meta" for b in model.buffers())
    # Outside the context, parameters are real again.
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_init_on_device_keeps_requires_grad_and_class():
    with init_on_device("meta"):
        lin = nn.Linear(3, 4)
        lin.weight.requires_grad_(False)
    assert isinstance(lin.weight, nn.Parameter) and lin.weight.device.type == "meta"
    assert not lin.weight.requires_grad and lin.bias.requires_grad


def test_compute_module_sizes_counts_ties_once_and_buffers():
    model = TiedNet(d=16, vocab=32, n=2)
    sizes = compute_module_sizes(model)
    embed = 32 * 16 * 4
    block = (16 * 32 + 32 + 32 * 16 + 16 + 2 * 16) * 4 + 16 * 4 * 2  # params + 2 buffers
    assert sizes["embed"] == embed
    assert sizes["head"] == 0  # the tied weight is counted with the embedding
    assert sizes["blocks.0"] == block
    assert sizes["blocks"] == 2 * block
    assert sizes["blocks.0.fc1.weight"] == 16 * 32 * 4
    assert sizes[""] == embed + 2 * block + 2 * 16 * 4
    half = compute_module_sizes(model, dtype=torch.float16)
    assert half["embed"] == embed // 2
    special = compute_module_sizes(model, special_dtypes={"embed.weight": torch.int8})
    assert special["embed"] == 32 * 16
    buffers = compute_module_sizes(model, buffers_only=True)
    assert buffers["blocks.0"] == 16 * 4 * 2 and buffers.get("embed", 0) == 0


def test_max_layer_and_calculate_maximum_sizes():
    with init_empty_weights():
        model = TiedNet(d=16, vocab=300, n=2)
    sizes = compute_module_sizes(model)
    size, names = get_max_layer_size(list(model.named_children()), sizes, ["Block"])
    assert names == ["embed"] and size == 300 * 16 * 4
    size, names = get_max_layer_size(list(model.named_children()), sizes, [])
    assert names == ["embed"]
    total, (largest, largest_names) = calculate_maximum_sizes(model)
    assert total == sizes[""] and largest == 300 * 16 * 4 and largest_names == ["embed"]


def test_find_and_retie_parameters():
    model = TiedNet()
    assert find_tied_parameters(model) == [["embed.weight", "head.weight"]]
    assert find_tied_parameters(TiedNet(tie=False)) == []
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    assert find_tied_parameters(model) == []
    retie_parameters(model, [["embed.weight", "head.weight"]])
    assert model.head.weight is model.embed.weight


def test_named_module_tensors_non_persistent():
    block = Block(4)
    names = [n for n, _ in named_module_tensors(block, recurse=True)]
    assert "gate" in names and "scale" in names and "fc1.weight" in names
    kept = [n for n, _ in named_module_tensors(block, recurse=True, remove_non_persistent=True)]
    assert "gate" not in kept and "scale" in kept
    direct = [n for n, _ in named_module_tensors(block)]
    assert direct == ["scale", "gate"]


def test_get_balanced_memory_spreads_and_low_zero():
    with init_empty_weights():
        model = TiedNet(n=8)
    sizes = compute_module_sizes(model)
    big = {0: 10**6, 1: 10**6, "cpu": 10**6}
    balanced = get_balanced_memory(model, big, no_split_module_classes=["Block"])
    assert sizes[""] // 2 <= balanced[0] < sizes[""]  # roughly half, plus slack
    assert balanced[1] == 10**6 and balanced["cpu"] == 10**6
    low = get_balanced_memory(model, {0: 10**6, 1: 10**6, 2: 10**6}, ["Block"], low_zero=True)
    assert low[0] == 0 and low[2] == 10**6
    tiny = {0: 100, 1: 100, "cpu": 10**6}  # does not fit on the GPUs: unchanged
    assert get_balanced_memory(model, tiny) == tiny


def _mixed_net() -> nn.Module:
    """Leaves and blocks at several depths, own parameters on a block, bool and float buffers
    on leaves and blocks, a ``None`` bias and a ``None`` child."""
    inner = nn.Sequential(nn.Linear(3, 5, bias=False), nn.BatchNorm1d(5), nn.Embedding(7, 2))
    inner.register_buffer("mask", torch.ones(13, dtype=torch.bool))
    inner.scale = nn.Parameter(torch.ones(3))
    net = nn.Sequential(nn.Linear(2, 3), inner, nn.Sequential(nn.ReLU(), nn.Linear(5, 4)))
    net[2][1].register_buffer("flags", torch.zeros(9, dtype=torch.bool))
    net.register_module("absent", None)
    return net


def test_identity_walk_gives_the_named_sizes_of_every_module():
    from nbaccel.bigmodel.planning.module_sizes import ModelScan

    net = _mixed_net()
    named = compute_module_sizes(net)
    named_buffers = compute_module_sizes(net, buffers_only=True)
    scan = ModelScan(net)
    assert not scan.by_name  # no tie: answered by module identity, names never built
    # 85 float32 elements, BatchNorm's int64 counter, 22 booleans at one bit each
    assert named[""] == 85 * 4 + 8 + (13 + 9) / 8
    for name, module in net.named_modules():
        assert scan.piece_size(name, module) == named[name], name
        assert scan.piece_buffers(name, module) == named_buffers.get(name, 0), name


def _layered_net() -> nn.Module:
    """Equal-size experts (counts matter), a layer wider than the others, a container whose
    only child is ``None`` (a layer of its own), and the mixed net's buffers and booleans."""
    net = nn.Sequential(nn.Embedding(11, 4), DecoderLayer(4, 3), DecoderLayer(6, 2), _mixed_net())
    hollow = nn.Module()
    hollow.register_module("nothing", None)
    hollow.register_buffer("steps", torch.zeros(40, dtype=torch.int64))
    net.add_module("hollow", hollow)
    return net


@pytest.mark.parametrize("whole", [(), ("DecoderLayer",), ("Expert", "Sequential")])
def test_the_walk_finds_the_largest_layer_under_every_module(whole):
    """The walk's ``layers_by_id`` against a plain recursive reading: under each module, the
    largest unsplittable piece (no children, or a class kept whole) and how many reach it."""
    from nbaccel.bigmodel.planning.size_walk import walk_sizes

    net = _layered_net()
    sizes = compute_module_sizes(net)
    names = {id(m): n for n, m in net.named_modules()}

    def truth(module: nn.Module) -> tuple[float, int]:
        children = [c for c in module._modules.values() if c is not None]
        if not children or (module is not net and type(module).__name__ in whole):
            return sizes[names[id(module)]], 1
        found = [truth(c) for c in children]
        best = max(size for size, _ in found)
        return best, sum(count for size, count in found if size == best)

    layers = walk_sizes(net, whole).layers_by_id
    checked = 0
    for name, module in net.named_modules():
        if id(module) not in layers:  # a leaf, or a module under one kept whole
            assert not module._modules or any(
                name.startswith(k + ".") and type(m).__name__ in whole
                for k, m in net.named_modules()
                if k
            ), name  # the model itself is never kept whole
            continue
        assert layers[id(module)] == truth(module), name
        checked += 1
    assert checked >= 4
    if not whole:  # nothing kept whole: both experts of a layer reach its largest size
        assert layers[id(net[1].experts)] == (4 * 8 * 4 * 2 // 2, 6)


def _tied_everywhere() -> nn.Module:
    """An embedding tied to the head (the usual LLM tie), a weight tied deep inside a block to
    one in an earlier block, a weight tied to a block's own parameter, and a tie whose first
    name is a module's second parameter (the module comes first, not the position)."""
    with init_empty_weights():
        net = TiedNet(d=8, vocab=40, n=3)
        net.blocks[2].fc2.weight = net.blocks[0].fc2.weight
        net.blocks[1].ln.weight = net.blocks[0].ln.bias
        net.blocks[1].register_parameter("gain", net.norm.weight)
    return net


def test_tied_weights_are_counted_once_without_names():
    """The identity walk takes a tie's later names back out: every module's size, the tie
    groups and a tied name's counted bytes are the by-name scan's answers."""
    from nbaccel.bigmodel.planning.module_sizes import ModelScan
    from nbaccel.storage.ties import tie_groups

    net = _tied_everywhere()
    with init_empty_weights(include_buffers=False):  # a tied leaf with buffers of its own
        net.add_module("norms", nn.Sequential(nn.BatchNorm1d(8), nn.BatchNorm1d(8)))
    net.norms[1].weight = net.norms[0].weight
    named = compute_module_sizes(net)
    named_buffers = compute_module_sizes(net, buffers_only=True)
    scan = ModelScan(net, whole={"Block"})
    assert not scan.by_name and not hasattr(scan, "_entries")  # no name was built
    for name, module in net.named_modules():
        assert scan.piece_size(name, module) == named[name], name
        assert scan.piece_buffers(name, module) == named_buffers.get(name, 0), name
    assert scan.tied_groups == tie_groups(net) and len(scan.tied_groups) == 5
    assert scan.tied_dups == {
        "head.weight",
        "blocks.2.fc2.weight",
        "norm.weight",
        "blocks.1.ln.weight",
        "norms.1.weight",
    }
    assert scan.tied_size("embed.weight") == 40 * 8 * 4 and scan.tied_size("head.weight") == 0
    # blocks.1 holds "gain", the first name of norm.weight: counted there, not under norm
    assert scan.piece_size("norm", net.norm) == 8 * 4  # its bias only
    by_name = ModelScan(net, tensor_names=True)
    assert by_name.tied_groups == scan.tied_groups and by_name.tied_dups == scan.tied_dups


def test_a_shared_module_with_tensors_is_still_answered_by_name():
    from nbaccel.bigmodel.planning.module_sizes import ModelScan

    net = TiedNet(d=4, vocab=8, n=2, tie=False)
    net.blocks.append(net.blocks[0])  # one block object under two names
    scan = ModelScan(net)
    assert scan.by_name
    named = compute_module_sizes(net)
    assert scan.piece_size("blocks.2", net.blocks[2]) == named.get("blocks.2", 0)


@pytest.mark.parametrize("no_split", [None, ["RandomBlock"], ["ModuleList"]])
def test_tied_models_get_the_same_map_by_identity_as_by_name(no_split):
    """Random tied models planned twice: by identity (the fast path), and by name (a dtype
    equal to the model's forces the by-name scan, which matches accelerate's answers)."""
    from _bigmodel_nets import random_case

    from nbaccel.bigmodel import infer_auto_device_map

    compared = tied = 0
    for seed in range(150):
        model, kwargs = random_case(seed)
        kwargs["no_split_module_classes"] = no_split
        kwargs["clean_result"] = False
        try:
            by_name = infer_auto_device_map(model, dtype=torch.float32, **dict(kwargs))
        except ValueError:
            continue
        assert infer_auto_device_map(model, **dict(kwargs)) == by_name, (seed, kwargs)
        compared += 1
        tied += any(n.endswith("tied") for n, _ in model.named_modules())
    assert compared >= 100 and tied >= 40


def _balanced_by_names(model, memory, no_split):
    """Accelerate's balanced budgets read off the by-name sizes (the reference)."""
    sizes = compute_module_sizes(model)
    gpus = sorted(k for k in memory if isinstance(k, int) and memory[k] > 0)
    per_gpu = sizes[""] // len(gpus)
    blocks = [sizes[n] for n, m in model.named_modules() if n and type(m).__name__ in no_split]
    named = {n for n, v in sizes.items() if v > 0 and n}
    parents = {n.rpartition(".")[0] for n in named}
    modules = {n for n in named if n in parents}  # tensors are nobody's parent
    module_parents = {n.rpartition(".")[0] for n in modules}
    last = [n for n in modules if n not in module_parents]
    mean = int(sum(sizes[n] for n in last) / max(len(last), 1))
    per_gpu += int(1.25 * max(blocks[:1] + [mean]))
    return {g: min(per_gpu, memory[g]) for g in gpus[:-1]}


@pytest.mark.parametrize("no_split", [[], ["RandomBlock"]])
def test_balanced_memory_by_identity_equals_the_by_name_rule(no_split):
    """Random models, half with a tied weight and some with a shared module: the budgets from
    one identity scan are the ones the by-name sizes give."""
    import random

    from _bigmodel_nets import random_case

    checked = 0
    for seed in range(120):
        model, _ = random_case(seed)
        if seed % 5 == 0:  # a module with tensors under two names
            leaf = next(m for m in model.modules() if not m._modules and m._parameters)
            model.add_module("again", leaf)
        total = compute_module_sizes(model)[""]
        share = random.Random(seed).uniform(0.2, 0.7)
        memory = {0: int(share * total), 1: int(share * total), 2: total, "cpu": total}
        got = get_balanced_memory(model, memory, no_split_module_classes=no_split)
        expected = _balanced_by_names(model, memory, no_split)
        assert {g: got[g] for g in expected} == expected, seed
        checked += 1
    assert checked == 120


def test_a_block_holding_only_its_own_tensors_is_a_last_level_module():
    holder = nn.Module()
    holder.scale = nn.Parameter(torch.ones(100))  # 400 bytes of its own
    holder.act = nn.ReLU()  # a child without bytes
    model = nn.Sequential(nn.Linear(4, 4, bias=False), holder, nn.Linear(2, 2, bias=False))
    memory = {0: 10**6, 1: 10**6}
    total = 64 + 400 + 16
    mean = (64 + 400 + 16) // 3  # three last-level modules: both Linears and the holder
    expected = total // 2 + int(1.25 * mean)
    assert get_balanced_memory(model, memory)[0] == expected
    assert _balanced_by_names(model, memory, [])[0] == expected
