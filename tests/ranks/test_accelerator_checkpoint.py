"""save_state / load_state on 2 real ranks, resumption mid-epoch, and durability under SIGKILL."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from nbaccel.testing import run_on_ranks


class Counter:
    """A user object registered for checkpointing."""

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def _objects(acc, config=None):
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    x = torch.randn(40, 6)
    y = x.sum(dim=1, keepdim=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return (*acc.prepare(model, opt, loader, sched), counter)


def _step(acc, model, opt, sched, counter, batch):
    xb, yb = batch
    acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
    opt.step()
    sched.step()
    opt.zero_grad()
    counter.count += 1


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _roundtrip(tmp):
    from nbaccel import Accelerator, AcceleratorState, GradientState, ProjectConfiguration
    from nbaccel.training.checkpointing.state import CheckpointError
    from nbaccel.training.config.configuration import DataLoaderConfiguration

    config = ProjectConfiguration(tmp, automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(project_config=config)
    hook_calls = []

    def save_hook(models, weights, out):
        with open(os.path.join(out, "extra.txt"), "w") as f:
            f.write("x")

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(lambda models, d: hook_calls.append(os.path.basename(d)))
    model, opt, loader, sched, counter = _objects(acc)
    torch.manual_seed(100 + acc.process_index)  # per-rank random streams
    for batch in loader:  # epoch 0
        _step(acc, model, opt, sched, counter, batch)
    out = {}
    for i, batch in enumerate(loader):  # epoch 1: save after 2 batches
        _step(acc, model, opt, sched, counter, batch)
        if i == 1:
            path = acc.save_state()
            saved = (_params(model), sched.get_last_lr(), counter.count)
            out["rand_after_save"] = torch.rand(3)
            rest = []
        elif i > 1:
            rest.append(batch[0].clone())
    final = _params(model)
    next_epoch_first = next(iter(loader))[0].clone()
    out["files"] = sorted(os.listdir(path))
    # perturb everything
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for _ in range(3):
        sched.step()
    counter.count = -5
    torch.manual_seed(1234)
    acc.load_state()  # the latest automatic checkpoint
    out["hook_calls"] = hook_calls
    out["restored"] = all(torch.equal(a, b) for a, b in zip(_params(model), saved[0]))
    out["lr"] = (sched.get_last_lr(), saved[1])
    out["counter"] = (counter.count, saved[2])
    out["rand_after_load"] = torch.rand(3)
    # resume mid-epoch: the skipped loader yields the same batches, training continues the same
    resumed = acc.skip_first_batches(loader, 2)
    got = []
    for batch in resumed:
        got.append(batch[0].clone())
        _step(acc, model, opt, sched, counter, batch)
    out["same_batches"] = len(got) == len(rest) and all(
        torch.equal(a, b) for a, b in zip(got, rest)
    )
    out["same_final"] = all(torch.equal(a, b) for a, b in zip(_params(model), final))
    out["next_epoch_same"] = torch.equal(next(iter(loader))[0], next_epoch_first)
    # automatic naming and total_limit: two more saves leave the two newest
    if acc.is_main_process:
        shutil.copytree(path, os.path.join(tmp, "resume"))
    path = os.path.join(tmp, "resume")
    acc.wait_for_everyone()
    acc.save_state()
    acc.save_state()
    out["kept"] = sorted(os.listdir(os.path.join(tmp, "checkpoints")))

    # a fresh accelerator with a stateful dataloader resumes by itself at the saved batch
    AcceleratorState._reset_state()
    GradientState._reset_state()
    acc2 = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model2, opt2, loader2, sched2, counter2 = _objects(acc2)
    acc2.load_state(path)
    got = []
    for batch in loader2:
        got.append(batch[0].clone())
        _step(acc2, model2, opt2, sched2, counter2, batch)
    out["stateful_same_batches"] = all(torch.equal(a, b) for a, b in zip(got, rest))
    out["stateful_same_final"] = all(torch.equal(a, b) for a, b in zip(_params(model2), final))

    # bad directories: foreign, partial, and not fitting the prepared objects
    foreign, partial = os.path.join(tmp, "foreign"), os.path.join(tmp, "partial")
    if acc2.is_main_process:
        os.makedirs(foreign)
        open(os.path.join(foreign, "weights.pt"), "w").close()
        shutil.copytree(path, partial)
        os.remove(os.path.join(partial, "optimizer.bin"))
    acc2.wait_for_everyone()
    errors = {}
    for name, directory in (("foreign", foreign), ("partial", partial), ("none", tmp + "/nope")):
        try:
            acc2.load_state(directory)
        except CheckpointError as exc:
            errors[name] = str(exc)
    acc2.register_for_checkpointing(Counter())
    try:
        acc2.load_state(path)
    except CheckpointError as exc:
        errors["mismatch"] = str(exc)
    out["errors"] = errors
    return out


def test_save_load_resume_on_two_ranks(tmp_path):
    ranks = run_on_ranks(_roundtrip, args=(str(tmp_path),), timeout=150)
    for rank in ranks:
        assert "model.safetensors" in rank["files"] and "optimizer.bin" in rank["files"]
        assert {"random_states_0.pkl", "random_states_1.pkl", "extra.txt"} <= set(rank["files"])
        assert rank["hook_calls"] == ["checkpoint_0"]
        assert rank["restored"]
        assert rank["lr"][0] == rank["lr"][1]
        assert rank["counter"][0] == rank["counter"][1]
        assert torch.equal(rank["rand_after_load"], rank["rand_after_save"])
        assert rank["same_batches"] and rank["same_final"] and rank["next_epoch_same"]
        assert rank["kept"] == ["checkpoint_1", "checkpoint_2"]
        assert rank["stateful_same_batches"] and rank["stateful_same_final"]
        errors = rank["errors"]
        assert "nbaccel_checkpoint.json is missing" in errors["foreign"]
        assert "weights.pt" in errors["foreign"]
        assert "missing ['optimizer.bin']" in errors["partial"]
        assert "does not exist" in errors["none"]
        assert "1 custom_objects saved but 2 to restore" in errors["mismatch"]
    # each rank restored its own random state
    assert not torch.equal(ranks[0]["rand_after_save"], ranks[1]["rand_after_save"])


_SAVER = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from nbaccel import Accelerator

    ckpt, mode = sys.argv[1], sys.argv[2]
    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(torch.nn.Linear(256, 256), None)
    with torch.no_grad():
        model.weight.fill_(1.0)
    acc.save_state(ckpt)
    open(ckpt + ".v1", "w").close()
    if mode == "hook":
        def hook(models, weights, out):
            open(os.path.join(out, "half-written"), "w").write("x")
            open(ckpt + ".inside", "w").close()
            time.sleep(120)
        acc.register_save_state_pre_hook(hook)
        with torch.no_grad():
            model.weight.fill_(2.0)
        acc.save_state(ckpt)
    else:
        version = 2
        while True:
            with torch.no_grad():
                model.weight.fill_(float(version))
            acc.save_state(ckpt)
            version += 1
    """
)


def _wait_for(path, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _load_weight(ckpt):
    from nbaccel import Accelerator

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(256, 256))
    acc.load_state(ckpt)
    return model.weight


def test_sigkill_during_save_state_leaves_previous_checkpoint(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    env = {**os.environ, "ACCELERATE_USE_CPU": "True", "OMP_NUM_THREADS": "1"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    runs = {}
    for mode in ("hook", "loop"):
        ckpt = str(tmp_path / f"ckpt_{mode}")
        runs[mode] = (
            ckpt,
            subprocess.Popen(
                [sys.executable, str(script), ckpt, mode], env=env, stderr=subprocess.PIPE
            ),
        )
    try:
        # killed inside save_state, after the staging directory was half written
        ckpt, proc = runs["hook"]
        _wait_for(ckpt + ".inside", proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert os.path.exists(os.path.join(tmp_path, ".ckpt_hook.partial", "half-written"))
        weight = _load_weight(ckpt)
        assert torch.all(weight == 1.0)
        # killed at an arbitrary moment of back-to-back saves over the same directory
        ckpt, proc = runs["loop"]
        _wait_for(ckpt + ".v1", proc)
        time.sleep(0.7)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        for _ckpt, proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    from nbaccel import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    weight = _load_weight(runs["loop"][0])
    assert weight.min() == weight.max() >= 1.0  # one whole checkpoint, never a mix


def test_interrupted_replacement_is_recovered(tmp_path):
    """A kill between the two renames of a replacement: load_state puts the old one back."""
    from nbaccel import Accelerator

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(3, 3))
    ckpt = tmp_path / "ckpt"
    acc.save_state(ckpt)
    expected = model.weight.detach().clone()
    os.rename(ckpt, tmp_path / ".ckpt.previous")  # the state right after the first rename
    with torch.no_grad():
        model.weight.zero_()
    acc.load_state(ckpt)
    assert torch.equal(model.weight, expected)
    assert not (tmp_path / ".ckpt.previous").exists()


def test_automatic_naming_needs_a_project_dir():
    from nbaccel import Accelerator, ProjectConfiguration

    acc = Accelerator(project_config=ProjectConfiguration(automatic_checkpoint_naming=True))
    with pytest.raises(ValueError, match="project_dir"):
        acc.save_state()
