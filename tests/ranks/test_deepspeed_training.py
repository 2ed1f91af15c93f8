"""``Accelerator(deepspeed_plugin=...)`` on 2 CPU ranks (real DeepSpeed, gloo), against references
nbaccel did not write: ZeRO stages 0-3 give the one-process losses and weights; gradient
accumulation too; a config with its own optimizer and scheduler (DummyOptim / DummyScheduler)
gives exactly the losses of ``deepspeed.initialize`` driven directly with the same config;
``save_state`` / ``load_state`` resume equal to the uninterrupted run, in DeepSpeed's layout;
ZeRO-3's gathered state dict and ``save_model`` equal the unsharded model; the memory view shows
ZeRO-3 holding at most 0.6x DDP's parameter + optimizer bytes, as torch and DeepSpeed count them.
One multi-process start for the file."""

import copy
import os

import pytest
import torch
from _deepspeed_cases import ENV, Net, config, dataset, max_diff, reference
from torch import nn
from torch.utils.data import DataLoader

from nbaccel.testing import run_on_ranks

pytest.importorskip("deepspeed")

STEPS = 4  # 64 samples, 8 per rank and step, 2 ranks


def _train(accelerator, model, optimizer, loader, steps, scheduler=None, skip=0):
    losses = []
    for i, (x, y) in enumerate(loader):
        if i < skip:
            continue
        if i == steps:
            break
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    return losses


def _fresh(plugin_config, **accelerator_options):
    from nbaccel import Accelerator, DeepSpeedPlugin

    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=plugin_config), **accelerator_options
    )
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset(), batch_size=8)
    return accelerator, *accelerator.prepare(model, optimizer, loader)


def _stages(out, root):
    for stage in (0, 1, 2, 3):
        accelerator, model, optimizer, loader = _fresh(config(stage))
        losses = _train(accelerator, model, optimizer, loader, STEPS)
        weights = accelerator.get_state_dict(model)
        out[f"stage{stage}"] = (losses, weights, type(model).__name__)
    out["stage3_engine"] = (model, optimizer)
    saved = f"{root}-model"
    accelerator.save_model(model, saved)  # ZeRO-3 weights gathered, written by rank 0
    out["saved"] = sorted(os.listdir(saved)) if accelerator.is_main_process else None
    if accelerator.is_main_process:
        from safetensors.torch import load_file

        out["saved_diff"] = max_diff(load_file(f"{saved}/model.safetensors"), weights)
    # ZeRO-3 with the optimizer state and the parameters offloaded to the CPU, stepped by the
    # torch optimizer (DeepSpeedCPUAdam, which JIT-builds for minutes, is the lane's)
    offload = config(3, zero_force_ds_cpu_optimizer=False)
    offload["zero_optimization"].update(
        offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}
    )
    accelerator, model, optimizer, loader = _fresh(offload)
    losses = _train(accelerator, model, optimizer, loader, STEPS)
    out["offload"] = (losses, accelerator.get_state_dict(model), type(model).__name__)


def _accumulation(out):
    accelerator, model, optimizer, loader = _fresh(config(2), gradient_accumulation_steps=2)
    losses = _train(accelerator, model, optimizer, loader, STEPS)
    out["accumulation"] = (losses, accelerator.get_state_dict(model),
                           accelerator.deepspeed_config["gradient_accumulation_steps"])  # fmt: skip


def _with_config_optimizer(out):
    """A config that defines the optimizer and scheduler, through nbaccel and directly."""
    import deepspeed

    from nbaccel import Accelerator, DeepSpeedPlugin
    from nbaccel.utils import DummyOptim, DummyScheduler

    extra = {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                  "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                      "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    }  # fmt: skip
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config(3, **extra)))
    torch.manual_seed(0)
    model = Net()
    optimizer = DummyOptim(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = DummyScheduler(optimizer, warmup_num_steps=2)
    loader = DataLoader(dataset(), batch_size=8)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    ours = _train(accelerator, model, optimizer, loader, STEPS, scheduler)
    resolved = copy.deepcopy(accelerator.deepspeed_config)
    # DeepSpeed driven directly with the same (resolved) config, each rank its share of batches
    torch.manual_seed(0)
    plain = Net()
    engine, *_ = deepspeed.initialize(
        model=plain, model_parameters=plain.parameters(), config=copy.deepcopy(resolved)
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    direct = []
    for i, (x, y) in enumerate(DataLoader(dataset(), batch_size=8)):
        if i // world == STEPS:
            break
        if i % world != rank:
            continue
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        direct.append(accelerator.gather(loss.detach()).mean().item())
    out["config_optimizer"] = (ours, direct, resolved, type(scheduler).__name__)


def _resume(out, root):
    accelerator, model, optimizer, loader = _fresh(config(2))
    first = _train(accelerator, model, optimizer, loader, 2)
    accelerator.save_state(root)
    later = _train(accelerator, model, optimizer, loader, STEPS, skip=2)
    accelerator2, model2, optimizer2, loader2 = _fresh(config(2))
    accelerator2.load_state(root)
    resumed = _train(accelerator2, model2, optimizer2, loader2, STEPS, skip=2)
    out["resume"] = (first, later, resumed, sorted(os.listdir(root)),
                     sorted(os.listdir(os.path.join(root, "pytorch_model"))))  # fmt: skip


def _memory(out, engine, optimizer):
    """ZeRO-3's engine vs a DDP model of the same size, as the memory view counts them."""
    import deepspeed

    from nbaccel import gather_training_memory

    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    x = torch.randn(4, 64)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(big))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    ddp(x).sum().backward()
    ddp_opt.step()
    ddp_view = gather_training_memory(ddp, ddp_opt)
    # DeepSpeed keeps parameters under stage3_param_persistence_threshold (1e5 elements by
    # default) whole on every rank; this small model's layers are all below it
    cfg = config(3, train_micro_batch_size_per_gpu=4)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    cfg.update(train_batch_size=8, gradient_accumulation_steps=1)
    twin = copy.deepcopy(big)
    z3, z3_opt, *_ = deepspeed.initialize(
        model=twin,
        optimizer=torch.optim.AdamW(twin.parameters(), lr=1e-3),
        config={**cfg, "zero_allow_untested_optimizer": True},
    )
    loss = z3(x).sum()
    z3.backward(loss)
    z3.step()
    z3_view = gather_training_memory(z3)
    inner = z3.optimizer.optimizer
    out["memory"] = {
        "ddp": ddp_view[0],
        "z3": z3_view[0],
        "z3_rank1": z3_view[1],
        "torch_params": sum(p.numel() * p.element_size() for p in ddp.parameters()),
        "torch_optimizer": sum(
            t.numel() * t.element_size()
            for s in ddp_opt.state.values()
            for t in s.values()
            if torch.is_tensor(t)
        ),
        "ds_params": sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in z3.parameters()),
        "ds_optimizer": sum(
            t.numel() * t.element_size()
            for s in inner.state.values()
            for t in s.values()
            if torch.is_tensor(t)
        ),
        "text": repr(z3_view),
    }


def _bf16(out):
    """mixed_precision="bf16" fills the config's bf16 section; DeepSpeed's CPU accelerator runs
    it."""
    from nbaccel.distributed.state import AcceleratorState

    AcceleratorState._reset_state()  # a new mixed precision for this process (the group stays)
    accelerator, model, optimizer, loader = _fresh(config(2), mixed_precision="bf16")
    losses = []
    for i, (x, y) in enumerate(loader):
        if i == STEPS:
            break
        loss = nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    dtype = str(next(accelerator.unwrap_model(model).parameters()).dtype)
    out["bf16"] = (losses, accelerator.deepspeed_config["bf16"], dtype, accelerator.mixed_precision)


def _all_checks(root):
    out = {}
    _stages(out, root)
    engine, optimizer = out.pop("stage3_engine")
    _accumulation(out)
    _with_config_optimizer(out)
    _resume(out, f"{root}-state")
    _memory(out, engine, optimizer)
    _bf16(out)
    from nbaccel.distributed.state import PartialState

    if not PartialState().is_main_process:  # weights are gathered to rank 0
        for key in ("stage0", "stage1", "stage2", "stage3", "offload", "accumulation"):
            out[key] = (out[key][0], None, *out[key][2:])
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ds") / "run")
    return run_on_ranks(_all_checks, 2, args=(root,), timeout=420, env=ENV)


def test_each_zero_stage_and_cpu_offload_match_one_process(ranks):
    want_losses, want_weights = reference(STEPS)
    for stage in ("stage0", "stage1", "stage2", "stage3", "offload"):
        losses, weights, kind = ranks[0][stage]
        assert kind == "DeepSpeedEngine"
        assert losses == pytest.approx(want_losses, abs=1e-5), stage
        assert max_diff(weights, want_weights) < 1e-5, stage
        assert ranks[1][stage][0] == losses  # every rank saw the same mean loss


def test_save_model_writes_the_gathered_zero3_weights(ranks):
    assert ranks[0]["saved"] == ["model.safetensors"] and ranks[0]["saved_diff"] == 0.0
    assert ranks[1]["saved"] is None


def test_gradient_accumulation_is_the_engine_s(ranks):
    losses, weights, steps = ranks[0]["accumulation"]
    want_losses, want_weights = reference(STEPS, accumulation=2)
    assert steps == 2  # "auto" filled from the Accelerator
    assert losses == pytest.approx(want_losses, abs=1e-5)
    assert max_diff(weights, want_weights) < 1e-5


def test_config_optimizer_and_scheduler_match_deepspeed_driven_directly(ranks):
    ours, direct, resolved, scheduler_kind = ranks[0]["config_optimizer"]
    assert ours == direct and len(ours) == STEPS
    assert resolved["train_micro_batch_size_per_gpu"] == 8
    assert resolved["train_batch_size"] == 16
    assert resolved["optimizer"]["params"]["lr"] == 1e-2
    assert resolved["scheduler"]["params"]["warmup_max_lr"] == 1e-2
    assert scheduler_kind == "DeepSpeedSchedulerWrapper"


def test_save_state_resumes_like_the_uninterrupted_run(ranks):
    first, later, resumed, files, model_files = ranks[0]["resume"]
    assert resumed == pytest.approx(later, abs=1e-6) and len(resumed) == 2
    assert first != later[:2]
    assert "latest" in files and "pytorch_model" in files
    assert any(f.endswith("optim_states.pt") for f in model_files)
    assert sum(f.endswith("optim_states.pt") for f in model_files) == 2  # one shard per rank


def test_memory_view_shows_zero3_cutting_param_and_optimizer_bytes(ranks):
    m = ranks[0]["memory"]
    ddp, z3 = m["ddp"], m["z3"]
    # the view's numbers are torch's own counts for DDP and DeepSpeed's partitions for ZeRO-3
    assert ddp.parameters == m["torch_params"] and ddp.optimizer_states == m["torch_optimizer"]
    assert z3.parameters == m["ds_params"] and z3.optimizer_states == m["ds_optimizer"]
    assert ddp.stage is None and z3.stage == 3
    ratio = (z3.parameters + z3.optimizer_states) / (ddp.parameters + ddp.optimizer_states)
    assert ratio <= 0.6, ratio
    assert m["z3_rank1"].rank == 1 and m["z3_rank1"].parameters == z3.parameters
    assert "ZeRO-3" in m["text"] and "rank" in m["text"]


def test_bf16_from_mixed_precision_is_close_to_float32(ranks):
    losses, section, dtype, precision = ranks[0]["bf16"]
    assert section == {"enabled": True} and dtype == "torch.bfloat16" and precision == "bf16"
    assert losses == pytest.approx(reference(STEPS)[0], abs=5e-3)
    assert losses != reference(STEPS)[0]  # really computed in bfloat16
