"""Accelerate's command line, nbaccel's way: ``config`` (default, update), ``launch`` from
config files, ``to-fsdp2``, ``tpu-config``, ``env``, ``test`` and the launch helpers of
``nbaccel.utils.launch``. Commands run as real subprocesses on real files in ``tmp_path``; the
user's own default config is kept out by pointing ``HF_HOME`` at ``tmp_path``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from nbaccel.commands.launch import _validate_launch_command, launch_command_parser

ROOT = Path(__file__).resolve().parents[2]

RANK_SCRIPT = """
import os, sys
print(f"rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} "
      f"precision={os.environ['ACCELERATE_MIXED_PRECISION']} "
      f"cpu={os.environ.get('ACCELERATE_USE_CPU')} "
      f"threads={os.environ.get('OMP_NUM_THREADS')} argv={sys.argv[1:]}")
"""


def _cli(tmp_path: Path, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-m", "nbaccel", *argv],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _yaml(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


# -- config files -------------------------------------------------------------------------------
def test_config_default_writes_a_readable_file_once(tmp_path):
    from nbaccel.commands.config.config_args import ClusterConfig, load_config_from_file

    target = tmp_path / "cfg" / "default_config.yaml"
    done = _cli(tmp_path, "config", "default", "--config_file", str(target),
                "--mixed_precision", "bf16")  # fmt: skip
    assert done.returncode == 0, done.stderr
    config = load_config_from_file(target)
    assert isinstance(config, ClusterConfig)
    assert config.mixed_precision == "bf16" and config.num_processes >= 1
    assert config.use_cpu is True and config.distributed_type == "NO"  # no GPU on this machine
    again = _cli(tmp_path, "config", "default", "--config_file", str(target))
    assert again.returncode == 1 and "already exists" in again.stdout


def test_config_update_upgrades_an_old_file(tmp_path):
    old = _yaml(tmp_path / "old.yaml", """
        compute_environment: LOCAL_MACHINE
        distributed_type: NO
        fp16: true
        num_processes: 2
        dynamo_backend: INDUCTOR
    """)  # fmt: skip
    done = _cli(tmp_path, "config", "update", "--config_file", str(old))
    assert done.returncode == 0, done.stderr
    data = yaml.safe_load(old.read_text())
    assert data["mixed_precision"] == "fp16" and "fp16" not in data
    assert data["distributed_type"] == "NO" and data["num_processes"] == 2
    assert data["dynamo_config"] == {"dynamo_backend": "INDUCTOR"}


def test_unknown_keys_are_named(tmp_path):
    from nbaccel.commands.config.config_args import load_config_from_file

    bad = _yaml(tmp_path / "bad.yaml", "compute_environment: LOCAL_MACHINE\nzeta: 1\nalpha: 2\n")
    with pytest.raises(ValueError, match=r"unknown keys \(alpha, zeta\)"):
        load_config_from_file(bad)
    with pytest.raises(FileNotFoundError, match="nbaccel config"):
        load_config_from_file(tmp_path / "missing.yaml")


def test_sagemaker_file_reads_as_sagemaker_config(tmp_path):
    from nbaccel.commands.config.config_args import SageMakerConfig, load_config_from_file

    path = _yaml(tmp_path / "sm.yaml", """
        compute_environment: AMAZON_SAGEMAKER
        distributed_type: NO
        mixed_precision: fp16
        ec2_instance_type: ml.g5.xlarge
        iam_role_name: role
    """)  # fmt: skip
    config = load_config_from_file(path)
    assert isinstance(config, SageMakerConfig) and config.distributed_type == "NO"
    config.to_json_file(tmp_path / "sm.json")
    assert load_config_from_file(tmp_path / "sm.json") == config


# -- launch from config files -------------------------------------------------------------------
def test_launch_takes_missing_options_from_the_config(tmp_path):
    (tmp_path / "show.py").write_text(RANK_SCRIPT)
    config = _yaml(tmp_path / "two.yaml", """
        compute_environment: LOCAL_MACHINE
        distributed_type: MULTI_CPU
        mixed_precision: bf16
        num_processes: 2
        use_cpu: true
    """)  # fmt: skip
    done = _cli(tmp_path, "launch", "--config_file", str(config), "show.py", "--x", "1")
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"rank={rank} world=2 precision=bf16 cpu=True threads=1 argv=['--x', '1']" in (
            done.stdout
        )
    # A command-line option wins over the file; hyphenated spellings are accepted.
    one = _cli(tmp_path, "launch", "--config-file", str(config), "--num-processes", "1",
               "--mixed_precision", "no", "show.py")  # fmt: skip
    assert one.returncode == 0, one.stderr
    assert "rank=0 world=1 precision=no" in one.stdout and "rank=1" not in one.stdout


def test_the_default_config_file_is_read(tmp_path):
    from nbaccel.utils import write_basic_config

    (tmp_path / "show.py").write_text(RANK_SCRIPT)
    write_basic_config("fp16", tmp_path / "nbaccel" / "default_config.yaml")  # HF_HOME's
    done = _cli(tmp_path, "launch", "show.py")
    assert done.returncode == 0, done.stderr
    assert "precision=fp16" in done.stdout


def test_unsupported_configs_are_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    from nbaccel.cli import main
    from nbaccel.commands.config import config_args

    monkeypatch.setattr(config_args, "default_config_file", str(tmp_path / "none.yaml"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("print('never runs')\n")
    bad = _yaml(tmp_path / "bad.yaml", "compute_environment: LOCAL_MACHINE\ninvalid_key: 1\n")
    deepspeed = _yaml(tmp_path / "ds.yaml", """
        compute_environment: LOCAL_MACHINE
        distributed_type: DEEPSPEED
        num_processes: 1
        deepspeed_config:
          zero_stage: 2
          offload_param_device: cpu
    """)  # fmt: skip
    cases = [
        (["--config_file", str(bad)], "unknown keys (invalid_key)"),
        (["--config_file", str(deepspeed)], "offload_param.device='cpu' needs ZeRO stage 3"),
        (["--cpu", "--use_fsdp"], "only one of --cpu, --use_fsdp"),
    ]
    if importlib.util.find_spec("torch_xla") is None:
        cases.append((["--tpu"], "needs torch-xla"))
    for options, message in cases:
        assert main(["launch", *options, "x.py"]) == 2, options
        out, err = capsys.readouterr()
        assert message in err and "never runs" not in out


def test_launch_help_lists_each_option_once():
    parser = launch_command_parser()
    text = parser.format_help()
    assert "--num_processes" in text and "--fsdp_sync_module_states" in text
    for dest in vars(parser.parse_args(["x.py"])):
        twin = f"--{dest.replace('_', '-')}"
        if "_" in dest and dest != "num_processes":
            assert twin not in text, twin
    args = parser.parse_args(["--multi-gpu", "--num_processes", "4", "--debug", "t.py", "--lr"])
    assert args.multi_gpu and args.num_processes == 4 and args.training_script_args == ["--lr"]
    assert args.nondefault == {"multi_gpu", "num_processes", "debug"}


def test_validate_keeps_given_options_and_fills_the_rest(tmp_path):
    config = _yaml(tmp_path / "c.yaml", """
        compute_environment: LOCAL_MACHINE
        distributed_type: FSDP
        debug: true
        num_processes: 1
        fsdp_config:
          fsdp_sync_module_states: false
          sharding_strategy: SHARD_GRAD_OP
        deepspeed_config:
          deepspeed_config_file: from/the/file
    """)  # fmt: skip
    args = launch_command_parser().parse_args(
        ["--num_processes", "2", "--deepspeed_config_file", "given", "--config_file",
         str(config), "t.py"]
    )  # fmt: skip
    args, defaults, precision_from_config = _validate_launch_command(args)
    assert args.debug is True and args.use_fsdp is True and args.num_processes == 2
    assert args.fsdp_sync_module_states is False
    assert args.fsdp_sharding_strategy == "SHARD_GRAD_OP"  # prefixed like its section
    assert args.deepspeed_config_file == "given"
    # the file names no precision: "no", and not counted as the file's (Accelerate's rule)
    assert not precision_from_config and args.mixed_precision == "no"
    assert defaults.distributed_type == "FSDP"


# -- nbaccel.utils.launch -----------------------------------------------------------------------
def _fake_mpirun(folder: Path, banner: str) -> None:
    folder.mkdir()
    program = folder / "mpirun"
    program.write_text(f"#!/bin/sh\necho '{banner}'\n")
    program.chmod(program.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize(
    "banner, expected",
    [
        ("Intel(R) MPI Library", ["-f", "hosts", "-ppn", "2", "-n", "4"]),
        ("mpirun (Open MPI) 4.1", ["--hostfile", "hosts", "--npernode", "2", "-n", "4",
                                   "--bind-to", "socket"]),
    ],
)  # fmt: skip
def test_mpirun_command_follows_the_installed_mpi(tmp_path, monkeypatch, banner, expected):
    from nbaccel.utils.launch import prepare_simple_launcher_cmd_env

    _fake_mpirun(tmp_path / "bin", banner)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    argv = ["--cpu", "--num_processes", "4", "--num_machines", "2", "--mpirun_hostfile",
            "hosts", "--main_process_ip", "10.0.0.1", "--main_process_port", "29500",
            "train.py", "--lr", "1"]  # fmt: skip
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    cmd, env = prepare_simple_launcher_cmd_env(args)
    assert cmd[0].endswith("mpirun") and cmd[1 : 1 + len(expected)] == expected
    assert cmd[1 + len(expected) :] == [sys.executable, "train.py", "--lr", "1"]
    assert env["KMP_AFFINITY"] == "granularity=fine,compact,1,0" and env["MASTER_PORT"] == "29500"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(OSError, match="needs mpirun or mpiexec"):
        prepare_simple_launcher_cmd_env(args)


def test_multi_process_env_picks_a_free_port_for_port_zero():
    from nbaccel.utils.launch import prepare_multi_gpu_env

    args = argparse.Namespace(num_processes=2, num_machines=1, main_process_port=0,
                              main_process_ip=None, machine_rank=0, mixed_precision="fp16",
                              use_fsdp=True, fsdp_version="2", cpu=True)  # fmt: skip
    env = prepare_multi_gpu_env(args)
    assert args.master_port.isdigit() and args.master_port != "0"
    assert env["MASTER_PORT"] == args.master_port and args.nproc_per_node == "2"
    assert env["ACCELERATE_MIXED_PRECISION"] == "fp16" and env["FSDP_VERSION"] == "2"
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["ACCELERATE_USE_CPU"] == "True"


def test_script_arguments_become_typed_hyperparameters():
    from nbaccel.utils.launch import _convert_nargs_to_dict

    got = _convert_nargs_to_dict(["--name", "bert", "--flag", "False", "--n=3", "--lr", "5e-5"])
    assert got == {"name": "bert", "flag": False, "n": 3, "lr": 5e-5}
    with pytest.raises(ValueError, match="--do_train' has no value"):
        _convert_nargs_to_dict(["--do_train", "--epochs", "3"])


# -- other commands -----------------------------------------------------------------------------
def test_to_fsdp2_converts_and_checks_its_arguments(tmp_path):
    source = _yaml(tmp_path / "fsdp1.yaml", """
        compute_environment: LOCAL_MACHINE
        distributed_type: FSDP
        num_processes: 2
        fsdp_config:
          fsdp_sharding_strategy: SHARD_GRAD_OP
          fsdp_backward_prefetch: BACKWARD_PRE
          fsdp_use_orig_params: true
          fsdp_forward_prefetch: true
          fsdp_offload_params: true
    """)  # fmt: skip
    done = _cli(tmp_path, "to-fsdp2", "--config_file", str(source), "--output_file", "out.yaml")
    assert done.returncode == 0, done.stderr
    fsdp = yaml.safe_load((tmp_path / "out.yaml").read_text())["fsdp_config"]
    assert fsdp == {"fsdp_version": 2, "fsdp_reshard_after_forward": False,
                    "fsdp_offload_params": True}  # fmt: skip
    assert "fsdp_forward_prefetch" in done.stderr  # dropped with a warning
    again = _cli(tmp_path, "to-fsdp2", "--config_file", str(source), "--output_file", "out.yaml")
    assert again.returncode != 0 and "already exists" in again.stderr
    neither = _cli(tmp_path, "to-fsdp2", "--config_file", str(source))
    assert neither.returncode != 0 and "--output_file must be provided" in neither.stderr


def test_tpu_config_debug_prints_the_gcloud_command(tmp_path):
    (tmp_path / "setup.sh").write_text("echo one\n\necho two\n")
    config = _yaml(tmp_path / "tpu.yaml", """
        compute_environment: LOCAL_MACHINE
        distributed_type: XLA
        tpu_name: pod-1
        tpu_zone: europe-west4-a
        command_file: setup.sh
    """)  # fmt: skip
    done = _cli(tmp_path, "tpu-config", "--config_file", str(config), "--install_nbaccel",
                "--nbaccel_version", "0.1.0", "--debug")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "Running gcloud compute tpus tpu-vm ssh pod-1 --zone europe-west4-a --command "
        "cd /usr/share; pip install nbaccel==0.1.0; echo one; echo two --worker all"
    )
    nameless = _cli(tmp_path, "tpu-config", "--command", "ls", "--debug")
    assert nameless.returncode != 0 and "--tpu_name and --tpu_zone" in nameless.stderr


def test_env_command_reports_the_executable_and_config(tmp_path, monkeypatch, capsys):
    from nbaccel.commands.env import env_command, env_command_parser

    config = _yaml(tmp_path / "c.yaml", "compute_environment: LOCAL_MACHINE\nnum_processes: 3\n")
    monkeypatch.setenv("PATH", str(tmp_path))  # no nbaccel executable here
    info = env_command(env_command_parser().parse_args(["--config_file", str(config)]))
    assert info["`nbaccel` bash location"] == "Not found"
    assert info["`nbaccel` configs"]["num_processes"] == 3
    assert "- `nbaccel` bash location: Not found" in capsys.readouterr().out
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    found = env_command(env_command_parser().parse_args([]))
    assert found["`nbaccel` bash location"] == str(Path(sys.executable).parent / "nbaccel")


def test_nbaccel_test_runs_the_check_script_on_two_ranks(tmp_path):
    config = _yaml(tmp_path / "two.yaml", """
        compute_environment: LOCAL_MACHINE
        distributed_type: MULTI_CPU
        num_processes: 2
        use_cpu: true
    """)  # fmt: skip
    done = _cli(tmp_path, "test", "--config_file", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[rank 0] Checking 2 process(es) on cpu." in done.stdout
    assert "[rank 0] check_training_matches_one_process: ok" in done.stdout
    assert "Test is a success!" in done.stdout


def test_estimate_memory_hub_names_and_timm_prefix(tmp_path, monkeypatch):
    from nbaccel.commands.estimate import add_timm_hub_prefix

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the same answer with or without a network
    done = _cli(tmp_path, "estimate-memory", "somebrokenname")
    assert done.returncode == 2
    assert "Could not look up 'somebrokenname' on the Hugging Face Hub" in done.stderr

    assert add_timm_hub_prefix("resnet50") == "resnet50"
    assert add_timm_hub_prefix("timm/resnet50.a1_in1k") == "hf-hub:timm/resnet50.a1_in1k"
    assert add_timm_hub_prefix("local-dir:/m") == "local-dir:/m"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process on purpose
def test_merge_weights_writes_one_loadable_file(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    model = torch.nn.Linear(3, 2)
    shards = tmp_path / "pytorch_model_fsdp_0"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(shards))  # one process, no group
    done = _cli(tmp_path, "merge-weights", str(shards), "merged", "--remove_checkpoint_dir")
    assert done.returncode == 0, done.stderr
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert torch.equal(merged["weight"], model.weight.detach())
    assert not shards.exists()
    missing = _cli(tmp_path, "merge-weights", str(tmp_path / "nope"), "out")
    assert missing.returncode != 0 and "no .metadata" in missing.stderr


def test_config_questions_answered_at_the_prompt(tmp_path):
    from nbaccel.commands.config.config_args import load_config_from_file

    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path)}
    target = tmp_path / "asked.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "nbaccel", "config", "--config_file", str(target)],
        input="gpu\nmulti-cpu\n\nfour\n4\nbf16\n", cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Please answer one of: no, multi-cpu" in done.stdout  # "gpu" is not a choice
    assert "'four' is not a valid answer" in done.stdout
    config = load_config_from_file(target)
    assert config.distributed_type == "MULTI_CPU" and config.num_processes == 4
    assert config.use_cpu is True and config.mixed_precision == "bf16"
    assert config.num_machines == 1


def test_no_python_runs_an_executable_and_keeps_its_exit_code(tmp_path):
    done = _cli(tmp_path, "launch", "--no_python", "--num_processes", "1", "sh", "-c",
                "echo from-sh; exit 3")  # fmt: skip
    assert done.returncode == 3 and "from-sh" in done.stdout
    two = _cli(tmp_path, "launch", "--no_python", "--num_processes", "2", "sh", timeout=60)
    assert two.returncode == 2 and "--no_python runs one process" in two.stderr


def test_launch_options_reach_the_accelerator(tmp_path):
    (tmp_path / "acc.py").write_text(
        textwrap.dedent("""
        from nbaccel import Accelerator
        from nbaccel.utils import TorchDynamoPlugin

        accelerator = Accelerator()
        print(f"precision={accelerator.mixed_precision} "
              f"steps={accelerator.gradient_accumulation_steps} "
              f"device={accelerator.device.type} dynamo={TorchDynamoPlugin().backend.value}")
        """)
    )  # fmt: skip
    options = ["--cpu", "--mixed_precision", "bf16", "--gradient_accumulation_steps", "4"]
    done = _cli(tmp_path, "launch", *options, "--dynamo_backend", "eager", "acc.py")
    assert done.returncode == 0, done.stderr
    assert "precision=bf16 steps=4 device=cpu dynamo=EAGER" in done.stdout


def test_an_fsdp1_config_gives_accelerates_variables_and_says_nbaccel_runs_fsdp2(tmp_path):
    (tmp_path / "fsdp.py").write_text(
        "import os\nprint('fsdp', os.environ.get('ACCELERATE_USE_FSDP'), "
        "os.environ.get('FSDP_VERSION'), os.environ.get('FSDP_STATE_DICT_TYPE'))\n"
    )
    config = _yaml(tmp_path / "fsdp1.yaml", """
        compute_environment: LOCAL_MACHINE
        distributed_type: FSDP
        num_processes: 1
        fsdp_config:
          fsdp_sharding_strategy: FULL_SHARD
          fsdp_state_dict_type: SHARDED_STATE_DICT
    """)  # fmt: skip
    done = _cli(tmp_path, "launch", "--config_file", str(config), "fsdp.py")
    assert done.returncode == 0, done.stderr
    # as under accelerate launch (Accelerate's own Accelerator reads FSDP_VERSION=1), and said
    assert "fsdp true 1 SHARDED_STATE_DICT" in done.stdout
    assert "gets FSDP_VERSION=1" in done.stderr and "runs FSDP2 instead" in done.stderr
    two = _cli(tmp_path, "launch", "--config_file", str(config), "--fsdp_version", "2", "fsdp.py")
    assert "fsdp true 2 SHARDED_STATE_DICT" in two.stdout and "FSDP_VERSION=1" not in two.stderr


@pytest.mark.parametrize(
    "script",
    [
        "test_ops",
        "test_sync",
        "test_distributed_data_loop",
        "test_ddp_comm_hook",
        "test_merge_weights",
    ],  # fmt: skip
)
def test_check_scripts_pass_on_two_cpu_ranks(script):
    import importlib

    from nbaccel import debug_launcher

    module = importlib.import_module(f"nbaccel.test_utils.scripts.{script}")
    assert module.main is importlib.import_module(f"nbaccel.testing.scripts.{script}").main
    debug_launcher(module.main, num_processes=2)  # a wrong result raises here, naming the rank


def test_one_machine_launch_refuses_a_main_process_ip_of_another_machine():
    """The CLI front takes the same check as notebook_launcher's master_addr."""
    from nbaccel.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    def namespace(ip):
        return argparse.Namespace(num_processes=2, num_machines=1, main_process_port=0,
                                  main_process_ip=ip, machine_rank=0, mixed_precision="no",
                                  cpu=True, training_script="train.py")  # fmt: skip

    for ip in ("192.0.2.77", "0.0.0.0x"):
        with pytest.raises(ValueError, match=r"--main_process_ip=.* --num_machines|resolve"):
            prepare_multi_gpu_env(namespace(ip))
    with pytest.raises(ValueError, match="not an address of this machine"):
        prepare_simple_launcher_cmd_env(namespace("192.0.2.77"))
    assert prepare_multi_gpu_env(namespace("localhost"))["MASTER_ADDR"] == "localhost"
    several = namespace("192.0.2.77")
    several.num_machines, several.main_process_port = 2, 29500  # node 0 elsewhere: allowed
    assert prepare_multi_gpu_env(several)["MASTER_ADDR"] == "192.0.2.77"
