"""Accelerate's launch contract: what a rank sees under ``nbaccel launch`` is what it sees under
``accelerate launch`` for the same config file, variable by variable, and transformers'
``Trainer`` (plain, PEFT LoRA, TRL ``SFTTrainer``) trains the same under both, and under
``notebook_launcher`` and ``%%distributed``. Real launchers, real libraries, 2 CPU ranks.

The default suite runs the table, the refusals, two configs' parity and the Trainer under
``notebook_launcher``; the rest (six more configs, the Trainer under ``nbaccel launch``, the FSDP
and DeepSpeed config files, a ``%%distributed`` cell) is the ``hf`` lane (``scripts/test-hf``,
NBACCEL_HF_FULL=1): each is a pair of 2-rank launches of transformers, a minute or more here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _hf_reference import hf_lane

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "accelerate_configs"
TRAINER = ROOT / "tests" / "_hf_trainer.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")
lane = hf_lane  # the hf lane's cases (scripts/test-hf); the default suite keeps one of each kind

DUMP = """\
import json, os, sys
json.dump(dict(os.environ), open(f"{sys.argv[1]}.{os.environ['RANK']}.json", "w"))
"""
#: what differs by launcher and is no setting: ports, paths, torchrun's own bookkeeping
_NOT_SETTINGS = (
    "MASTER_PORT",
    "PYTHONPATH",
    "_",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
)  # the last: set by importing DeepSpeed
_OWN = ("NBACCEL_", "TORCHELASTIC_")
#: KMP_* (Intel OpenMP thread hints): nbaccel keeps them with use_cpu under DeepSpeed too
_ALLOWED_EXTRA = ("KMP_AFFINITY", "KMP_BLOCKTIME")


def _environment(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path)}


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env=_environment(cwd), capture_output=True, text=True,
                            timeout=timeout)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _accelerate(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return _run([str(ACCELERATE), "launch", *argv], cwd)


def _nbaccel(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "nbaccel", "launch", *argv], cwd)


def _ranks(prefix: Path) -> list[dict]:
    return [json.loads(Path(f"{prefix}.{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture
def configs(tmp_path: Path) -> Path:
    shutil.copytree(CONFIGS, tmp_path, dirs_exist_ok=True)
    (tmp_path / "dump.py").write_text(DUMP)
    return tmp_path


# ---------------------------------------------------------------------------- the table
def test_the_table_writes_accelerates_formats() -> None:
    from nbaccel.launch.options.accelerate_env import accelerate_environment

    env = accelerate_environment({
        "mixed_precision": "BF16", "use_fsdp": True, "fsdp_version": 2,
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "fsdp_offload_params": "no",
        "dynamo_backend": "no", "cpu": False,
    })  # fmt: skip
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and env["ACCELERATE_USE_FSDP"] == "true"
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "LlamaDecoderLayer"
    assert env["FSDP_OFFLOAD_PARAMS"] == "false" and env["FSDP_SYNC_MODULE_STATES"] == "true"
    assert env["FSDP_MIN_NUM_PARAMS"] == "100000000" and env["FSDP_VERSION"] == "2"
    assert env["ACCELERATE_DYNAMO_USE_FULLGRAPH"] == "False" and "ACCELERATE_USE_CPU" not in env
    # DeepSpeed with use_cpu: Accelerate's launcher gives no ACCELERATE_USE_CPU (its
    # Accelerator would then skip DeepSpeed), nor dynamo variables
    ds = accelerate_environment({"use_deepspeed": True, "cpu": True, "dynamo_backend": "no"})
    assert ds == {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_CONFIG_DS_FIELDS": ""}


def test_a_key_that_names_nothing_and_a_bad_precision_are_refused_before_any_rank(
    configs: Path,
) -> None:
    (configs / "never.py").write_text("raise SystemExit('a rank started')\n")
    bad = (configs / "fsdp.yaml").read_text().replace("fsdp_offload_params", "fsdp_offload_parms")
    (configs / "bad.yaml").write_text(bad)
    cmd = [sys.executable, "-m", "nbaccel", "launch", "--config_file", "bad.yaml", "never.py"]
    result = subprocess.run(cmd, cwd=configs, env=_environment(configs), capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2 and "a rank started" not in result.stderr
    assert "fsdp_config key 'fsdp_offload_parms' names no setting" in result.stderr
    assert "fsdp_offload_params" in result.stderr  # the accepted keys are named
    bad = (configs / "ddp_bf16.yaml").read_text().replace("bf16", "bf17")
    (configs / "bad.yaml").write_text(bad)
    result = subprocess.run(cmd, cwd=configs, env=_environment(configs), capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2 and "a rank started" not in result.stderr
    assert "mixed_precision 'bf17'" in result.stderr and "bf16" in result.stderr


def test_without_config_file_the_one_accelerate_config_wrote_is_read_and_named(
    configs: Path,
) -> None:
    folder = configs / "accelerate"  # HF_HOME is the test folder: $HF_HOME/accelerate/
    folder.mkdir()
    shutil.copy(configs / "ddp_bf16.yaml", folder / "default_config.yaml")
    result = _nbaccel(configs, "dump.py", str(configs / "seen"))
    lines = [line for line in result.stderr.splitlines() if "settings from" in line]
    assert lines == [f"nbaccel launch: settings from the default config `accelerate config` "
                     f"wrote, {folder / 'default_config.yaml'}."]  # fmt: skip
    for rank, env in enumerate(_ranks(configs / "seen")):
        assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and env["WORLD_SIZE"] == "2"
        assert env["RANK"] == str(rank)


def test_cpu_ranks_are_cpu_ranks_to_accelerate_without_cpu_true() -> None:
    """On a machine without a GPU, ``notebook_launcher``'s ranks are CPU ranks whether or not
    ``cpu=True`` was passed: Accelerate's own ``Accelerator`` (and the Trainer, which reads the
    same ``ACCELERATE_USE_CPU``) sees one world of 2, not two worlds of 1 training copies."""
    import torch

    from nbaccel import notebook_launcher

    if torch.cuda.is_available():
        pytest.skip("GPU ranks here: the case is a machine without a GPU")

    def accelerate_world() -> tuple:
        from accelerate import Accelerator

        state = Accelerator().state
        return state.process_index, state.num_processes, str(state.distributed_type)

    got = notebook_launcher(accelerate_world, num_processes=2)
    assert got == [(0, 2, "DistributedType.MULTI_CPU"), (1, 2, "DistributedType.MULTI_CPU")]


# ---------------------------------------------------------------------------- parity
@pytest.mark.parametrize(
    "config",
    ["ddp_bf16", "fsdp",
     *(pytest.param(name, marks=lane) for name in ("deepspeed_zero2_cpu", "deepspeed_json",
       "deepspeed_grad_acc", "parallelism", "dynamo", "megatron"))],
)  # fmt: skip
def test_a_rank_sees_what_accelerate_launch_gives_it(configs: Path, config: str) -> None:
    _accelerate(configs, "--config_file", f"{config}.yaml", "dump.py", str(configs / "acc"))
    _nbaccel(configs, "--config_file", f"{config}.yaml", "dump.py", str(configs / "nb"))
    for theirs, ours in zip(_ranks(configs / "acc"), _ranks(configs / "nb"), strict=True):
        keys = {k for k in {*theirs, *ours} if k not in _NOT_SETTINGS and not k.startswith(_OWN)}
        extra = {k for k in _ALLOWED_EXTRA if k not in theirs}
        differ = {k: (theirs.get(k), ours.get(k)) for k in sorted(keys - extra)
                  if theirs.get(k) != ours.get(k)}  # fmt: skip
        assert differ == {}, f"{config}: accelerate launch vs nbaccel launch: {differ}"


# ---------------------------------------------------------------------------- the Trainer
def _trainer_records(prefix: Path) -> list[dict]:
    return [
        {case: record for case, record in rank.items() if isinstance(record, dict)
         and "losses" in record}
        for rank in _ranks(prefix)
    ]  # fmt: skip


def _same_training(theirs: list[dict], ours: list[dict], precision: str, engine: str) -> None:
    for their_rank, our_rank in zip(theirs, ours, strict=True):
        assert their_rank.keys() == our_rank.keys()
        for case, record in our_rank.items():
            assert record["mixed_precision"] == precision, (case, record)
            assert record["distributed_type"].endswith(engine), (case, record)
            assert record["num_processes"] == 2
            reference = their_rank[case]["losses"]
            assert record["losses"] == pytest.approx(reference, abs=1e-4), case


@pytest.fixture(scope="module")
def accelerate_bf16(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Accelerate's launcher running the Trainer cases in bf16: the reference."""
    folder = tmp_path_factory.mktemp("accelerate-bf16")
    shutil.copytree(CONFIGS, folder, dirs_exist_ok=True)
    _accelerate(folder, "--config_file", "ddp_bf16.yaml", str(TRAINER), str(folder / "t"),
                "plain,peft,trl")  # fmt: skip
    return _trainer_records(folder / "t")


@lane
def test_trainer_peft_and_trl_train_in_bf16_under_nbaccel_launch(configs, accelerate_bf16):
    _nbaccel(configs, "--config_file", "ddp_bf16.yaml", str(TRAINER), str(configs / "t"),
             "plain,peft,trl")  # fmt: skip
    _same_training(accelerate_bf16, _trainer_records(configs / "t"), "bf16", "MULTI_CPU")


def test_trainer_peft_and_trl_train_in_bf16_under_notebook_launcher(tmp_path, accelerate_bf16):
    import _hf_trainer

    from nbaccel import notebook_launcher

    notebook_launcher(_hf_trainer.train, (str(tmp_path / "t"), "plain,peft,trl"),
                      num_processes=2, mixed_precision="bf16")  # fmt: skip
    _same_training(accelerate_bf16, _trainer_records(tmp_path / "t"), "bf16", "MULTI_CPU")


@lane
def test_trainer_with_the_fsdp_config_trains_bf16_ddp_and_says_so(configs: Path) -> None:
    _accelerate(configs, "--config_file", "fsdp.yaml", str(TRAINER), str(configs / "a"))
    result = _nbaccel(configs, "--config_file", "fsdp.yaml", str(TRAINER), str(configs / "n"))
    notices = [line for line in result.stdout.splitlines() + result.stderr.splitlines()
               if "FSDP (use_fsdp / distributed_type: FSDP) on CPU ranks" in line]  # fmt: skip
    assert len(notices) == 1 and "trains DDP here" in notices[0]
    _same_training(_trainer_records(configs / "a"), _trainer_records(configs / "n"), "bf16",
                   "MULTI_CPU")  # fmt: skip


@pytest.mark.gpu
def test_trainer_with_the_fsdp_config_runs_fsdp_on_gpus(configs: Path, monkeypatch) -> None:
    """Where Accelerate's Accelerator can run FSDP (CUDA ranks), the config's FSDP runs under
    nbaccel launch as under accelerate launch: no CPU notice, FSDP in bf16, the same losses."""
    from _gpu import ranks

    n = ranks()
    monkeypatch.setenv("TRAINER_TEST_ON_GPU", "1")  # _hf_trainer: TrainingArguments(use_cpu=False)
    config = configs / "fsdp.yaml"
    config.write_text(config.read_text().replace("num_processes: 2", f"num_processes: {n}"))
    _accelerate(configs, "--config_file", "fsdp.yaml", str(TRAINER), str(configs / "a"))
    result = _nbaccel(configs, "--config_file", "fsdp.yaml", str(TRAINER), str(configs / "n"))
    assert "on CPU ranks" not in result.stdout + result.stderr
    for rank in range(n):
        theirs = json.loads(Path(f"{configs / 'a'}.{rank}.json").read_text())["plain"]
        ours = json.loads(Path(f"{configs / 'n'}.{rank}.json").read_text())["plain"]
        assert theirs["distributed_type"].endswith("FSDP"), theirs
        assert ours["distributed_type"].endswith("FSDP") and ours["mixed_precision"] == "bf16"
        assert ours["num_processes"] == n
        assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-3)


@pytest.fixture(scope="module")
def shared_memory_op(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Accelerate runs DeepSpeed as it ships: each rank loads DeepSpeed's shared-memory op, a JIT
    build (a minute or two, once per extensions folder). Built here first, in one process, so
    the two ranks of the launch load it instead of racing to build it."""
    pytest.importorskip("deepspeed")
    build = ("from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder\n"
             "ShareMemCommBuilder().load(verbose=False)")  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    subprocess.run([sys.executable, "-c", build], check=True, env=env, timeout=900,
                   capture_output=True)  # fmt: skip


@lane
@pytest.mark.timeout(1500)  # the shared-memory op's build, once per extensions folder
def test_trainer_with_a_deepspeed_config_with_use_cpu_runs_deepspeed(
    configs: Path, shared_memory_op: None
) -> None:
    _accelerate(configs, "--config_file", "deepspeed_zero2_cpu.yaml", str(TRAINER),
                str(configs / "a"))  # fmt: skip
    _nbaccel(configs, "--config_file", "deepspeed_zero2_cpu.yaml", str(TRAINER),
             str(configs / "n"))  # fmt: skip
    _same_training(_trainer_records(configs / "a"), _trainer_records(configs / "n"), "no",
                   "DEEPSPEED")  # fmt: skip


@lane
def test_trainer_in_a_distributed_cell_with_mixed_precision(tmp_path, accelerate_bf16) -> None:
    from kernel import cell_errors, run_notebook

    cells = [
        "%load_ext nbaccel",
        "%%distributed -n 2 --mixed_precision bf16\n"
        f"import sys; sys.path.insert(0, {str(TRAINER.parent)!r})\n"
        "import _hf_trainer\n"
        f"_hf_trainer.train({str(tmp_path / 't')!r}, 'plain,peft,trl');",
    ]
    nb = run_notebook(cells, timeout=600, cwd=str(tmp_path), shutdown=True)
    assert not [error for cell in nb.cells for error in cell_errors(cell)]
    _same_training(accelerate_bf16, _trainer_records(tmp_path / "t"), "bf16", "MULTI_CPU")
