"""A detached run whose rank is SIGKILLed mid-training is resumed from its newest complete
checkpoint and ends where an uninterrupted run ends (fixed seed and data, gloo CPU ranks)."""

from __future__ import annotations

import os
import signal

import pytest
from detached import runs_fixture  # noqa: F401 (the fixture `runs`)

from nbaccel import Run, notebook_launcher
from nbaccel.launch.detached.folder import RunState
from nbaccel.launch.detached.handle import DetachedRun
from nbaccel.launch.driver.renderer import Renderer

EPOCHS = 4


def train(project: str, marker: str | None) -> dict:
    """Four epochs of a linear regression, a checkpoint after each; with ``marker``, rank 1
    SIGKILLs itself in the middle of epoch 2 the first time (the marker file remembers)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator, ProjectConfiguration, set_seed

    set_seed(0)
    config = ProjectConfiguration(project, automatic_checkpoint_naming=True)
    acc = Accelerator(cpu=True, project_config=config)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x @ torch.tensor([[1.0], [2.0], [-1.0], [0.5]])
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    model, opt, loader = acc.prepare(model, opt, loader)
    start = 0
    if os.path.isdir(os.path.join(project, "checkpoints")):
        acc.load_state()  # the newest complete checkpoint_<n>
        start = acc.project_configuration.iteration
        print(f"resumed at epoch {start}", flush=True)
    losses = {}
    for epoch in range(start, EPOCHS):
        total = 0.0
        for step, (xb, yb) in enumerate(loader):
            first_time = marker and not os.path.exists(marker)
            if epoch == 2 and step == 2 and acc.process_index == 1 and first_time:
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            loss = F.mse_loss(model(xb), yb)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            total += loss.item()
        losses[epoch] = total
        acc.save_state()
    weights = [p.detach().flatten().tolist() for p in acc.unwrap_model(model).parameters()]
    return {"losses": losses, "weights": weights, "started_at": start}


def test_a_killed_run_resumes_from_its_newest_checkpoint(runs, tmp_path, monkeypatch):
    root, _, env = runs
    # first, before this process's fork server could see the runs folder in its environment
    reference = notebook_launcher(
        train, (str(tmp_path / "reference"), None), num_processes=2, cpu=True,
        renderer=Renderer(),
    )  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = notebook_launcher(
        train, (str(tmp_path / "detached"), str(tmp_path / "killed-once")), num_processes=2,
        cpu=True, detach=True,
    )  # fmt: skip
    assert isinstance(run, Run)
    info = run.wait(timeout=300)
    assert info.state == RunState.FAILED and "SIGKILL" in info.reason, info
    with pytest.raises(Exception, match="rank 1"):
        run.result()
    checkpoints = sorted(os.listdir(tmp_path / "detached" / "checkpoints"))
    assert checkpoints == ["checkpoint_0", "checkpoint_1"], checkpoints

    DetachedRun(run.id).resume()  # any handle on the run will do
    resumed = run.result(timeout=300)
    assert run.info.attempts == 2
    for rank in (0, 1):
        assert resumed[rank]["started_at"] == 2
        assert resumed[rank]["weights"] == reference[rank]["weights"]
        for epoch in (2, 3):
            assert resumed[rank]["losses"][epoch] == reference[rank]["losses"][epoch]
    lines = []

    class Lines(Renderer):
        def line(self, rank, stream, text):
            lines.append(text)

    run.follow(Lines(), follow=False)
    assert "resumed at epoch 2" in lines


def test_max_restarts_resumes_a_detached_run_by_itself(runs, tmp_path, monkeypatch):
    _, _, env = runs
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = notebook_launcher(
        train, (str(tmp_path / "project"), str(tmp_path / "killed-once")), num_processes=2,
        cpu=True, detach=True, max_restarts=1,
    )  # fmt: skip
    results = run.result(timeout=300)
    assert [r["started_at"] for r in results] == [2, 2]  # relaunched from checkpoint_1
    lines = []

    class Notices(Renderer):
        def notice(self, text):
            lines.append(text)

    run.follow(Notices(), follow=False)
    assert any("restart 1 of 1" in text for text in lines), lines
