"""GPU lane: a checkpoint streamed onto cuda:0 through pinned staging buffers. A transformers
Llama built from a config and saved locally, loaded by ``load_checkpoint_and_dispatch`` onto
cuda:0 (fp32 and cast to bf16) gives transformers' own logits bit for bit, and the load's peak
host memory stays far below the model's size (no host copy of a shard is made). Short: a model
of ~60M parameters. ``python benchmarks/bench_load.py --gpu --size 0.5b`` times the same path.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

_CHILD = r"""
import json, sys, torch, transformers
from nbaccel.bigmodel import init_empty_weights, load_checkpoint_and_dispatch
folder, dtype = sys.argv[1], getattr(torch, sys.argv[2])
torch.zeros(1, device="cuda:0")  # the CUDA context before the baseline
def kb(field):
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) for l in status if l.startswith(field + ":"))
config = transformers.AutoConfig.from_pretrained(folder)
with init_empty_weights():
    empty = transformers.LlamaForCausalLM(config)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from here
base = kb("VmRSS")
model = load_checkpoint_and_dispatch(empty, folder, device_map={"": 0}, dtype=dtype)
torch.cuda.synchronize()
print(json.dumps({"peak_growth_kb": kb("VmHWM") - base,
                  "devices": sorted({str(p.device) for p in model.parameters()})}))
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="60MB")
    return transformers, folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_load_gives_transformers_logits(llama, dtype):
    from nbaccel.bigmodel import init_empty_weights, load_checkpoint_and_dispatch

    transformers, folder = llama
    ids = torch.tensor([[1, 306, 4658, 278, 6593, 310, 2834, 338]], device="cuda:0")
    peer = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype, device_map="cuda:0")
    with torch.no_grad():
        expected = peer(ids).logits
    del peer
    config = transformers.AutoConfig.from_pretrained(folder)
    with init_empty_weights():
        empty = transformers.LlamaForCausalLM(config)
    model = load_checkpoint_and_dispatch(empty, str(folder), device_map={"": 0}, dtype=dtype)
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    with torch.no_grad():
        got = model.eval()(ids).logits
    assert torch.equal(got, expected)


def test_streamed_load_peak_host_memory_is_bounded(llama):
    from nbaccel.storage.safetensors_file import SafetensorsFile

    _, folder = llama
    files = [SafetensorsFile(p) for p in folder.glob("*.safetensors")]
    size_kb = sum(p.stat().st_size for p in folder.glob("*.safetensors")) // 1024
    largest_kb = max(end - begin for f in files for *_, begin, end in f.entries.values()) // 1024
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder), "float32"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["devices"] == ["cuda:0"]
    # two 32 MiB pinned staging buffers and the mapped pages of the tensor in flight (released
    # once it is sent), some slack: not the model (a host copy would be all of it)
    bound_kb = 64 * 1024 + largest_kb + 32 * 1024
    assert bound_kb < size_kb
    assert figures["peak_growth_kb"] < bound_kb, figures


def test_staging_in_pieces_on_a_side_stream_is_exact():
    from nbaccel.bigmodel.loading.host_to_device import HostToDevice

    torch.manual_seed(0)
    tensors = [torch.randn(1000, 1000), torch.randn(3, 5), torch.randn(2500, 700)]
    stream = HostToDevice("cuda:0", buffer_bytes=1 << 20, buffers=2)  # many pieces each
    out = [stream.copy(t) for t in tensors] + [stream.copy(tensors[0], torch.bfloat16)]
    stream.finish()
    for got, want in zip(out, [*tensors, tensors[0].to(torch.bfloat16)], strict=True):
        assert got.device.type == "cuda"
        assert torch.equal(got.cpu(), want)
