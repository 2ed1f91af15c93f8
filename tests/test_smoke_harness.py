import torch

from nbaccel.testing import run_on_ranks


def _world():
    from nbaccel import PartialState, gather

    s = PartialState()
    return s.process_index, s.num_processes, gather(torch.tensor([s.process_index])).tolist()


def test_two_ranks():
    assert run_on_ranks(_world) == [(0, 2, [0, 1]), (1, 2, [0, 1])]
