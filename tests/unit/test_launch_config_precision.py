"""A config file's precision counts as "set by the file" only when the file names it: the
DeepSpeed fields a launch reports to Accelerate (ACCELERATE_CONFIG_DS_FIELDS) then match what
`accelerate launch` reports for the same file."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from nbaccel.commands._launch_parser import launch_command_parser
from nbaccel.commands.config.config_args import load_config_from_file
from nbaccel.commands.launch import _validate_launch_command

_DS = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: ds.json
  zero3_init_flag: false
distributed_type: DEEPSPEED
num_processes: 2
"""


@pytest.mark.parametrize(
    ("extra", "command_line", "in_file", "from_file", "precision"),
    [
        ("", [], False, False, "no"),
        ("mixed_precision: bf16\n", [], True, True, "bf16"),
        ("mixed_precision: 'no'\n", [], True, True, "no"),
        ("fp16: true\n", [], True, True, "fp16"),
        ("mixed_precision: bf16\n", ["--mixed_precision", "fp16"], True, False, "fp16"),
    ],
)
def test_precision_counts_as_the_files_only_when_the_file_names_it(
    tmp_path: Path, extra: str, command_line: list[str], in_file: bool, from_file: bool,
    precision: str,
) -> None:  # fmt: skip
    config_file = tmp_path / "ds.yaml"
    config_file.write_text(textwrap.dedent(_DS) + extra)
    assert load_config_from_file(config_file).precision_in_file is in_file
    args = launch_command_parser().parse_args(
        ["--config_file", str(config_file), *command_line, "train.py"]
    )
    args, _config, precision_from_config = _validate_launch_command(args)
    assert precision_from_config is from_file
    assert args.mixed_precision == precision


def test_a_written_config_does_not_carry_the_note(tmp_path: Path) -> None:
    source = tmp_path / "ds.yaml"
    source.write_text(_DS)
    config = load_config_from_file(source)
    config.to_yaml_file(tmp_path / "again.yaml")
    assert "precision_in_file" not in (tmp_path / "again.yaml").read_text()
    assert load_config_from_file(tmp_path / "again.yaml").precision_in_file is True
