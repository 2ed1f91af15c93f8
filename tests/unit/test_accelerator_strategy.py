"""The strategy layer, the tracker registry, and one tied-weight convention for weights on disk."""

import json

import pytest
import torch

from nbaccel import Accelerator, AcceleratorState, DistributedType
from nbaccel.bigmodel import init_empty_weights, load_checkpoint_in_model
from nbaccel.storage.weights import (
    load_model_weights,
    read_weights,
    save_model_weights,
    tie_record,
    tied_twins,
)
from nbaccel.training.strategies.ddp import DDPStrategy
from nbaccel.training.strategies.fsdp.strategy import FSDPStrategy
from nbaccel.training.strategies.registry import STRATEGIES, select_strategy
from nbaccel.training.strategies.xla import XLAStrategy
from nbaccel.training.tracking.registry import (
    LOGGER_TYPE_TO_CLASS,
    available_trackers,
    register_tracker_class,
)
from nbaccel.training.tracking.trackers import GeneralTracker


def test_strategy_is_chosen_once_from_the_distributed_type():
    assert AcceleratorState.current() is None  # asking does not build a state
    acc = Accelerator()
    assert type(acc.strategy) is DDPStrategy and not acc.strategy.joins_uneven_inputs
    assert AcceleratorState.current().distributed_type == DistributedType.NO
    assert STRATEGIES[DistributedType.FSDP] is FSDPStrategy
    assert STRATEGIES[DistributedType.XLA] is XLAStrategy
    for kind in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.MULTI_XPU):
        assert STRATEGIES[kind] is DDPStrategy
    assert STRATEGIES[DistributedType.DEEPSPEED].__name__ == "DeepSpeedStrategy"
    acc.state.distributed_type = DistributedType.MEGATRON_LM
    try:
        with pytest.raises(ValueError, match="MEGATRON_LM run trains with a MegatronLMPlugin"):
            select_strategy(acc.state, acc.precision)
    finally:
        acc.state.distributed_type = DistributedType.NO
    # one process: the model is placed, not wrapped; the optimizer steps through the strategy
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = acc.prepare(model, opt)
    assert type(model) is torch.nn.Linear
    assert opt.step_fn == acc.strategy.optimizer_step
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    assert torch.equal(model.weight, before - 1.0)


def test_tracker_registry_has_public_names():
    class Collect(GeneralTracker):
        name = "collect"
        requires_logging_directory = False
        logged: list = []

        def log(self, values, step=None, **kwargs):
            self.logged.append((step, values))

    assert "notebook" in LOGGER_TYPE_TO_CLASS  # registered by importing nbaccel
    register_tracker_class(Collect, name="collect")
    try:
        assert LOGGER_TYPE_TO_CLASS["collect"] is Collect and "collect" in available_trackers()
        acc = Accelerator(log_with="collect")
        acc.init_trackers("run")
        acc.log({"loss": 1.0}, step=2)
        assert Collect.logged == [(2, {"loss": 1.0})]
        register_tracker_class(Collect, name="never", available=lambda: False)
        assert "never" not in available_trackers()
        with pytest.warns(UserWarning, match="'never' is skipped"):  # as Accelerate: left out
            assert Accelerator(log_with="never").log_with == []
        with pytest.raises(ValueError, match="GeneralTracker subclass"):
            register_tracker_class(object, name="bad")
    finally:
        LOGGER_TYPE_TO_CLASS.pop("collect", None)
        LOGGER_TYPE_TO_CLASS.pop("never", None)


class _Net(torch.nn.Module):
    def __init__(self, tie: bool = True):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def test_one_tied_weight_convention_for_every_reader(tmp_path):
    source = _Net()
    save_model_weights(source.state_dict(), tmp_path / "single")
    save_model_weights(source.state_dict(), tmp_path / "sharded", max_shard_size="100B")
    assert tie_record(tmp_path / "single") == {"head.weight": "embed.weight"}
    assert tie_record(tmp_path / "single" / "model.safetensors") == {"head.weight": "embed.weight"}
    assert tie_record(tmp_path / "sharded") == {"head.weight": "embed.weight"}
    tensors, _ = read_weights(tmp_path / "sharded")
    assert set(tensors) == {"embed.weight", "body.weight", "body.bias"}  # the twin written once
    for folder in ("single", "sharded"):
        # the record fills the twin even in a model that is not tied
        untied = _Net(tie=False)
        load_model_weights(untied, tmp_path / folder)
        assert torch.equal(untied.head.weight, source.embed.weight)
        with init_empty_weights():
            empty = _Net(tie=False)
        load_checkpoint_in_model(empty, tmp_path / folder, strict=True)
        assert torch.equal(empty.head.weight, source.embed.weight)
    # without a record, the model's own ties fill the twin (a checkpoint written elsewhere)
    plain = tmp_path / "plain"
    plain.mkdir()
    state = {k: v.clone() for k, v in source.state_dict().items() if k != "head.weight"}
    torch.save(state, plain / "pytorch_model.bin")
    tied = _Net()
    torch.nn.init.zeros_(tied.embed.weight)
    load_model_weights(tied, plain)
    assert torch.equal(tied.head.weight, source.embed.weight)
    assert tied.head.weight is tied.embed.weight
    untied = _Net(tie=False)
    with pytest.raises(KeyError, match=r"missing keys \['head.weight'\]"):
        load_model_weights(untied, plain)
    assert tied_twins([["a", "b"]], {"c": "b"}) == {n: ["a", "b", "c"] for n in "abc"}
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["tied_weights"] == {"head.weight": "embed.weight"}
