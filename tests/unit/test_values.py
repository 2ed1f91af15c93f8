"""One reader per value concept (nbaccel/values/): sizes, byte text, booleans, and every caller
reading them the same way (on main two size parsers, three formatters and five boolean parsers
disagreed: ``"1024"`` failed ``max_shard_size``, ``True`` and ``-5`` passed it, ``"on"`` meant
False for FSDP environment flags)."""

from __future__ import annotations

import argparse

import pytest
import torch

from nbaccel.bigmodel import convert_file_size_to_int, init_empty_weights
from nbaccel.commands._launch_parser import to_bool
from nbaccel.distributed.environment_patch import str_to_bool
from nbaccel.launch.command_env import launch_environment
from nbaccel.notebook.kernel.cell_renderer import status_bundle
from nbaccel.storage.weights import shard_state_dict
from nbaccel.training.strategies.fsdp.plugin import FullyShardedDataParallelPlugin
from nbaccel.training.strategies.model_inspection import convert_bytes
from nbaccel.values.booleans import FALSE_WORDS, TRUE_WORDS, env_flag, parse_bool
from nbaccel.values.byte_text import byte_unit, human_bytes
from nbaccel.values.sizes import parse_size

_TENSORS = {"a": torch.zeros(256), "b": torch.zeros(256)}  # 1024 bytes each


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1024", 1024), (" 2 KiB ", 2048), ("1.5kb", 1500), ("3GB", 3 * 10**9), (7, 7), (2.9, 2)],
)
def test_every_size_caller_reads_the_same_grammar(text, expected) -> None:
    assert parse_size(text) == expected
    assert convert_file_size_to_int(text) == expected
    # max_shard_size is read by the same parser: one shard per tensor below 2048 bytes
    assert len(shard_state_dict(_TENSORS, text)) == (1 if expected >= 2048 else 2)


@pytest.mark.parametrize(
    "bad", [True, False, -1, -0.5, float("inf"), float("nan"), "5XB", "GiB", "-5GB", "lots", None]
)
def test_every_size_caller_refuses_bool_negative_and_garbage(bad) -> None:
    with pytest.raises(ValueError, match="Invalid max_shard_size") as shard:
        shard_state_dict(_TENSORS, bad)
    assert "'10GiB'" in str(shard.value)  # the accepted forms are named
    with pytest.raises(ValueError, match="Invalid memory size"):
        convert_file_size_to_int(bad)


def test_byte_text_has_one_unit_rule() -> None:
    assert [human_bytes(n) for n in (None, 100, 1536, 3 * 2**30, 2**50)] == [
        "-", "100 B", "1.5 KiB", "3.0 GiB", "1024.0 TiB"
    ]  # fmt: skip
    # Accelerate's spelling, as accelerate.utils.convert_bytes prints it
    assert [convert_bytes(n) for n in (100, 1536, 5 * 2**30, 2**60)] == [
        "100 bytes", "1.5 KB", "5.0 GB", "1024.0 PB"
    ]  # fmt: skip
    assert byte_unit(3 * 2**20) == ("MiB", 2**20) and byte_unit(10) == ("B", 1)
    # the pool's status table uses the same text as the widgets
    table = status_bundle([{"rank": 0, "rss": 1536, "device_memory": None}], "pool")["text/plain"]
    assert "1.5 KiB" in table


@pytest.mark.parametrize("word", TRUE_WORDS + tuple(w.upper() for w in TRUE_WORDS))
def test_every_boolean_reader_agrees_on_true(word, monkeypatch) -> None:
    assert parse_bool(word) is True and to_bool(word) is True and str_to_bool(word) == 1
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", word)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", word)
    plugin = FullyShardedDataParallelPlugin.from_environment()
    assert plugin is not None and plugin.cpu_offload is True
    monkeypatch.setenv("NBACCEL_INIT_INCLUDE_BUFFERS", word)
    with init_empty_weights():
        assert torch.nn.BatchNorm1d(2).running_mean.device.type == "meta"
    args = argparse.Namespace(dynamo_backend="inductor", dynamo_use_fullgraph=word)
    assert launch_environment(args)["ACCELERATE_DYNAMO_USE_FULLGRAPH"] == "True"


@pytest.mark.parametrize("word", FALSE_WORDS)
def test_every_boolean_reader_agrees_on_false(word, monkeypatch) -> None:
    assert parse_bool(word) is False and to_bool(word) is False and str_to_bool(word) == 0
    monkeypatch.setenv("ACCELERATE_USE_FSDP", word)
    assert FullyShardedDataParallelPlugin.from_environment() is None
    args = argparse.Namespace(dynamo_backend="inductor", dynamo_use_fullgraph=word)
    assert launch_environment(args)["ACCELERATE_DYNAMO_USE_FULLGRAPH"] == "False"


def test_a_misspelt_flag_is_an_error_naming_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "1")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "ture")
    with pytest.raises(ValueError, match=r"FSDP_OFFLOAD_PARAMS='ture' is not a boolean.*yes"):
        FullyShardedDataParallelPlugin.from_environment()
    with pytest.raises(argparse.ArgumentTypeError, match="expected true or false"):
        to_bool("maybe")
    monkeypatch.setenv("X_FLAG", "  ")
    assert env_flag("X_FLAG", default=None) is None and env_flag("UNSET_X_FLAG_42") is False


@pytest.mark.parametrize(
    ("strategy", "reshard"),
    [("SHARD_GRAD_OP", False), ("2", False), ("FULL_SHARD", True), ("on", True), ("off", False)],
)
def test_fsdp1_strategy_names_and_booleans_set_resharding(strategy, reshard, monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", strategy)
    plugin = FullyShardedDataParallelPlugin.from_environment()
    assert plugin is not None and plugin.reshard_after_forward is reshard
