"""Accelerator in one process: mixed precision policies, clear errors, model saving, utilities."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from nbaccel import (
    Accelerator,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    ProfileKwargs,
    find_executable_batch_size,
)
from nbaccel.storage.weights import load_model_weights
from nbaccel.training.precision.fp8.recipes import FP8RecipeKwargs
from nbaccel.values.sizes import parse_size


def test_unsupported_backends_are_refused_clearly():
    with pytest.raises(TypeError, match="DeepSpeedPlugin objects"):
        Accelerator(deepspeed_plugin=object())
    with pytest.raises(ValueError, match="MS-AMP is not supported"):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend="msamp")])
    with pytest.raises(ValueError, match="Unknown mixed_precision 'fp4'"):
        Accelerator(mixed_precision="fp4")


def test_bad_configuration_is_refused_clearly():
    with pytest.raises(ValueError, match="either gradient_accumulation_steps"):
        Accelerator(
            gradient_accumulation_steps=2,
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
        )
    with pytest.raises(TypeError, match="Unsupported kwargs handler"):
        Accelerator(kwargs_handlers=[object()])
    with pytest.raises(ValueError, match="Only one DistributedDataParallelKwargs"):
        Accelerator(
            kwargs_handlers=[DistributedDataParallelKwargs(), DistributedDataParallelKwargs()]
        )
    with pytest.raises(ValueError, match="comm_hook"):
        DistributedDataParallelKwargs(comm_hook="zip")
    acc = Accelerator()
    with pytest.raises(ValueError, match=r"Item at index 0 \(int\).*state_dict"):
        acc.register_for_checkpointing(3)
    with pytest.raises(ValueError, match="output_dir"):
        acc.save_state()
    with pytest.raises(ValueError, match="Unknown tracker"):
        Accelerator(log_with="nope")


def test_fp16_scaler_skips_overflowing_steps_and_holds_the_schedule():
    acc = Accelerator(mixed_precision="fp16")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    x = torch.randn(8, 4)
    assert model(x).dtype == torch.float32  # autocast inside, float32 out
    before = model.weight.detach().clone()
    scale = acc.scaler.get_scale()
    acc.backward(model(x).sum() * float("inf"))  # overflowing gradients
    opt.step()
    sched.step()
    opt.zero_grad()
    assert acc.optimizer_step_was_skipped
    assert torch.equal(model.weight, before)
    assert acc.scaler.get_scale() == scale / 2
    assert sched.get_last_lr() == [0.1]
    acc.backward(model(x).pow(2).mean())
    norm = acc.clip_grad_norm_(model.parameters(), 1e-3)  # unscales first
    assert torch.isfinite(norm) and norm < 1e3  # an unscaled norm, not a 32768x one
    opt.step()
    sched.step()
    assert not acc.optimizer_step_was_skipped
    assert not torch.equal(model.weight, before)
    assert sched.get_last_lr() == [0.05]


def test_autocast_block_and_bf16_on_cpu():
    acc = Accelerator(mixed_precision="bf16")
    assert acc.scaler is None
    with acc.autocast():
        out = torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3))
    assert out.dtype == torch.bfloat16
    model = acc.prepare(torch.nn.Linear(3, 3))
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    with torch.no_grad():
        assert plain(torch.randn(2, 3)).dtype == torch.float32
        assert "forward" not in plain.__dict__


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


def test_save_model_shards_and_tied_weights(tmp_path):
    acc = Accelerator()
    model = acc.prepare(_Tied())
    (tmp_path / "config.json").write_text("{}")
    acc.save_model(model, tmp_path, max_shard_size="3KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tmp_path / s).exists() for s in shards)
    assert "head.weight" not in index["weight_map"]  # the tied twin is written once
    assert index["metadata"]["tied_weights"] == {"head.weight": "embed.weight"}
    assert (tmp_path / "config.json").exists()  # other files survive the atomic rewrite
    stored = {}
    for shard in shards:
        stored.update(load_file(str(tmp_path / shard)))
    assert torch.equal(stored["embed.weight"], model.embed.weight.detach())
    fresh = _Tied()
    load_model_weights(fresh, tmp_path)
    assert torch.equal(fresh.head.weight, model.head.weight)
    assert fresh.head.weight is fresh.embed.weight
    # rewrite as one file: stale shards disappear
    acc.save_model(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == [
        "config.json",
        "model.safetensors",
        "model.safetensors.tied.json",
    ]
    with pytest.raises(KeyError, match="missing keys"):
        load_model_weights(torch.nn.Linear(2, 2), tmp_path)
    assert parse_size("10GB") == 10**10 and parse_size("2KiB") == 2048
    with pytest.raises(ValueError):
        parse_size("lots")


def test_find_executable_batch_size_shrinks_to_90_percent_on_oom():
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return batch_size * scale

    assert train(2) == 30
    # Accelerate's rule: 90% of the size each time (int(64 * 0.9) = 57, ...).
    assert tried == [64, 57, 51, 45, 40, 36, 32, 28, 25, 22, 19, 17, 15]
    with pytest.raises(TypeError, match="Remove it"):
        train(8, 2)

    @find_executable_batch_size(starting_batch_size=4)
    def never(batch_size):
        raise RuntimeError("CUDA out of memory.")

    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero."):
        never()

    sizes = iter([10, 3])

    @find_executable_batch_size(starting_batch_size=20, reduce_batch_size_fn=lambda: next(sizes))
    def custom(batch_size):  # Accelerate's custom rules take no argument
        if batch_size > 3:
            raise torch.OutOfMemoryError("out of memory")
        return batch_size

    assert custom() == 3

    @find_executable_batch_size(starting_batch_size=4)
    def other(batch_size):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        other()


def test_trackers_profile_and_free_memory(tmp_path):
    acc = Accelerator(log_with="jsonl", project_dir=tmp_path)
    acc.init_trackers("run1", config={"lr": 0.1})
    acc.log({"loss": torch.tensor(0.5), "acc": 1}, step=3)
    acc.end_training()
    lines = (tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert record["loss"] == 0.5 and record["step"] == 3
    assert json.loads((tmp_path / "run1" / "config.json").read_text()) == {"lr": 0.1}
    model = acc.prepare(torch.nn.Linear(2, 2))
    trace_dir = tmp_path / "trace"
    with acc.profile(ProfileKwargs(output_trace_dir=str(trace_dir))) as prof:
        model(torch.randn(3, 2))
    assert "aten::addmm" in prof.key_averages().table()
    assert (trace_dir / "profile_0.json").exists()
    assert acc._models
    acc.free_memory()
    assert acc._models == [] and acc.step == 0


def test_accumulate_in_one_process_matches_big_batch():
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.arange(1.0, 9.0)
    y = 2 * x
    acc = Accelerator(gradient_accumulation_steps=4)
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    for xb, yb in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(xb[:, None]), yb[:, None]))
            opt.step()
            opt.zero_grad()
    # the documented example: one step over all 8 samples
    assert model.weight.item() == pytest.approx(2.04, abs=1e-5)


def test_save_model_output_loads_with_load_checkpoint_in_model(tmp_path):
    from nbaccel.bigmodel.loading.checkpoint import load_checkpoint_in_model

    acc = Accelerator()
    model = acc.prepare(_Tied())
    acc.save_model(model, tmp_path / "sharded", max_shard_size="3KB")
    acc.save_model(model, tmp_path / "single")
    for directory in ("sharded", "single"):
        fresh = _Tied()
        load_checkpoint_in_model(fresh, tmp_path / directory, strict=True)
        for (name, got), want in zip(fresh.state_dict().items(), model.state_dict().values()):
            assert torch.equal(got, want), name
        assert fresh.head.weight is fresh.embed.weight


def test_dynamo_backend_compiles_and_unwraps():
    acc = Accelerator(dynamo_backend="eager")
    model = acc.prepare(torch.nn.Linear(3, 3))
    assert hasattr(model, "_orig_mod")
    assert model(torch.randn(2, 3)).shape == (2, 3)
    assert type(acc.unwrap_model(model, keep_torch_compile=False)) is torch.nn.Linear
