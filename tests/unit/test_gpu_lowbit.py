"""GPU lane: quantized loading on CUDA and FP8 training on the GPU. bitsandbytes' CUDA 8-bit and
4-bit kernels through ``load_and_quantize_model`` against transformers' ``BitsAndBytesConfig``
path on cuda:0 (bitwise equal logits and quantized weights, every tensor streamed through the
load's pinned staging buffers: ``scripts/test-gpu -k pinned``); 8-bit weights offloaded to cpu
and disk beside cuda:0 give the in-memory logits; ``mixed_precision="fp8"`` with torchao on a
GPU of compute capability 8.9+ tracks the bf16 loss within 5% at every step; below 8.9 the
launch is refused before any rank starts, naming the hardware, and the emulation trains."""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")

from nbaccel.bigmodel import init_empty_weights  # noqa: E402
from nbaccel.bigmodel.quantization import BnbQuantizationConfig, load_and_quantize_model  # noqa: E402

LLAMA = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000,
         "tie_word_embeddings": False}  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("llama"))
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(path)
    return path


def empty(path: str):
    with init_empty_weights():
        return transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(path))


def logits(model, x):
    with torch.no_grad():
        return model(x.to(model.device if hasattr(model, "device") else "cuda:0")).logits.cpu()


PROMPTS = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(2))
OPTIONS = {
    "int8": {"load_in_8bit": True},
    "nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_compute_dtype": torch.float16},
}  # fmt: skip


@pytest.mark.parametrize("mode", list(OPTIONS))
def test_cuda_kernels_match_transformers(saved, mode) -> None:
    options = OPTIONS[mode]
    ours = load_and_quantize_model(
        empty(saved), BnbQuantizationConfig(**options, torch_dtype=torch.float16), saved,
        device_map={"": 0},
    ).eval()  # fmt: skip
    assert ours.model.layers[0].mlp.up_proj.weight.device.type == "cuda"
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        saved, quantization_config=transformers.BitsAndBytesConfig(**options),
        device_map={"": 0}, dtype=torch.float16,
    ).eval()  # fmt: skip
    assert torch.equal(logits(ours, PROMPTS), logits(theirs, PROMPTS))


def test_8bit_offloaded_beside_cuda_gives_in_memory_logits(saved, tmp_path) -> None:
    config = BnbQuantizationConfig(load_in_8bit=True, torch_dtype=torch.float16)
    in_memory = load_and_quantize_model(empty(saved), config, saved, device_map={"": 0}).eval()
    split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": "cpu",
             "model.layers.1": "disk", "model.norm": 0, "lm_head": 0}  # fmt: skip
    offloaded = load_and_quantize_model(
        empty(saved), config, saved, device_map=split, offload_folder=tmp_path
    ).eval()
    assert offloaded.model.layers[0].mlp.up_proj.weight.device.type == "meta"
    assert torch.equal(logits(offloaded, PROMPTS), logits(in_memory, PROMPTS))


def _quantized_bits(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every quantized layer's weight bytes and scales (absmax for 4-bit, SCB for 8-bit)."""
    out = {}
    for name, module in model.named_modules():
        if type(module).__name__ in ("Linear4bit", "Linear8bitLt"):
            weight = module.weight
            state = getattr(weight, "quant_state", None)
            scales = state.absmax if state is not None else weight.SCB
            out[name] = (weight.data.cpu(), scales.cpu())
    return out


@pytest.mark.parametrize("mode", list(OPTIONS))
def test_quantized_load_streams_through_pinned_staging_bitwise_as_transformers(
    saved, mode, caplog
) -> None:
    """Every tensor reaches cuda:0 through the load's pinned HostToDevice stream (its counter,
    logged when the stream finishes, names each tensor of the checkpoint), and the weights
    quantized there are transformers' bit for bit."""
    from nbaccel.storage.safetensors_file import SafetensorsFile

    options = OPTIONS[mode]
    caplog.set_level(logging.DEBUG, logger="nbaccel.bigmodel.loading.host_to_device")
    ours = load_and_quantize_model(
        empty(saved), BnbQuantizationConfig(**options, torch_dtype=torch.float16), saved,
        device_map={"": 0},
    ).eval()  # fmt: skip
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        saved, quantization_config=transformers.BitsAndBytesConfig(**options),
        device_map={"": 0}, dtype=torch.float16,
    ).eval()  # fmt: skip
    staged = [r.getMessage() for r in caplog.records if "through pinned buffers" in r.getMessage()]
    assert len(staged) == 1 and "staged to cuda:0" in staged[0], staged
    in_file = len(SafetensorsFile(f"{saved}/model.safetensors").entries)
    assert int(staged[0].split()[0]) == in_file  # every tensor took the pinned path
    mine, peer = _quantized_bits(ours), _quantized_bits(theirs)
    assert mine.keys() == peer.keys() and mine
    assert ours.model.layers[0].mlp.up_proj.weight.device.type == "cuda"
    for name, (data, scales) in mine.items():
        assert torch.equal(data, peer[name][0]) and torch.equal(scales, peer[name][1]), name
    assert torch.equal(logits(ours, PROMPTS), logits(theirs, PROMPTS))


def _fp8_losses(emulate):
    from torch import nn

    from nbaccel import Accelerator
    from nbaccel.distributed.state import AcceleratorState
    from nbaccel.training.precision.fp8.recipes import AORecipeKwargs

    losses = {}
    for precision in ("bf16", "fp8"):
        AcceleratorState._reset_state(True)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                            nn.Linear(256, 16))  # fmt: skip
        handlers = [AORecipeKwargs(emulate=emulate)] if precision == "fp8" else []
        accelerator = Accelerator(mixed_precision=precision, kwargs_handlers=handlers)
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
        net, opt = accelerator.prepare(net, opt)
        g = torch.Generator().manual_seed(1)
        xs = torch.randn(8, 32, 64, generator=g)
        ys = torch.tanh(xs @ torch.randn(64, 16, generator=g) / 8)
        run = []
        for x, y in zip(xs, ys, strict=True):
            loss = nn.functional.mse_loss(net(x.to(accelerator.device)), y.to(accelerator.device))
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses[precision] = run
    return losses


def test_fp8_on_the_gpu() -> None:
    from nbaccel.distributed.host_info import check_fp8_launch

    if torch.cuda.get_device_capability() >= (8, 9):
        losses = _fp8_losses(emulate=False)
    else:
        with pytest.raises(RuntimeError, match=r"compute capability 8\.9.*sm_"):
            check_fp8_launch("fp8", cpu=False)
        losses = _fp8_losses(emulate=True)
    for a, b in zip(losses["fp8"], losses["bf16"], strict=True):
        assert abs(a - b) <= 0.05 * abs(b)
