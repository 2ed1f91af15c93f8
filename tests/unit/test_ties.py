"""One finder of tied parameters (nbaccel/storage/ties.py) behind find_tied_parameters, the size
scan the device-map planner reads and the weight loaders: they give the same groups in the same
order (on main three finders disagreed on the order)."""

from __future__ import annotations

import torch
from torch import nn

from nbaccel.bigmodel import find_tied_parameters
from nbaccel.bigmodel.planning.module_sizes import ModelScan
from nbaccel.storage.ties import tie_groups, tied_twins
from nbaccel.storage.weights import load_into_model


class _Shared(nn.Module):
    """A tied embedding/head, a block shared under two names, and a bias tied across modules."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 3)
        block = nn.Linear(3, 3)
        self.a = block
        self.b = block
        self.inner = nn.Sequential(nn.Linear(3, 3))
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight
        self.inner[0].bias = self.a.bias


def test_every_caller_gets_the_same_tie_groups() -> None:
    net = _Shared()
    expected = [
        ["a.weight", "b.weight"],
        ["a.bias", "b.bias", "inner.0.bias"],
        ["embed.weight", "head.weight"],
    ]
    assert tie_groups(net) == expected
    assert find_tied_parameters(net) == expected
    assert ModelScan(net).tied_groups == expected
    assert ModelScan(net, tensor_names=True).tied_groups == expected
    assert tie_groups(nn.Linear(2, 2)) == [] and ModelScan(nn.Linear(2, 2)).tied_groups == []


def test_twins_join_the_model_ties_and_the_checkpoint_record() -> None:
    twins = tied_twins([["embed.weight", "head.weight"]], {"lm.weight": "head.weight"})
    assert twins["lm.weight"] == ["embed.weight", "head.weight", "lm.weight"]
    assert "other" not in twins
    # the loader fills a tied name the checkpoint lacks from its twin
    net = _Shared()
    state = {k: torch.full_like(v, 2.0) for k, v in net.state_dict().items() if k != "head.weight"}
    missing, unexpected = load_into_model(net, state)
    assert (missing, unexpected) == ([], [])
    assert torch.equal(net.head.weight, torch.full((4, 3), 2.0))
