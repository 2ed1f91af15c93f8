"""DeepSpeed configs and bad input, refused before any engine or rank starts (no ranks here):
the plugin's config from its fields or a file, "auto" values, contradictions named by key and
fix (two batch sizes, fp16 with bf16, an offload device that does not exist, a field against the
file, an optimizer in the config and in the code, a model already wrapped or moved away),
DeepSpeed missing naming the extra, and the command line refusing a bad DeepSpeed launch before
it starts. (That ``import nbaccel`` imports no DeepSpeed is checked in a fresh interpreter:
``tests/ranks/test_deepspeed_imports.py``.)"""

import json
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator, DeepSpeedPlugin
from nbaccel.training.strategies.deepspeed.config import HfDeepSpeedConfig, check_config
from nbaccel.utils import DummyOptim


def test_plugin_fields_make_a_config_with_auto_batch_sizes():
    plugin = DeepSpeedPlugin(zero_stage=3, offload_optimizer_device="cpu", gradient_clipping=0.5)
    config = plugin.deepspeed_config
    assert config["zero_optimization"]["stage"] == 3 and plugin.zero_stage == 3
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["gradient_clipping"] == 0.5
    assert config["train_micro_batch_size_per_gpu"] == "auto"
    assert plugin.is_auto("train_batch_size") and plugin.hf_ds_config.is_zero3()
    assert plugin.hf_ds_config.is_offload()
    assert DeepSpeedPlugin().zero_stage == 2  # Accelerate's default stage


def test_config_file_and_dotted_queries(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}))
    plugin = DeepSpeedPlugin(hf_ds_config=str(path), zero3_init_flag=True)
    assert plugin.get_value("zero_optimization.stage") == 3 and plugin.is_zero3_init_enabled()
    assert plugin.set_mixed_precision("bf16") == "bf16"
    assert plugin.deepspeed_config["bf16"]["enabled"] is True
    reader = HfDeepSpeedConfig({"a": {"b": 1}})
    assert reader.get_value("a.b") == 1 and reader.get_value("a.c", 7) == 7
    reader.del_config_sub_tree("a.b")
    assert reader.config == {"a": {}}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
         "offload_optimizer.device='gpu' is not an offload device"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
          "nvme_path": "/no/such/dir"}}}, "offload_param.nvme_path set to a directory"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
         "offload_param.device='cpu' needs ZeRO stage 3"),
        ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage must be 0, 1, 2 or 3"),
        ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu must be"),
    ],
)  # fmt: skip
def test_contradictory_configs_are_refused_naming_the_keys(config, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        DeepSpeedPlugin(hf_ds_config=config)


def test_two_batch_sizes_and_field_against_file_are_refused():
    config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
              "gradient_accumulation_steps": 1}  # fmt: skip
    with pytest.raises(ValueError, match="two batch sizes: train_batch_size=32.*= 8"):
        check_config(config, world_size=2)
    check_config(config, world_size=8)
    with pytest.raises(ValueError, match=r"zero_optimization\.stage=3 \(given: 2\)"):
        DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3}}, zero_stage=2)


def test_precision_contradicting_the_config_is_refused():
    plugin = DeepSpeedPlugin(hf_ds_config={"bf16": {"enabled": True}})
    with pytest.raises(ValueError, match="mixed_precision='fp16' contradicts.*enables bf16"):
        Accelerator(mixed_precision="fp16", deepspeed_plugin=plugin)


def _loader(batch_size=8):
    return DataLoader(TensorDataset(torch.randn(16, 2), torch.randn(16, 2)), batch_size=batch_size)


@pytest.mark.parametrize(
    ("config", "model", "optimizer", "message"),
    [
        ({"train_micro_batch_size_per_gpu": 4}, None, None,
         "Two batch sizes.*says train_micro_batch_size_per_gpu=4.*gives \\[8\\]"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, None, None, "Two optimizers"),
        ({}, None, "dummy", "DummyOptim stands for the config's optimizer"),
        ({}, "meta", None, "parameters on the meta device"),
        ({}, "wrapped", None, r"already wrapped \(DataParallel\)"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, None, None,
         "model.config.hidden_size, which this model does not have"),
    ],
)  # fmt: skip
def test_prepare_refuses_before_the_engine_starts(config, model, optimizer, message):
    net = nn.Linear(2, 2)
    if model == "meta":
        net = net.to("meta")
    elif model == "wrapped":
        net = nn.DataParallel(net)
    opt = (DummyOptim(net.parameters()) if optimizer == "dummy"
           else torch.optim.SGD(net.parameters(), lr=0.1))  # fmt: skip
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    with pytest.raises(ValueError, match=message):
        accelerator.prepare(net, opt, _loader())


def test_deepspeed_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what an environment without it sees
    with pytest.raises(ImportError, match=r"pip install nbaccel\[deepspeed\]"):
        Accelerator(deepspeed_plugin=DeepSpeedPlugin())
    from nbaccel.training.strategies.deepspeed.runtime import import_deepspeed

    with pytest.raises(ImportError, match=r"pip install nbaccel\[deepspeed\]"):
        import_deepspeed("cpu")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--zero_stage", "2", "--offload_param_device", "cpu"], "needs ZeRO stage 3"),
        (["--zero_stage", "5"], "stage must be 0, 1, 2 or 3, got 5"),
        (["--offload_optimizer_device", "gpu"], "invalid choice: 'gpu'"),
        (["--deepspeed_config_file", "no-such.json"], "no such file"),
        (["--deepspeed_config_file", "both.json"], "fp16.enabled and bf16.enabled"),
        (["--deepspeed_config_file", "bf16.json", "--mixed_precision", "fp16"],
         "contradicts the DeepSpeed config"),
    ],
)  # fmt: skip
def test_launch_refuses_a_bad_deepspeed_launch_before_it_starts(
    tmp_path, monkeypatch, capsys, options, message
):
    from nbaccel.cli import main
    from nbaccel.commands.config import config_args

    monkeypatch.setattr(config_args, "default_config_file", str(tmp_path / "none.yaml"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "both.json").write_text('{"fp16": {"enabled": true}, "bf16": {"enabled": true}}')
    (tmp_path / "bf16.json").write_text('{"bf16": {"enabled": true}}')
    (tmp_path / "x.py").write_text("print('never runs')\n")
    try:
        code = main(["launch", "--use_deepspeed", "--num_processes", "2", *options, "x.py"])
    except SystemExit as exc:  # argparse refuses a value outside the option's choices
        code = exc.code
    assert code == 2
    out, err = capsys.readouterr()
    assert message in err and "never runs" not in out


def test_config_command_writes_accelerate_deepspeed_keys_that_launch_reads(tmp_path):
    from nbaccel.commands._launch_parser import launch_command_parser
    from nbaccel.commands.config.config import get_user_input
    from nbaccel.commands.launch import _validate_launch_command
    from nbaccel.training.strategies.deepspeed.launch import deepspeed_environment

    answers = iter(["deepspeed", "1", "2", "bf16", "", "3", "cpu", "none", "yes", "2"])
    config = get_user_input(reader=lambda prompt: next(answers))
    assert config.deepspeed_config == {
        "zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "none",
        "zero3_init_flag": True, "gradient_accumulation_steps": 2,
    }  # fmt: skip
    path = tmp_path / "ds.yaml"
    config.to_yaml_file(str(path))
    args = launch_command_parser().parse_args(["--config_file", str(path), "t.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.use_deepspeed and args.zero_stage == 3 and args.num_processes == 2
    env = deepspeed_environment(args, args.num_processes)
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"] == "cpu"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "true"
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "2"
