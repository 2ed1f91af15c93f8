"""Launch config files: where they live, what they hold, how they are read and written.

A config file is the YAML (or JSON) that ``nbaccel config`` writes and ``nbaccel launch
--config_file`` reads: the defaults of a launch (how many processes, which precision, the
FSDP options...). The fields and their names are Accelerate's, so a file written for
``accelerate launch`` reads here unchanged. Two kinds exist, told apart by
``compute_environment``: :class:`ClusterConfig` (this machine or a cluster) and
:class:`SageMakerConfig` (Amazon SageMaker, read so the file can be inspected; nbaccel does not
start SageMaker jobs). Unknown keys are an error naming them, never silently dropped.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

from nbaccel.distributed.state import DistributedType
from nbaccel.training.config.run_options import ComputeEnvironment, SageMakerDistributedType

__all__ = [
    "BaseConfig",
    "ClusterConfig",
    "SageMakerConfig",
    "cache_dir",
    "accelerate_default_config_file",
    "default_config_file",
    "default_launch_config",
    "default_json_config_file",
    "default_yaml_config_file",
    "load_config_from_file",
    "read_config_dict",
]


def _cache_dir() -> str:
    hf_home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return os.path.join(os.path.expanduser(hf_home), "nbaccel")


cache_dir = _cache_dir()
default_yaml_config_file = os.path.join(cache_dir, "default_config.yaml")
default_json_config_file = os.path.join(cache_dir, "default_config.json")
# YAML unless only a JSON default exists.
default_config_file = (
    default_json_config_file
    if os.path.isfile(default_json_config_file) and not os.path.isfile(default_yaml_config_file)
    else default_yaml_config_file
)


def accelerate_default_config_file() -> str:
    """Where ``accelerate config`` writes its default file, as Accelerate finds it:
    ``$HF_HOME/accelerate`` (``HF_HOME`` defaults to ``$XDG_CACHE_HOME/huggingface``, that to
    ``~/.cache/huggingface``), the YAML file unless only the JSON one exists."""
    hf_home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    folder = os.path.join(os.path.expanduser(hf_home), "accelerate")
    yaml_file = os.path.join(folder, "default_config.yaml")
    json_file = os.path.join(folder, "default_config.json")
    return json_file if os.path.isfile(json_file) and not os.path.isfile(yaml_file) else yaml_file


def default_launch_config() -> tuple[str | None, str]:
    """The config file a launch without ``--config_file`` reads, and how to name it: nbaccel's
    default (``nbaccel config``), else the one ``accelerate config`` wrote; ``(None, "")``
    when neither exists."""
    if os.path.isfile(default_config_file):
        return default_config_file, "nbaccel's default config"
    accelerate_file = accelerate_default_config_file()
    if os.path.isfile(accelerate_file):
        return accelerate_file, "the default config `accelerate config` wrote"
    return None, ""


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - pyyaml is a dependency
        raise ImportError("Reading YAML config files needs PyYAML: pip install pyyaml") from exc
    return yaml


def read_config_dict(path: str | os.PathLike) -> dict[str, Any]:
    """The raw mapping stored in a YAML or JSON config file (JSON when it ends in ``.json``)."""
    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"The config file {path!r} does not exist; write one with `nbaccel config` "
            "(or `nbaccel config default`) or pass an existing --config_file."
        )
    with open(path, encoding="utf-8") as handle:
        if path.endswith(".json"):
            data = json.load(handle)
        else:
            data = _yaml().safe_load(handle)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"The config file {path!r} must hold a mapping of keys to values.")
    return data


def _plain(value: Any) -> Any:
    """Enums become their values so the mapping dumps as plain YAML/JSON."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _no_string(value: Any) -> Any:
    """YAML 1.1 reads an unquoted ``NO``/``no`` as ``False``; a config means the string."""
    return "NO" if value is False else value


@dataclass
class BaseConfig:
    """Fields every config file has."""

    compute_environment: ComputeEnvironment  # LOCAL_MACHINE or AMAZON_SAGEMAKER
    distributed_type: DistributedType | SageMakerDistributedType  # NO, MULTI_GPU, FSDP, ...
    mixed_precision: str  # no, fp16, bf16 or fp8
    use_cpu: bool  # CPU ranks even where there are GPUs
    debug: bool  # collectives check their shapes first (ACCELERATE_DEBUG_MODE)

    def __post_init__(self) -> None:
        if isinstance(self.compute_environment, str):
            self.compute_environment = ComputeEnvironment(self.compute_environment)
        kind = (
            SageMakerDistributedType
            if self.compute_environment == ComputeEnvironment.AMAZON_SAGEMAKER
            else DistributedType
        )
        value = _no_string(self.distributed_type)
        if isinstance(value, str):
            self.distributed_type = kind(value.upper())
        precision = self.mixed_precision
        if precision is None or precision is False:
            precision = "no"
        self.mixed_precision = str(getattr(precision, "value", precision)).lower()
        if getattr(self, "dynamo_config", None) is None:
            self.dynamo_config = {}

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain mapping (enums as their values)."""
        return {k: _plain(v) for k, v in asdict(self).items()}

    @classmethod
    def _from_mapping(cls, data: dict[str, Any], source: str) -> BaseConfig:
        data = dict(data)
        data.setdefault("compute_environment", "LOCAL_MACHINE")
        data.setdefault("distributed_type", "NO")
        data.setdefault("use_cpu", False)
        data.setdefault("debug", False)
        data["distributed_type"] = _no_string(data["distributed_type"])
        # a file that names no precision leaves it to the command line (Accelerate's rule:
        # a DeepSpeed config then lists no mixed_precision among the fields it set)
        precision_in_file = "mixed_precision" in data or bool(data.get("fp16", False))
        if "mixed_precision" not in data:  # files from before mixed_precision: fp16: true
            data["mixed_precision"] = "fp16" if data.pop("fp16", False) else "no"
        else:
            data.pop("fp16", None)
        dynamo = data.pop("dynamo_backend", None)  # an older file's single dynamo key
        if dynamo is not None and "dynamo_config" not in data:
            backend = str(dynamo).upper()
            data["dynamo_config"] = {} if backend == "NO" else {"dynamo_backend": backend}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"The config file at {source!r} had unknown keys ({', '.join(unknown)}). Remove "
                "or rename them: nbaccel reads the keys Accelerate 1.15 writes."
            )
        config = cls(**data)
        config.precision_in_file = precision_in_file  # not a field: never written back
        return config

    @classmethod
    def from_yaml_file(cls, yaml_file: str | os.PathLike) -> BaseConfig:
        """Read a YAML config file of this kind."""
        return cls._from_mapping(read_config_dict(yaml_file), str(yaml_file))

    @classmethod
    def from_json_file(cls, json_file: str | os.PathLike) -> BaseConfig:
        """Read a JSON config file of this kind."""
        return cls._from_mapping(read_config_dict(json_file), str(json_file))

    def to_yaml_file(self, yaml_file: str | os.PathLike) -> None:
        """Write the config as YAML (the parent folder is created)."""
        Path(yaml_file).parent.mkdir(parents=True, exist_ok=True)
        with open(yaml_file, "w", encoding="utf-8") as handle:
            _yaml().safe_dump(self.to_dict(), handle, sort_keys=True)

    def to_json_file(self, json_file: str | os.PathLike) -> None:
        """Write the config as JSON (the parent folder is created)."""
        Path(json_file).parent.mkdir(parents=True, exist_ok=True)
        with open(json_file, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


@dataclass
class ClusterConfig(BaseConfig):
    """A launch on this machine or on several machines (``compute_environment: LOCAL_MACHINE``)."""

    num_processes: int = -1  # -1: the file leaves it to --num_processes
    machine_rank: int = 0  # this machine's position among num_machines
    num_machines: int = 1  # machines of a multi-machine launch
    gpu_ids: str | None = None  # "all" or "0,1": the GPUs the ranks use
    main_process_ip: str | None = None  # machine 0's address (many machines)
    main_process_port: int | None = None  # machine 0's rendezvous port
    rdzv_backend: str | None = "static"  # static or c10d
    same_network: bool | None = False  # the machines share a network
    main_training_function: str = "main"  # the function a TPU launch calls
    enable_cpu_affinity: bool = False  # pin each rank to the CPUs near its GPU
    downcast_bf16: bool | str = False  # TPU: bf16 tensors as float32 / float64
    # Per-paradigm option groups, kept as the mappings the file holds.
    fp8_config: dict = field(default_factory=dict)
    deepspeed_config: dict = field(default_factory=dict)
    fsdp_config: dict = field(default_factory=dict)
    parallelism_config: dict = field(default_factory=dict)
    megatron_lm_config: dict = field(
        default_factory=dict
    )  # MEGATRON_LM: the --megatron_lm_* options
    ipex_config: dict = field(default_factory=dict)
    mpirun_config: dict = field(default_factory=dict)
    dynamo_config: dict = field(default_factory=dict)
    # TPU pods (``nbaccel tpu-config``).
    tpu_name: str | None = None
    tpu_zone: str | None = None
    tpu_use_cluster: bool = False
    tpu_use_sudo: bool = False
    command_file: str | None = None
    commands: list[str] | None = None
    tpu_vm: list[str] | None = None
    tpu_env: list[str] | None = None

    def __post_init__(self) -> None:
        for name in (
            "fp8_config", "deepspeed_config", "fsdp_config", "parallelism_config",
            "megatron_lm_config", "ipex_config", "mpirun_config", "dynamo_config",
        ):  # fmt: skip
            if getattr(self, name) is None:
                setattr(self, name, {})
        super().__post_init__()


@dataclass
class SageMakerConfig(BaseConfig):
    """A launch on Amazon SageMaker (``compute_environment: AMAZON_SAGEMAKER``)."""

    ec2_instance_type: str = "ml.p3.2xlarge"
    iam_role_name: str | None = None
    image_uri: str | None = None
    profile: str | None = None
    region: str = "us-east-1"
    num_machines: int = 1
    gpu_ids: str = "all"
    base_job_name: str = "nbaccel-sagemaker-1"
    pytorch_version: str | None = None
    transformers_version: str | None = None
    py_version: str | None = None
    sagemaker_inputs_file: str | None = None
    sagemaker_metrics_file: str | None = None
    additional_args: dict | None = None
    dynamo_config: dict | None = None
    enable_cpu_affinity: bool = False


def load_config_from_file(config_file: str | os.PathLike | None = None) -> BaseConfig:
    """Read a config file (default: :data:`default_config_file`) as the kind its
    ``compute_environment`` names."""
    path = str(config_file) if config_file is not None else default_config_file
    data = read_config_dict(path)
    environment = data.get("compute_environment", ComputeEnvironment.LOCAL_MACHINE.value)
    kind = (
        SageMakerConfig
        if environment == ComputeEnvironment.AMAZON_SAGEMAKER.value
        else ClusterConfig
    )
    return kind._from_mapping(data, path)
