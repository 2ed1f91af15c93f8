"""A DeepSpeed ZeRO-3 engine kept alive across ``%%distributed`` cells in a real kernel: built in
one cell, trained in the next (losses equal to one process), a partitioned weight read whole with
``GatheredParameters`` in a third, the per-rank memory view shown, and a rank's DeepSpeed error
raised in the notebook with its type and rank."""

import re

import pytest
import torch
from kernel import cell_text, run_notebook
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("deepspeed")

SETUP = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from nbaccel import Accelerator, DeepSpeedPlugin, gather_training_memory

plugin = DeepSpeedPlugin(zero_stage=3, gradient_clipping=0.0)
plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
accelerator = Accelerator(deepspeed_plugin=plugin)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(7)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=8))
print("engine", type(model).__name__, "stage", model.zero_optimization_stage())
"""
TRAIN = """\
losses = []
for x, y in loader:
    loss = nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(accelerator.gather(loss.detach()).mean().item())
print("losses", [round(v, 5) for v in losses])
"""
GATHER = """\
from nbaccel.utils import GatheredParameters
w = accelerator.unwrap_model(model)[0].weight
local = w.ds_tensor.numel()
with GatheredParameters([w]):
    print("gathered", tuple(w.shape), "local", local, "sum", round(w.sum().item(), 4))
view = gather_training_memory(model, opt)
print(view)
"""
BAD = """\
accelerator.prepare(nn.Linear(2, 2).to("meta"), torch.optim.SGD([torch.zeros(1)], lr=0.1),
                    DataLoader(data, batch_size=8))
"""


def _reference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
    losses = []
    for x, y in DataLoader(data, batch_size=16):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 5))
    return losses, round(model[0].weight.sum().item(), 4)


def test_zero3_engine_lives_across_cells():
    cells = [
        "%load_ext nbaccel",
        "%%distributed -n 2\n" + SETUP,
        "%%distributed\n" + TRAIN,
        "%%distributed\n" + GATHER,
        "%%distributed\n" + BAD,
        "%dist_shutdown",
    ]
    nb = run_notebook(cells, timeout=240, env={"DS_ACCELERATOR": "cpu"}, shutdown=True)
    setup, train, gather, bad = (cell_text(nb.cells[i]) for i in (1, 2, 3, 4))
    for rank in (0, 1):
        assert f"[rank {rank}] engine DeepSpeedEngine stage 3" in setup, setup[-2000:]
    want_losses, want_sum = _reference()
    lines = re.findall(r"\[rank (\d)\] losses (\[.*\])", train)
    assert len(lines) == 2, train[-2000:]
    for _, text in lines:
        assert eval(text) == pytest.approx(want_losses, abs=2e-5)
    for rank in (0, 1):
        assert f"[rank {rank}] gathered (64, 8) local 256 sum" in gather, gather[-2000:]
    sums = [float(s) for s in re.findall(r"gathered \(64, 8\) local 256 sum (-?[\d.]+)", gather)]
    assert sums and all(abs(s - want_sum) < 2e-3 for s in sums)
    assert "ZeRO-3" in gather and "optimizer state" in gather
    assert "ValueError" in bad and "meta device" in bad and "rank" in bad
