"""``load_and_quantize_model`` on the CPU, judged against what we did not write: a transformers
Llama built from a config and saved locally, quantized through transformers' own
``BitsAndBytesConfig(device_map="cpu")`` path (bitwise equal logits, state dicts and greedy
generations), torchao's ``quantize_`` applied directly (bitwise equal), and the fp32 model
(agreement measured as the cosine of each position's logit vector and top-1 agreement over a
fixed prompt set of 8 prompts x 16 tokens). Offloading 8-bit weights over cpu + disk gives the
in-memory logits. The 1B-parameter check is ``scripts/test-lowbit``."""

from __future__ import annotations

import contextlib
import logging
import os

import pytest
import torch

pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")

from nbaccel.bigmodel import init_empty_weights  # noqa: E402
from nbaccel.bigmodel.quantization import (  # noqa: E402
    BnbQuantizationConfig,
    TorchAoConfig,
    get_keys_to_not_convert,
    get_quantized_model_device_map,
    load_and_quantize_model,
)

LLAMA = {
    "hidden_size": 256,
    "intermediate_size": 768,  # bitsandbytes' CPU 4-bit kernels pack rows in blocks of 128
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("llama"))
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts() -> torch.Tensor:
    return torch.randint(
        0, LLAMA["vocab_size"], (8, 16), generator=torch.Generator().manual_seed(3)
    )


def empty_llama(path: str):
    config = transformers.LlamaConfig.from_pretrained(path)
    with init_empty_weights():
        return transformers.LlamaForCausalLM(config)


def logits(model, prompts: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(prompts).logits


def reference(path: str, **bnb):
    quantization = transformers.BitsAndBytesConfig(**bnb)
    return transformers.LlamaForCausalLM.from_pretrained(
        path, quantization_config=quantization, device_map="cpu", dtype=torch.float32
    ).eval()


CASES = {
    "int8": (
        {"load_in_8bit": True},
        {"load_in_8bit": True, "torch_dtype": torch.float32},
    ),
    "nf4-double-quant": (
        {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
         "bnb_4bit_compute_dtype": torch.float32},
        {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
         "bnb_4bit_compute_dtype": torch.float32},
    ),
    "fp4": (
        {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4",
         "bnb_4bit_compute_dtype": torch.float32},
        {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_compute_dtype": "fp32"},
    ),
}  # fmt: skip

# measured on this model: int8 cos 0.9998 / top-1 0.96, nf4 0.98 / 0.73, fp4 0.96 / 0.63
# (random weights give nearly flat logits, so the arg-max flips easily at 4 bits)
AGREEMENT = {"int8": (0.999, 0.9), "nf4-double-quant": (0.95, 0.6), "fp4": (0.93, 0.5)}


@pytest.mark.parametrize("case", list(CASES))
def test_bitwise_equal_to_transformers_and_close_to_fp32(saved, prompts, case) -> None:
    theirs_options, ours_options = CASES[case]
    ours = load_and_quantize_model(
        empty_llama(saved), BnbQuantizationConfig(**ours_options), saved, device_map="cpu"
    ).eval()
    theirs = reference(saved, **theirs_options)
    layer = ours.model.layers[0].mlp.up_proj
    assert type(layer).__name__ == ("Linear8bitLt" if "8" in case else "Linear4bit")
    assert type(ours.lm_head).__name__ == "Linear"  # the output head stays unquantized
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    assert sorted(ours_state) == sorted(theirs_state)
    for name, tensor in theirs_state.items():
        assert torch.equal(ours_state[name], tensor), name
    got = logits(ours, prompts)
    assert torch.equal(got, logits(theirs, prompts))

    fp32 = transformers.LlamaForCausalLM.from_pretrained(saved).eval()
    want = logits(fp32, prompts)
    cosine = torch.nn.functional.cosine_similarity(got.flatten(0, 1), want.flatten(0, 1), dim=-1)
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    min_cos, min_top1 = AGREEMENT[case]
    assert cosine.mean().item() >= min_cos and top1 >= min_top1, (cosine.mean().item(), top1)

    weight_bytes = sum(t.numel() * t.element_size() for t in ours_state.values())
    fp32_bytes = sum(t.numel() * t.element_size() for t in fp32.state_dict().values())
    assert weight_bytes < (0.5 if "8" in case else 0.4) * fp32_bytes  # head+embeddings in fp32


def test_generate_matches_transformers(saved, prompts) -> None:
    ours = load_and_quantize_model(
        empty_llama(saved),
        BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=torch.float32),
        saved,
        device_map="cpu",
    ).eval()  # fmt: skip
    theirs = reference(
        saved, load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    options = {"max_new_tokens": 6, "do_sample": False}
    out = ours.generate(prompts[:2, :5], **options)
    assert out.shape == (2, 11)
    assert torch.equal(out, theirs.generate(prompts[:2, :5], **options))


def test_8bit_offloaded_over_cpu_and_disk_gives_the_in_memory_logits(saved, prompts, tmp_path):
    config = BnbQuantizationConfig(load_in_8bit=True, torch_dtype=torch.float32)
    in_memory = load_and_quantize_model(empty_llama(saved), config, saved, device_map="cpu")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "disk",
        "lm_head": "disk",
    }
    offloaded = load_and_quantize_model(
        empty_llama(saved), config, saved, device_map=device_map, offload_folder=tmp_path
    )
    weight = offloaded.model.layers[1].mlp.up_proj.weight
    assert weight.device.type == "meta" and weight.dtype == torch.int8  # quantized, on disk
    written = os.listdir(tmp_path)
    assert "model.layers.1.mlp.up_proj.weight.dat" in written
    assert "model.layers.1.mlp.up_proj.SCB.dat" in written
    assert os.path.getsize(tmp_path / "model.layers.1.mlp.up_proj.weight.dat") == 768 * 256
    assert offloaded.hf_device_map == device_map
    want = logits(in_memory.eval(), prompts)
    assert torch.equal(logits(offloaded.eval(), prompts), want)
    assert torch.equal(logits(offloaded, prompts), want)  # and again: loaded back each time
    assert offloaded.model.layers[1].mlp.up_proj.weight.device.type == "meta"


def test_torchao_int8_matches_torchao_used_directly(saved, prompts) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    ours = load_and_quantize_model(
        empty_llama(saved), TorchAoConfig("int8_weight_only"), saved, device_map="cpu"
    ).eval()
    direct = transformers.LlamaForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    quantize_(
        direct,
        Int8WeightOnlyConfig(),
        filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn != "lm_head",
    )
    assert type(ours.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"
    assert torch.equal(logits(ours, prompts), logits(direct, prompts))


def test_a_model_with_real_weights_is_quantized_from_its_own_tensors(saved, prompts) -> None:
    model = transformers.LlamaForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    config = BnbQuantizationConfig(load_in_8bit=True, torch_dtype=torch.float32)
    ours = load_and_quantize_model(model, config, device_map="cpu")
    theirs = reference(saved, load_in_8bit=True)
    assert torch.equal(logits(ours, prompts), logits(theirs, prompts))


def test_keys_to_not_convert_keep_the_head_and_tied_weights() -> None:
    tied = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True)
    untied = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=False)
    with init_empty_weights():
        assert set(get_keys_to_not_convert(transformers.LlamaForCausalLM(tied))) == {
            "lm_head",
            "model.embed_tokens",
        }
        assert get_keys_to_not_convert(transformers.LlamaForCausalLM(untied)) == ["lm_head"]
        assert get_keys_to_not_convert(transformers.LlamaModel(untied)) == []


def test_tied_head_stays_one_float_tensor(tmp_path, prompts) -> None:
    torch.manual_seed(1)
    config = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = load_and_quantize_model(
        empty_llama(str(tmp_path)),
        BnbQuantizationConfig(load_in_8bit=True, torch_dtype=torch.float32),
        str(tmp_path),
        device_map="cpu",
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float32
    assert torch.equal(
        logits(model.eval(), prompts), logits(reference(str(tmp_path), load_in_8bit=True), prompts)
    )


def test_device_maps_plan_with_quantized_sizes(saved) -> None:
    model = empty_llama(saved)
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    budget = {"cpu": int(0.6 * fp32_bytes)}
    from nbaccel.bigmodel import infer_auto_device_map

    assert "disk" in infer_auto_device_map(model, max_memory=budget).values()  # fp32: spills
    from nbaccel.bigmodel.quantization.bnb_layers import replace_with_bnb_layers

    config = BnbQuantizationConfig(load_in_4bit=True, torch_dtype=torch.float32)
    replace_with_bnb_layers(model, config, modules_to_not_convert=["lm_head"])
    plan = get_quantized_model_device_map(model, config, "auto", max_memory=budget)
    assert set(plan.values()) == {"cpu"}  # 4-bit layers at half a byte per weight: fits


def test_device_map_view_shows_quantized_bytes_and_formats(saved) -> None:
    from nbaccel.notebook.kernel.widgets.device_map_view import DeviceMapView

    fp32_bytes = sum(p.numel() * 4 for p in empty_llama(saved).parameters())
    config = BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    model = load_and_quantize_model(empty_llama(saved), config, saved, device_map="cpu")
    view = DeviceMapView(model)
    assert view.sizes[""] < 0.4 * fp32_bytes  # the packed 4-bit bytes, not the float shapes
    text = view.text()
    assert "holds: " in text and "4-bit nf4" in text and "float16" in text  # head in fp16
    assert "4-bit nf4" in view._repr_html_()


# -- quantizing on threads -----------------------------------------------------------------


@contextlib.contextmanager
def _one_core():
    """This thread limited to one core: ``load_threads()`` is 1, the load runs sequentially."""
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cores)


def _bits(model) -> dict[str, torch.Tensor]:
    """Every plain tensor behind the model's state (torchao's quantized tensors unpacked)."""
    out = {}
    for name, t in model.state_dict().items():
        if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
            for inner in t.__tensor_flatten__()[0]:
                out[f"{name}.{inner}"] = getattr(t, inner)
        else:
            out[name] = t
    return out


THREADED = {
    "torchao-int8": (lambda: TorchAoConfig("int8_weight_only"), "cpu"),
    "bnb-int8-disk": (
        lambda: BnbQuantizationConfig(load_in_8bit=True, torch_dtype=torch.float32),
        {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "disk",
         "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"},
    ),
    "nf4": (
        lambda: BnbQuantizationConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
            torch_dtype=torch.float32,
        ),
        "cpu",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(THREADED))
def test_threaded_quantizing_is_bitwise_the_sequential_load(saved, prompts, tmp_path, case, caplog):
    from nbaccel.bigmodel.loading.tensor_copies import load_threads

    config, device_map = THREADED[case]
    if load_threads() < 2:
        pytest.skip("one core: the threaded and sequential loads are the same run")
    loads, ran_on = {}, {}
    logger = "nbaccel.bigmodel.quantization.load_quantized"
    for run in ("threaded", "sequential"):
        folder = tmp_path / run
        caplog.clear()
        cores = _one_core() if run == "sequential" else contextlib.nullcontext()
        with caplog.at_level(logging.DEBUG, logger=logger), cores:
            loads[run] = load_and_quantize_model(
                empty_llama(saved), config(), saved, device_map=device_map, offload_folder=folder
            ).eval()
        ran_on[run] = [
            r.getMessage() for r in caplog.records if "weights quantized on" in r.message
        ]
    # every weight of a quantized layer went through the loading threads (none on this one)
    quantized = 7 * LLAMA["num_hidden_layers"]
    assert ran_on["threaded"][0].startswith(f"{quantized} weights quantized on "), ran_on
    assert f"of {load_threads()} threads" in ran_on["threaded"][0]
    assert "nbaccel-quantize" in ran_on["threaded"][0] and "MainThread" not in ran_on["threaded"][0]
    assert "on 1 of 1 threads" in ran_on["sequential"][0]
    threaded, sequential = _bits(loads["threaded"]), _bits(loads["sequential"])
    assert threaded.keys() == sequential.keys()
    for name, t in threaded.items():
        if t.device.type != "meta":
            assert torch.equal(t, sequential[name]), name
    written = sorted(os.listdir(tmp_path / "threaded")) if isinstance(device_map, dict) else []
    for name in written:  # the 8-bit weights and scales offloaded to disk
        a, b = (tmp_path / run / name for run in ("threaded", "sequential"))
        assert a.read_bytes() == b.read_bytes(), name
    if written:
        assert "model.layers.0.mlp.up_proj.SCB.dat" in written
    assert torch.equal(logits(loads["threaded"], prompts), logits(loads["sequential"], prompts))


@pytest.mark.parametrize("case", ["int8", "nf4-double-quant"])
def test_quantizing_from_the_staging_dry_run_gives_the_direct_bits(saved, case) -> None:
    """The GPU path's steps on the CPU: each weight streamed through the load's staging buffers
    (the dry run of the pinned path: ordinary buffers, no streams), then quantized from the
    staged copy, gives the bits of quantizing the mapped tensor directly."""
    from nbaccel.bigmodel.loading.tensor_copies import TensorCopies
    from nbaccel.bigmodel.quantization.bnb_layers import (
        is_quantized_layer,
        quantize_weight,
        replace_with_bnb_layers,
    )
    from nbaccel.storage.safetensors_file import SafetensorsFile

    config = BnbQuantizationConfig(**CASES[case][1])
    model = replace_with_bnb_layers(empty_llama(saved), config, ["lm_head"])
    handle = SafetensorsFile(os.path.join(saved, "model.safetensors"))
    copies, cpu = TensorCopies(), torch.device("cpu")
    stream = copies.stream(cpu)
    layers = [(n, m) for n, m in model.named_modules() if is_quantized_layer(m)]
    for name, module in layers:
        view = handle.view(f"{name}.weight")
        staged = stream.copy(view, config.torch_dtype)
        stream.ready()
        ours, direct = quantize_weight(module, staged, cpu), quantize_weight(module, view, cpu)
        assert torch.equal(ours.data, direct.data), name
        state = getattr(ours, "quant_state", None)
        if state is not None:
            assert torch.equal(state.absmax, direct.quant_state.absmax), name
        else:
            assert torch.equal(ours.SCB, direct.SCB), name
    assert stream.tensors == len(layers) > 0 and not stream.pinned
    copies.finish()
