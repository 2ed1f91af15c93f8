"""GPU lane: big-model inference on CUDA. ``infer_auto_device_map`` with the real free memory of
cuda:0; a transformers Llama (built from a config, saved locally) dispatched over cuda:0 + cpu +
disk giving the in-memory logits and ``generate()`` tokens; pinned host weights prefetched on a
side CUDA stream while the previous layer computes; ``cpu_offload``, ``disk_offload`` and
``cpu_offload_with_hook`` on the GPU; the memory sampler's CUDA numbers and ``estimate-memory``
against the measured peak.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _bigmodel_nets import reference
from torch import nn

from nbaccel.bigmodel import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    infer_auto_device_map,
    init_empty_weights,
    load_checkpoint_and_dispatch,
)
from nbaccel.bigmodel.planning.memory_budgets import get_max_memory
from nbaccel.bigmodel.planning.module_sizes import compute_module_sizes

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _offload_hooks(model: nn.Module) -> list:
    from nbaccel.bigmodel.hooks.align_devices import _offload_hook

    return [h for h in (_offload_hook(m) for m in model.modules()) if h is not None]


# -- device maps on real GPU memory -------------------------------------------------------------
def test_infer_auto_device_map_fills_cuda0_up_to_its_real_free_memory():
    free = torch.cuda.mem_get_info(0)[0]
    budget = get_max_memory()
    assert 0 < budget[0] <= torch.cuda.get_device_properties(0).total_memory
    assert abs(budget[0] - free) < 512 * MiB  # the free memory, read now
    layer = 64 * MiB  # one Linear(4096, 4096) in float32
    n = int(1.25 * free // layer) + 2
    with init_empty_weights():  # a model 1.25x bigger than what is free: nothing is allocated
        model = nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(n)))
    device_map = infer_auto_device_map(model)  # budgets: the real free memory of each device
    sizes = compute_module_sizes(model)
    on_gpu = [k for k, v in device_map.items() if v == 0]
    assert on_gpu and on_gpu[0] == "0"  # the first layers go to the GPU...
    assert sum(sizes[k] for k in on_gpu) <= free  # ...within its free memory
    assert len(on_gpu) >= n // 2  # and it is used, not left nearly empty
    rank = {0: 0, "cpu": 1, "disk": 2}
    assert set(device_map.values()) - {0} and set(device_map.values()) <= set(rank)
    order = [rank[v] for v in device_map.values()]
    assert order == sorted(order)  # the rest offloaded after the GPU's layers, in order


# -- a transformers Llama over cuda:0 + cpu + disk --------------------------------------------
def _llama(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path / "llama"
    model.save_pretrained(folder, safe_serialization=True)
    return transformers, config, model, folder


def _llama_map(model) -> dict:
    """embeddings, 2 layers, norm, rotary and head on cuda:0; 2 layers on cpu; 2 on disk."""
    device_map = {}
    for name, _ in model.model.named_children():
        if name != "layers":
            device_map[f"model.{name}"] = 0
    for i in range(len(model.model.layers)):
        device_map[f"model.layers.{i}"] = 0 if i < 2 else "cpu" if i < 4 else "disk"
    device_map["lm_head"] = 0
    return device_map


def _dispatched_llama(transformers, config, folder):
    with init_empty_weights():
        empty = transformers.LlamaForCausalLM(config).eval()
    return load_checkpoint_and_dispatch(
        empty, str(folder), _llama_map(empty), no_split_module_classes=["LlamaDecoderLayer"]
    )


def test_llama_on_cuda_cpu_and_disk_gives_the_in_memory_logits(tmp_path):
    transformers, config, model, folder = _llama(tmp_path)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.to("cuda:0")(ids.to("cuda:0")).logits.cpu()
    model.cpu()
    dispatched = _dispatched_llama(transformers, config, folder)
    assert dispatched.model.embed_tokens.weight.device == torch.device("cuda:0")
    assert dispatched.model.layers[2].mlp.up_proj.weight.device.type == "meta"  # cpu: streamed
    assert dispatched.model.layers[5].mlp.up_proj.weight.device.type == "meta"  # disk: streamed
    with torch.no_grad():
        got = dispatched(ids.to("cuda:0")).logits.cpu()
        again = dispatched(ids.to("cuda:0")).logits.cpu()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, got)


def test_llama_on_cuda_cpu_and_disk_generates_the_in_memory_tokens(tmp_path):
    transformers, config, model, folder = _llama(tmp_path)
    prompt = torch.randint(
        0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2)
    )
    options = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = model.to("cuda:0").generate(prompt.to("cuda:0"), **options).cpu()
    model.cpu()
    dispatched = _dispatched_llama(transformers, config, folder)
    with torch.no_grad():
        got = dispatched.generate(prompt.to("cuda:0"), **options).cpu()
    assert got.shape == (1, 28)
    assert torch.equal(got, expected)


# -- pinned prefetch on a CUDA stream ----------------------------------------------------------
def _trace(tmp_path, fn) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def test_pinned_prefetch_copies_on_a_side_stream_while_the_previous_layer_computes(tmp_path):
    torch.manual_seed(0)
    width, layers = 4096, 6
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers))).half()
    x = torch.randn(8192, width, dtype=torch.float16, device="cuda:0")
    with torch.no_grad():
        expected = model.to("cuda:0")(x)
    model.cpu()
    cpu_offload(model, 0)
    hooks = _offload_hooks(model)
    assert len(hooks) == layers
    assert all(t.is_pinned() for h in hooks for t in h.weights_map.values())  # pinned host copies
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)  # warm-up: learns the layer order
        prefetcher = model._nbaccel_prefetcher
        hits = prefetcher.hits
        events = _trace(tmp_path, lambda: model(x))
    assert prefetcher.hits - hits >= layers - 1  # (at least) every layer after the first
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    layer_bytes = width * width * 2
    weight_copies = [e for e in copies if e["args"].get("bytes", layer_bytes) >= layer_bytes]
    assert len(weight_copies) >= layers - 1, [e["name"] for e in copies]
    assert all("Pinned" in e["name"] for e in weight_copies), [e["name"] for e in weight_copies]
    copy_streams = {e["args"]["stream"] for e in weight_copies}
    compute_streams = {e["args"]["stream"] for e in kernels}
    assert copy_streams.isdisjoint(compute_streams)  # copies ran on the side stream

    def overlaps(a, b):
        return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]

    overlapping = [c for c in weight_copies if any(overlaps(c, k) for k in kernels)]
    assert overlapping, "no host-to-device weight copy ran while a kernel computed"


# -- cpu_offload / disk_offload / cpu_offload_with_hook on the GPU -----------------------------
def test_cpu_offload_to_cuda_streams_layers_and_frees_them():
    model, ids, out = reference(d=256)
    cpu_offload(model, 0)
    assert model.blocks[1].fc1.weight.device.type == "meta"
    got = model(ids)
    # the first forward leaves what cuBLAS and cuBLASLt keep per stream from their first product
    # on (tens of MiB on Hopper, counted by the caching allocator): the baseline comes after it
    base = torch.cuda.memory_allocated(0)
    assert got.device.type == "cpu"  # outputs come back to the inputs' device
    torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(ids), out, rtol=1e-5, atol=1e-5)
    assert model.blocks[1].fc1.weight.device.type == "meta"
    model._nbaccel_prefetcher.close()
    torch.cuda.synchronize()
    # nothing of the layers stays allocated on the GPU (only buffers, a few KiB)
    assert torch.cuda.memory_allocated(0) - base < 1 * MiB


def test_disk_offload_to_cuda_matches(tmp_path):
    model, ids, out = reference(d=256)
    disk_offload(model, tmp_path / "offload", execution_device=0)
    assert list((tmp_path / "offload").glob("*.safetensors"))
    assert model.blocks[0].fc1.weight.device.type == "meta"
    for _ in range(2):
        torch.testing.assert_close(model(ids), out, rtol=1e-5, atol=1e-5)


def test_cpu_offload_with_hook_moves_models_in_and_out_of_the_gpu():
    torch.manual_seed(0)
    first, second = nn.Linear(1024, 1024), nn.Linear(1024, 1024)
    x = torch.randn(4, 1024)
    with torch.no_grad():
        expected = second(first(x))
    base = torch.cuda.memory_allocated(0)
    first, hook1 = cpu_offload_with_hook(first, 0)
    second, hook2 = cpu_offload_with_hook(second, 0, prev_module_hook=hook1)
    with torch.no_grad():
        hidden = first(x)
        assert first.weight.device.type == "cuda" and hidden.device.type == "cuda"
        result = second(hidden)
    assert first.weight.device.type == "cpu"  # sent back when the next model ran
    assert second.weight.device.type == "cuda"
    torch.testing.assert_close(result.cpu(), expected, rtol=1e-5, atol=1e-5)
    del hidden, result
    hook2.offload()
    assert second.weight.device.type == "cpu"
    assert torch.cuda.memory_allocated(0) - base < 1 * MiB


# -- memory numbers --------------------------------------------------------------------------
def test_memory_sampler_reports_this_gpus_allocated_reserved_and_peak():
    from nbaccel.notebook.kernel.widgets.memory_monitor import MemoryMonitor
    from nbaccel.notebook.rank.memory_sampler import sample_memory

    torch.cuda.reset_peak_memory_stats(0)
    block = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda:0")
    sample = sample_memory()
    assert sample.cuda["device"] == 0
    assert sample.cuda["allocated"] == torch.cuda.memory_allocated(0) >= 128 * MiB
    assert sample.cuda["reserved"] == torch.cuda.memory_reserved(0) >= sample.cuda["allocated"]
    assert sample.cuda["peak"] == torch.cuda.max_memory_allocated(0) >= 128 * MiB
    assert sample.cuda["total"] == torch.cuda.get_device_properties(0).total_memory
    del block
    after = sample_memory()
    assert after.cuda["allocated"] <= sample.cuda["allocated"] - 128 * MiB
    assert after.cuda["peak"] == sample.cuda["peak"]  # the peak is kept
    monitor = MemoryMonitor()
    monitor.update(0, sample)
    monitor.update(0, after)
    ((rank, _host, device),) = monitor.summary_rows()
    assert rank == 0 and device.startswith("cuda ") and "reserved" in device


FACTORY = """import torch
from torch import nn

def build():
    return nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8)))
"""


def test_estimate_memory_command_against_the_measured_peak(tmp_path):
    (tmp_path / "factory_for_estimate.py").write_text(FACTORY)
    done = subprocess.run(
        [sys.executable, "-m", "nbaccel.cli", "estimate-memory", "factory_for_estimate:build"]
        + ["--dtypes", "float32", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)["rows"]
    sys.path.insert(0, str(tmp_path))
    try:
        from factory_for_estimate import build
    finally:
        sys.path.remove(str(tmp_path))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(0)
    torch.cuda.reset_peak_memory_stats(0)
    model = build().to("cuda:0")
    weights = torch.cuda.memory_allocated(0) - base
    assert row["total"] <= weights <= row["total"] * 1.01  # the allocator rounds each tensor up
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)
    model(torch.randn(2, 1024, device="cuda:0")).sum().backward()
    optimizer.step()
    peak = torch.cuda.max_memory_allocated(0) - base
    # weights + gradients + Adam's two moments (4x), plus one layer's temporaries and activations
    assert row["training"] <= peak <= row["training"] * 1.25, (peak, row["training"])
