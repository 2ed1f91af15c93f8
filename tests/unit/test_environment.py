"""detect_launch_environment / detect_platform read plain mappings: no processes needed."""

from __future__ import annotations

import pytest

from nbaccel.distributed.environment import (
    LaunchEnvironment,
    detect_launch_environment,
    detect_platform,
    is_tpu_requested,
)

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "abc",
}
SLURM = {
    "SLURM_JOB_ID": "42",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NNODES": "2",
}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}
MASTER = {"MASTER_ADDR": "node0", "MASTER_PORT": "1234"}


def test_empty_environment_is_a_single_process() -> None:
    launch = detect_launch_environment({})
    assert launch == LaunchEnvironment()
    assert (launch.rank, launch.world_size, launch.source, launch.is_distributed) == (
        0,
        1,
        "single",
        False,
    )


def test_torchrun_variables() -> None:
    launch = detect_launch_environment(TORCHRUN)
    assert launch == LaunchEnvironment(3, 8, 1, 2, "10.0.0.1", 29500, "torchrun")
    assert launch.is_distributed


def test_plain_env_variables_and_defaults() -> None:
    launch = detect_launch_environment({"RANK": "1", "WORLD_SIZE": "2"})
    assert launch == LaunchEnvironment(1, 2, 0, 2, None, None, "env")


def test_nbaccel_launcher_names_itself() -> None:
    env = {**TORCHRUN, "NBACCEL_LAUNCHER": "nbaccel"}
    assert detect_launch_environment(env).source == "nbaccel"


def test_torchrun_wins_over_slurm_and_mpi() -> None:
    launch = detect_launch_environment({**SLURM, **OPENMPI, **TORCHRUN})
    assert (launch.source, launch.rank) == ("torchrun", 3)


def test_slurm_only_with_master_addr() -> None:
    assert detect_launch_environment(SLURM) == LaunchEnvironment()
    launch = detect_launch_environment({**SLURM, **MASTER})
    assert launch == LaunchEnvironment(5, 8, 1, 4, "node0", 1234, "slurm")
    per_node = detect_launch_environment({**SLURM, **MASTER, "SLURM_NTASKS_PER_NODE": "3"})
    assert per_node.local_world_size == 3


def test_open_mpi_only_with_master_addr() -> None:
    assert detect_launch_environment(OPENMPI) == LaunchEnvironment()
    launch = detect_launch_environment({**OPENMPI, **MASTER})
    assert launch == LaunchEnvironment(2, 4, 0, 2, "node0", 1234, "mpi")


def test_pmi_variables_with_master_addr() -> None:
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "h"}
    launch = detect_launch_environment(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.source) == (1, 2, 1, "mpi")
    assert launch.master_port is None


def test_slurm_wins_over_mpi() -> None:
    assert detect_launch_environment({**OPENMPI, **SLURM, **MASTER}).source == "slurm"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2.0"}, "WORLD_SIZE='2.0' is not an integer"),
        ({**TORCHRUN, "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer"),
        ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        ({**SLURM, **MASTER, "SLURM_NTASKS": "many"}, "SLURM_NTASKS='many' is not an integer"),
        ({**OPENMPI, **MASTER, "OMPI_COMM_WORLD_RANK": "?"}, "OMPI_COMM_WORLD_RANK='\\?'"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK=2 is outside 0..1 \(WORLD_SIZE=2\)"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 is outside 0..1"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
        ({**SLURM, **MASTER, "SLURM_PROCID": "8"}, "SLURM_PROCID=8 is outside 0..7"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-3"}, "local rank -3"),
    ],
)
def test_bad_values_are_clear_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        detect_launch_environment(env)


def test_empty_values_fall_back_to_defaults() -> None:
    launch = detect_launch_environment({"RANK": "", "WORLD_SIZE": "2", "MASTER_PORT": ""})
    assert (launch.rank, launch.master_port) == (0, None)


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert detect_launch_environment().rank == 3


def test_platform_on_a_plain_machine() -> None:
    assert detect_platform({}) == {
        "colab": False,
        "kaggle": False,
        "slurm": False,
        "torchrun": False,
        "mpi": False,
        "tpu": False,
        "xla": False,
        "nbaccel_worker": False,
    }


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"COLAB_RELEASE_TAG": "release-colab_2024"}, {"colab"}),
        ({"COLAB_GPU": "1"}, {"colab"}),
        ({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, {"colab", "tpu", "xla"}),
        ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, {"kaggle"}),
        ({"KAGGLE_URL_BASE": "https://www.kaggle.com"}, {"kaggle"}),
        ({"SLURM_JOB_ID": "7"}, {"slurm"}),
        ({"TORCHELASTIC_RUN_ID": "x"}, {"torchrun"}),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, {"mpi"}),
        ({"PMI_SIZE": "4"}, {"mpi"}),
        ({"PJRT_DEVICE": "TPU"}, {"tpu", "xla"}),
        ({"TPU_NAME": "my-tpu"}, {"tpu", "xla"}),
        ({"PJRT_DEVICE": "CPU"}, {"xla"}),  # the XLA-on-CPU lane is not a TPU
        ({"NBACCEL_LAUNCHER": "nbaccel"}, {"nbaccel_worker"}),
    ],
)
def test_platform_flags(env: dict[str, str], expected: set[str]) -> None:
    flags = detect_platform(env)
    assert {name for name, on in flags.items() if on} == expected


def test_tpu_requested() -> None:
    assert not is_tpu_requested({})
    assert is_tpu_requested({"PJRT_DEVICE": "CPU"})
    assert is_tpu_requested({"COLAB_TPU_ADDR": "x"})
