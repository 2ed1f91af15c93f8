"""Several models and a transformers model under DeepSpeed on 2 CPU ranks (real DeepSpeed, gloo).

- Knowledge distillation as the multiple-models guide does it: ``deepspeed_plugins={"student":
  ZeRO-2, "teacher": ZeRO-3}``, the student trained against a ZeRO-3 teacher, equal to one process.
- Two disjoint models with two Accelerators, each equal to its one-process run.
- A small Llama built from a config (no hub) under ``zero3_init_flag``: born partitioned, trains,
  ``GatheredParameters`` shows a whole weight, and its gathered state dict loaded into a plain
  model gives the engine's logits. One multi-process start for the file."""

import pytest
import torch
from _deepspeed_cases import ENV, Net, config, dataset
from torch import nn
from torch.utils.data import DataLoader

from nbaccel.testing import run_on_ranks

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

STEPS = 4


def _teacher() -> nn.Module:
    torch.manual_seed(1)
    return Net(width=32)


def _distillation(out):
    from nbaccel import Accelerator, DeepSpeedPlugin
    from nbaccel.utils import get_active_deepspeed_plugin

    inference = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    plugins = {
        "student": DeepSpeedPlugin(hf_ds_config=config(2)),
        "teacher": DeepSpeedPlugin(hf_ds_config=inference),
    }
    accelerator = Accelerator(deepspeed_plugins=plugins)
    out["active_is_student"] = get_active_deepspeed_plugin(accelerator.state) is plugins["student"]
    out["accelerator_plugin"] = accelerator.deepspeed_plugin is plugins["student"]
    torch.manual_seed(0)
    student = Net()
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    loader = DataLoader(dataset(), batch_size=8)
    student, optimizer, loader = accelerator.prepare(student, optimizer, loader)
    accelerator.state.select_deepspeed_plugin("teacher")
    out["teacher_selected"] = accelerator.deepspeed_plugin is plugins["teacher"]
    teacher = accelerator.prepare(_teacher())
    out["teacher_partitioned"] = all(hasattr(p, "ds_id") for p in teacher.parameters())
    teacher.eval()
    losses = []
    for i, (x, _) in enumerate(loader):
        if i == STEPS:
            break
        with torch.no_grad():
            target = teacher(x)
        loss = nn.functional.mse_loss(student(x), target)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    out["distillation"] = losses


def _disjoint(out):
    from nbaccel import Accelerator, DeepSpeedPlugin

    plugins = {
        "first": DeepSpeedPlugin(hf_ds_config=config(2)),
        "second": DeepSpeedPlugin(hf_ds_config=config(3)),
    }
    first = Accelerator(deepspeed_plugins=plugins)
    second = Accelerator()  # shares the state, and so the plugins
    results = []
    for accelerator, name, lr in ((first, "first", 1e-2), (second, "second", 5e-3)):
        accelerator.state.select_deepspeed_plugin(name)
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        loader = DataLoader(dataset(), batch_size=8)
        results.append([accelerator, *accelerator.prepare(model, optimizer, loader)])
    losses = {"first": [], "second": []}
    batches = zip(results[0][3], results[1][3], strict=True)
    for i, ((x1, y1), (x2, y2)) in enumerate(batches):
        if i == STEPS:
            break
        for (accelerator, model, optimizer, _), name, (x, y) in zip(
            results, losses, ((x1, y1), (x2, y2)), strict=True
        ):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(accelerator.gather(loss.detach()).mean().item())
    out["disjoint"] = losses
    out["disjoint_stages"] = [r[1].zero_optimization_stage() for r in results]


def _llama(out):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from nbaccel import Accelerator, DeepSpeedPlugin
    from nbaccel.utils import GatheredParameters

    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    zero3 = config(3)
    zero3["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    plugin = DeepSpeedPlugin(hf_ds_config=zero3, zero3_init_flag=True)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    weight = model.model.embed_tokens.weight
    out["born_partitioned"] = (weight.numel(), weight.ds_numel, weight.ds_tensor.numel())
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 96, (32, 16), generator=g)
    loader = DataLoader(tokens, batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _ in range(3):
        for batch in loader:
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()).mean().item())
    out["llama_losses"] = losses
    probe = tokens[:2]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    embed = accelerator.unwrap_model(model).model.embed_tokens.weight
    with GatheredParameters([embed]):
        out["gathered_shape"] = tuple(embed.shape)
        whole = embed.detach().clone()
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        with plugin.zero3_init_context_manager(enable=False):
            plain = AutoModelForCausalLM.from_config(cfg)
        plain.load_state_dict(state, strict=False)
        plain.tie_weights()
        plain.eval()
        with torch.no_grad():
            want = plain(input_ids=probe).logits
        out["plain_partitioned"] = any(hasattr(p, "ds_id") for p in plain.parameters())
        out["logits_diff"] = (logits - want).abs().max().item()
        out["embed_diff"] = (state["model.embed_tokens.weight"] - whole).abs().max().item()
        out["state_keys"] = len(state)


def _all(_):
    out = {}
    _distillation(out)
    _disjoint(out)
    _llama(out)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_all, 2, args=(None,), timeout=420, env=ENV)


def _one_process(lr: float, teacher: nn.Module | None = None) -> list[float]:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for i, (x, y) in enumerate(DataLoader(dataset(), batch_size=16)):
        if i == STEPS:
            break
        target = y if teacher is None else teacher(x).detach()
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_distillation_with_two_plugins_matches_one_process(ranks):
    out = ranks[0]
    assert out["active_is_student"] and out["accelerator_plugin"] and out["teacher_selected"]
    assert out["teacher_partitioned"]
    want = _one_process(1e-2, teacher=_teacher())
    assert out["distillation"] == pytest.approx(want, abs=1e-5)


def test_disjoint_models_with_two_accelerators_match_one_process(ranks):
    out = ranks[0]
    assert out["disjoint_stages"] == [2, 3]
    assert out["disjoint"]["first"] == pytest.approx(_one_process(1e-2), abs=1e-5)
    assert out["disjoint"]["second"] == pytest.approx(_one_process(5e-3), abs=1e-5)


def test_transformers_model_is_built_partitioned_and_gathers_back(ranks):
    out = ranks[0]
    numel, full, local = out["born_partitioned"]
    assert numel == 0 and full == 96 * 32 and local == full // 2  # half on each rank
    assert out["gathered_shape"] == (96, 32)
    losses = out["llama_losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert not out["plain_partitioned"]
    assert out["embed_diff"] == 0.0
    assert out["logits_diff"] < 1e-5
    assert ranks[1]["llama_losses"] == losses
