"""Every option a launch takes, defined once: :class:`LaunchRequest`.

Each field of :class:`LaunchRequest` carries its type, default, help, the fronts it applies to
(:class:`Front`: ``notebook_launcher``'s keywords, the ``%%distributed`` options, ``nbaccel
launch``'s flags, the remote options) and its validation. The fronts are derived from it: the
magic and the command line build their flags from :meth:`LaunchRequest.options`, the launcher
function takes its keywords into :meth:`LaunchRequest.create`, ``RemoteOptions`` is built from
the request, and ``LaunchPlan.create`` takes it. ``tests/ranks/test_launch_request.py`` fails when a
front lacks an option that applies to it.

Adding an option is one edit, a field here::

    log_every: float = option(
        10.0, "seconds between progress summaries", Front.LAUNCHER | Front.MAGIC,
        check=positive_number,
    )

and ``notebook_launcher(..., log_every=5)``, ``%%distributed --log_every 5`` and
``nbaccel launch --log_every 5`` accept it, checked before anything starts; the engine reads
``request.log_every``.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbaccel.distributed.state import MIXED_PRECISION_CHOICES
from nbaccel.launch.launchers.forkserver.kernel_modules import PRELOAD_HELP, check_preload
from nbaccel.launch.options.accelerate_env import accelerate_environment
from nbaccel.launch.options.megatron import PREFIX, megatron_environment
from nbaccel.launch.options.megatron import megatron_option as _megatron
from nbaccel.launch.options.spec import Front, Option, option
from nbaccel.launch.remote.options import REMOTE_KINDS, RemoteOptions, remote_options
from nbaccel.launch.wire.labels import check_line_prefix
from nbaccel.values.mesh_sizes import AXES, check_mesh

__all__ = ["START_METHODS", "Front", "LaunchRequest", "Option", "option"]

#: what stands for a hosts-only option on this machine, said when one is given without hosts
_ON_THIS_MACHINE = {
    "env": "Here the ranks inherit the notebook's os.environ: set it before the launch.",
    "cwd": "Here the ranks start in the notebook's working directory: os.chdir() first.",
    "python": "Here the ranks run the kernel's own Python.",
}

START_METHODS = ("auto", "forkserver", "spawn", "fork")


# ---------------------------------------------------------------------------- checks
def _integer(name: str, value: Any, low: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be {what}, got {value!r}.")
    return value


def _positive_or_none(name: str) -> Callable[[Any], Any]:
    return lambda v: None if v is None else _integer(name, v, 1, "a positive integer")


def positive_number(name: str, none_means: str = "") -> Callable[[Any], Any]:
    """A check: a positive number of seconds (or None, meaning ``none_means``)."""

    def check(value: Any) -> Any:
        if value is None and none_means:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            alt = f" (or None for {none_means})" if none_means else ""
            raise ValueError(f"{name} must be a positive number of seconds{alt}, got {value!r}.")
        return value

    return check


def _choice(name: str, choices: Sequence[str], lower: bool = False) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        text = str(value).lower() if lower else value
        if text not in choices:
            raise ValueError(f"Unknown {name} {value!r}; choose one of {', '.join(choices)}.")
        return text

    return check


def _text(name: str, optional: bool = True) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}.")
        return value

    return check


def _port(value: Any) -> int | None:
    if value is None:
        return None
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(
            f"use_port must be a TCP port number between 1 and 65535 (an int or a string of "
            f"digits such as '29500'), got {value!r}; pass use_port=None to let nbaccel pick "
            "a free port."
        )
    return int(text)


def _flag(name: str) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}.")
        return value

    return check


def _no_rdzv_conf(value: Any) -> None:
    """Only an empty ``rdzv_conf`` (None, ``{}``) is taken: it becomes None."""
    if value:
        raise ValueError(
            f"rdzv_conf={value!r} is not supported: nbaccel forms the world through "
            "MASTER_ADDR/MASTER_PORT. Pass master_addr and use_port (or "
            "rdzv_endpoint='host:port') instead, and leave rdzv_conf unset."
        )


def _no_rdzv_id(value: Any) -> str:
    if value not in ("none", "", None):
        raise ValueError(
            f"rdzv_id={value!r} is not supported: every launch is its own run, told "
            "apart by its port. Leave rdzv_id at its default ('none')."
        )
    return "none"


def _key_values(text: str) -> dict[str, str]:
    """``a=1,b=2`` -> ``{"a": "1", "b": "2"}`` (the command line's ``--rdzv_conf``)."""
    return dict(item.split("=", 1) for item in text.split(",") if "=" in item)


_LOCAL, _REMOTE = Front.ALL, Front.ALL | Front.REMOTE
_PC, _CP = "parallelism_config_", ("allgather", "alltoall")


def _mesh_size(axis: str, what: str) -> Any:
    """A ``ParallelismConfig`` axis size as a launch option (Accelerate's flag name)."""
    name = f"{_PC}{axis}_size"
    return option(None, f"ParallelismConfig: {what} ranks", _LOCAL,
                  check=_positive_or_none(name), parse=int, metavar="N")  # fmt: skip


_WORLD = Front.LAUNCHER | Front.CLI  # a world formed by this launch alone, maybe multi-node


@dataclass(frozen=True)
class LaunchRequest:
    """What was asked of one launch (or pool), every option validated when it is created.

    Build it with :meth:`create` (keywords, from ``notebook_launcher``) or
    :meth:`from_parsed` (a text front's parsed flags). ``remote`` (not an option: derived from
    ``hosts``/``launcher`` and the options that tune them) puts the ranks on other hosts.
    """

    num_processes: int | None = option(
        None, "number of ranks (default: one per GPU, else 1 for a launch and 2 for a pool; "
        "with hosts, their ranks)", _REMOTE, check=_positive_or_none("num_processes"),
        parse=int, metavar="N", flags={Front.MAGIC: ("-n", "--num_processes")},
    )  # fmt: skip
    mixed_precision: str = option(
        "no", "mixed precision of the Accelerator on each rank", _LOCAL,
        check=_choice("mixed_precision", MIXED_PRECISION_CHOICES, lower=True),
        choices=MIXED_PRECISION_CHOICES,
    )  # fmt: skip
    use_port: int | str | None = option(
        None, "rendezvous port on node 0 (default: a free one)", _WORLD, check=_port,
        parse=int, metavar="PORT", flags={Front.CLI: ("--main_process_port",)},
    )  # fmt: skip
    master_addr: str = option(
        "127.0.0.1", "address of node 0", _WORLD, check=_text("master_addr", optional=False),
        metavar="ADDR", flags={Front.CLI: ("--main_process_ip",)},
    )  # fmt: skip
    node_rank: int = option(
        0, "rank of this node", _WORLD, check=lambda v: _integer("node_rank", v, 0, "an integer"),
        parse=int, flags={Front.CLI: ("--machine_rank",)},
    )  # fmt: skip
    num_nodes: int = option(
        1, "number of nodes", _WORLD, check=lambda v: _integer("num_nodes", v, 1, "an integer"),
        parse=int, flags={Front.CLI: ("--num_machines",)},
    )  # fmt: skip
    rdzv_backend: str = option(
        "static", "rendezvous backend", _WORLD,
        check=_choice("rdzv_backend", ("static", "c10d")), choices=("static", "c10d"),
    )  # fmt: skip
    rdzv_endpoint: str = option(
        "", "rendezvous 'host:port' (instead of master_addr and use_port)", Front.LAUNCHER,
        check=_text("rdzv_endpoint", optional=False),
    )  # fmt: skip
    rdzv_conf: dict[str, Any] | None = option(
        None, "not supported (refused unless empty)", _WORLD, check=_no_rdzv_conf,
        parse=_key_values, metavar="K=V,...",
    )  # fmt: skip
    rdzv_id: str = option("none", "not supported (leave 'none')", Front.LAUNCHER,
                          check=_no_rdzv_id)  # fmt: skip
    max_restarts: int = option(
        0, "restarts of a failed world", _WORLD, parse=int,
        check=lambda v: _integer("max_restarts", v, 0, "a non-negative integer (0: no restart)"),
    )  # fmt: skip
    monitor_interval: float = option(
        0.1, "seconds between checks of the ranks", _WORLD,
        check=positive_number("monitor_interval"), parse=float, metavar="S",
    )  # fmt: skip
    log_line_prefix_template: str | None = option(
        None, "prefix of each output line; ${rank}, ${local_rank} and ${role_name} are "
        "replaced (default: [rank N])", Front.LAUNCHER,
        check=check_line_prefix,
    )  # fmt: skip
    start_method: str = option(
        "auto", "how ranks start: auto (fork server with torch preloaded), spawn or fork",
        _LOCAL, check=_choice("start_method", START_METHODS), choices=START_METHODS,
    )  # fmt: skip
    timeout: float | None = option(
        None, "stop after this many seconds (a pool: interrupt the cell)", _LOCAL,
        check=positive_number("timeout", "no limit"), parse=float, metavar="S",
    )  # fmt: skip
    cpu: bool = option(False, "CPU ranks (gloo), even with GPUs", _LOCAL, check=_flag("cpu"))
    preload: bool | str | Sequence[str] | None = option(
        None, PRELOAD_HELP, _LOCAL, check=check_preload, metavar="auto|off|M,...")  # fmt: skip
    backend: str | None = option(
        None, "process-group backend of the pool (gloo, nccl...; default: the device's)",
        Front.MAGIC, check=_text("backend"), metavar="B",
    )  # fmt: skip
    memory: bool = option(True, "the per-rank memory monitor", Front.LAUNCHER,
                          check=_flag("memory"))  # fmt: skip
    detach: bool = option(
        False, "run under this user's supervisor, outliving the kernel or shell: a launch "
        "returns a Run handle at once (nbaccel.runs(), nbaccel.attach(id), nbaccel runs ...); "
        "a pool keeps its ranks and names for the next kernel to attach (nbaccel pools)",
        Front.LAUNCHER | Front.MAGIC | Front.CLI, check=_flag("detach"),
    )  # fmt: skip
    detach_idle: float = option(
        3600.0, "a detached pool with no kernel attached for this many seconds ends",
        Front.MAGIC, check=positive_number("detach_idle"), parse=float, metavar="S",
    )  # fmt: skip
    hosts: str | Sequence[str] | None = option(
        None, "run the ranks on these hosts through ssh, one agent per host: node1:4,node2:4",
        _REMOTE, metavar="H:N,...",
    )  # fmt: skip
    launcher: str | None = option(
        None, "how the hosts' agents start: ssh (with hosts), slurm (this allocation's nodes) "
        "or ray (a Ray cluster's nodes)",
        _REMOTE, choices=REMOTE_KINDS,
    )  # fmt: skip
    python: str | None = option(None, "the interpreter on the hosts (default: this one)",
                                _REMOTE, metavar="PATH")  # fmt: skip
    cwd: str | None = option(None, "the ranks' working directory on the hosts", _REMOTE,
                             metavar="DIR")  # fmt: skip
    env: Mapping[str, str] | Sequence[str] | str | None = option(
        None, "variables of this environment forwarded to the hosts (names, comma-separated)",
        _REMOTE, metavar="NAMES", flags={Front.CLI: ("--forward_env",)},
    )  # fmt: skip
    ssh_args: Sequence[str] | None = option(
        None, "extra ssh arguments ('-p 2222 -i key')", _REMOTE, parse=shlex.split,
        metavar="ARGS",
    )  # fmt: skip
    srun_args: Sequence[str] | None = option(
        None, "extra srun arguments", _REMOTE, parse=shlex.split, metavar="ARGS"
    )
    channel_address: str | None = option(
        None, "this machine's address that the hosts connect back to (default: the one on the "
        "route to the first host)", _REMOTE, metavar="ADDR",
    )  # fmt: skip
    ray_address: str | None = option(
        None, "the Ray cluster of launcher='ray' (default: RAY_ADDRESS, else the cluster "
        "ray.init connected this kernel to)", _REMOTE, metavar="ADDR",
    )  # fmt: skip
    ray_resources: Mapping[str, float] | str | None = option(
        None, "what each rank reserves on the Ray cluster: GPU=1,CPU=4,custom=1 (default CPU=1)",
        _REMOTE, metavar="R=N,...",
    )  # fmt: skip
    ray_placement: str | None = option(
        None, "how Ray places the ranks: pack (default: as few nodes as possible), spread, "
        "strict_pack, strict_spread", _REMOTE, metavar="HOW",
    )  # fmt: skip
    ray_keep_warm: float | None = option(
        None, "seconds a launch's Ray nodes stay reserved, their agents warm, for the next "
        "launch (default 300; 0: released at the launch's end)", _REMOTE, parse=float,
        metavar="S",
    )  # fmt: skip
    parallelism_config_dp_replicate_size: int | None = _mesh_size("dp_replicate", "full replicas")
    parallelism_config_dp_shard_size: int | None = _mesh_size("dp_shard", "sharding (FSDP2)")
    parallelism_config_tp_size: int | None = _mesh_size("tp", "tensor-parallel (the TP plan)")
    parallelism_config_cp_size: int | None = _mesh_size("cp", "context-parallel (CUDA only)")
    parallelism_config_cp_comm_strategy: str | None = option(
        None, "ParallelismConfig: how context-parallel ranks exchange keys/values", _LOCAL,
        check=lambda v: None if v is None else _choice("cp_comm_strategy", _CP)(v), choices=_CP,
    )  # fmt: skip
    use_deepspeed: bool = option(False, "train with DeepSpeed ZeRO (options: the DeepSpeed group)",
                                 Front.CLI, check=_flag("use_deepspeed"))  # fmt: skip
    use_megatron_lm: bool = option(
        False, "train with MegatronLMPlugin on torch's engines: tensor, pipeline, sequence and "
        "data parallel (options: the Megatron-LM group; CPU ranks too)", Front.CLI,
        check=_flag("use_megatron_lm"),
    )  # fmt: skip
    megatron_lm_tp_degree: int | None = _megatron(int, "tensor-parallel degree")
    megatron_lm_pp_degree: int | None = _megatron(int, "pipeline-parallel degree (stages)")
    megatron_lm_num_micro_batches: int | None = _megatron(int, "micro-batches per step")
    megatron_lm_sequence_parallelism: bool | None = _megatron(bool, "sequence parallelism")
    megatron_lm_recompute_activations: bool | None = _megatron(bool, "activation recomputation")
    megatron_lm_use_distributed_optimizer: bool | None = _megatron(
        bool, "shard the optimizer state over the data-parallel ranks"
    )
    megatron_lm_gradient_clipping: float | None = _megatron(float, "global-norm clip (0: off)")
    megatron_lm_recompute_granularity: str | None = _megatron(str, "recompute full or selective")
    megatron_lm_recompute_method: str | None = _megatron(str, "recompute uniform or block")
    megatron_lm_recompute_num_layers: int | None = _megatron(int, "layers recomputed (block)")
    megatron_lm_decoder_last_pipeline_num_layers: int | None = _megatron(
        int, "decoder layers of the last stage"
    )
    megatron_lm_attention_dropout: float | None = _megatron(float, "attention dropout (checked)")
    megatron_lm_hidden_dropout: float | None = _megatron(float, "hidden dropout (checked)")
    megatron_lm_use_custom_fsdp: bool | None = _megatron(bool, "refused (Megatron-LM's engine)")
    megatron_lm_no_load_optim: bool | None = _megatron(bool, "refused (Megatron-LM's engine)")
    megatron_lm_no_save_optim: bool | None = _megatron(bool, "refused (Megatron-LM's engine)")
    megatron_lm_eod_mask_loss: bool | None = _megatron(bool, "refused (Megatron-LM's engine)")
    megatron_lm_optimizer_cpu_offload: bool | None = _megatron(bool, "refused (its engine)")
    megatron_lm_overlap_cpu_optimizer_d2h_h2d: bool | None = _megatron(bool, "refused (engine)")
    megatron_lm_use_precision_aware_optimizer: bool | None = _megatron(bool, "refused (engine)")
    megatron_lm_attention_backend: bool | None = _megatron(bool, "refused unless true (engine)")
    megatron_lm_expert_model_parallel_size: int | None = _megatron(int, "refused above 1 (MoE)")
    megatron_lm_expert_tensor_parallel_size: int | None = _megatron(int, "refused above 1 (MoE)")
    megatron_lm_context_parallel_size: int | None = _megatron(int, "refused above 1")
    megatron_lm_attention_softmax_in_fp32: bool | None = _megatron(bool, "refused (engine)")
    megatron_lm_calculate_per_token_loss: bool | None = _megatron(bool, "refused if true")
    megatron_lm_use_rotary_position_embeddings: bool | None = _megatron(bool, "refused (model)")
    remote: RemoteOptions | None = field(default=None, init=False, compare=False, repr=False)
    #: Accelerate's launch settings a text front adds to the options above (a config file's
    #: ``fsdp_config:``, ``deepspeed_config:``, dynamo and FSDP flags...), by Accelerate's names
    settings: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            spec = item.metadata.get("option")
            if spec is not None and spec.check is not None:
                object.__setattr__(self, item.name, spec.check(getattr(self, item.name)))
        self._check_world()
        self._check_parallelism()
        self.megatron_environment()  # Megatron-LM options need use_megatron_lm
        object.__setattr__(self, "remote", self._remote())

    def _megatron_given(self) -> dict[str, Any]:
        names = [f.name for f in dataclasses.fields(self) if f.name.startswith(PREFIX)]
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def megatron_environment(self) -> dict[str, str]:
        """What the ranks' ``Accelerator()`` reads to build its ``MegatronLMPlugin`` (empty
        unless use_megatron_lm; Megatron options without it are refused)."""
        return megatron_environment(self._megatron_given(), self.use_megatron_lm)

    def _mesh_sizes(self) -> dict[str, int | None]:
        return {a: getattr(self, f"{_PC}{a}_size") for a in AXES}

    def _check_parallelism(self) -> None:
        """The mesh must fill the world (its product is ``num_processes`` when that is not
        given); context parallel needs CUDA ranks. Checked before any rank starts."""
        alone = self.num_processes is None and self.hosts is None and self.launcher is None
        world = None if self.num_processes is None else self.num_processes * self.num_nodes
        product = check_mesh(self._mesh_sizes(), world, self.cpu)
        if product is not None and alone:
            object.__setattr__(self, "num_processes", product)

    def accelerate_settings(self) -> dict[str, Any]:
        """This launch's settings by Accelerate's names (what :data:`CONTRACT` maps to the
        ranks' variables): the options, then what a text front added (``settings``)."""
        own = {
            "mixed_precision": self.mixed_precision,
            "cpu": self.cpu,
            "use_deepspeed": self.use_deepspeed,
            "use_megatron_lm": self.use_megatron_lm,
            "parallelism_config_cp_comm_strategy": self.parallelism_config_cp_comm_strategy,
            **{f"{_PC}{axis}_size": size for axis, size in self._mesh_sizes().items()},
            **self._megatron_given(),
        }
        return {**own, **{k: v for k, v in self.settings.items() if v is not None}}

    def rank_environment(self) -> dict[str, str]:
        """The variables ``accelerate launch`` would give the ranks for this request
        (``ACCELERATE_MIXED_PRECISION``, ``PARALLELISM_CONFIG_*``...; see
        :mod:`nbaccel.launch.options.accelerate_env`)."""
        return accelerate_environment(self.accelerate_settings())

    def _check_world(self) -> None:
        if not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(
                f"node_rank must be in [0, num_nodes={self.num_nodes}), got {self.node_rank}."
            )
        if self.num_nodes > 1 and self.use_port is None and not self.rdzv_endpoint:
            raise ValueError("a multi-node launch needs use_port (the same on every node).")

    def _remote(self) -> RemoteOptions | None:
        """The hosts' options, checked here (before anything starts), or None."""
        tuning = [
            name
            for name in (
                "python", "cwd", "env", "ssh_args", "srun_args", "channel_address",
                "ray_address", "ray_resources", "ray_placement", "ray_keep_warm",
            )
            if getattr(self, name) is not None
        ]  # fmt: skip
        if self.hosts is None and self.launcher is None:
            if tuning:
                one = len(tuning) == 1
                hints = "".join(f" {_ON_THIS_MACHINE[n]}" for n in tuning if n in _ON_THIS_MACHINE)
                raise ValueError(
                    f"{', '.join(tuning)} {'applies' if one else 'apply'} only to a launch over "
                    "hosts (hosts='node1:4,node2:4' over ssh, launcher='slurm' or "
                    "launcher='ray'), and this "
                    f"launch runs on this machine: add hosts, or leave {'it' if one else 'them'} "
                    f"out.{hints}"
                )
            return None
        if self.num_nodes != 1 or self.use_port is not None:
            raise ValueError(
                "a launch over hosts forms its world itself (MASTER_ADDR is the first host, "
                "MASTER_PORT a free port there): leave num_nodes and use_port out."
            )
        return remote_options(
            self.launcher or "ssh",
            self.num_processes,
            self.hosts,
            **{name: getattr(self, name) for name in tuning},
        )

    # ------------------------------------------------------------------ the fronts
    @classmethod
    def options(cls, front: Front = Front.ALL | Front.REMOTE) -> dict[str, Option]:
        """The options that apply to ``front`` (any of several), by field name, in order."""
        return {
            item.name: item.metadata["option"]
            for item in dataclasses.fields(cls)
            if "option" in item.metadata and item.metadata["option"].fronts & front
        }

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every option's default value, by name."""
        return {
            item.name: item.default_factory()
            if item.default_factory is not dataclasses.MISSING
            else item.default
            for item in dataclasses.fields(cls)
            if "option" in item.metadata
        }

    @classmethod
    def create(cls, front: Front = Front.LAUNCHER, **given: Any) -> LaunchRequest:
        """A request from keywords; a name that ``front`` does not take is a TypeError naming
        the ones it does."""
        known = cls.options(front)
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise TypeError(
                f"unknown launch option(s) {', '.join(unknown)}; the options are: "
                f"{', '.join(known)}."
            )
        return cls(**given)

    @classmethod
    def from_parsed(cls, parsed: Any, front: Front, **overrides: Any) -> LaunchRequest:
        """A request from a text front's parsed flags (``argparse.Namespace``): the options
        given there (not None), then ``overrides``."""
        given = {
            name: getattr(parsed, spec.dest(name, front))
            for name, spec in cls.options(front).items()
            if getattr(parsed, spec.dest(name, front), None) is not None
        }
        return cls.create(front, **{**given, **overrides})

    @classmethod
    def arguments(cls, front: Front) -> dict[str, tuple[tuple[str, ...], dict[str, Any]]]:
        """``front``'s options as ``add_argument`` calls: name -> (flags, keywords)."""
        defaults = cls.defaults()
        return {
            name: (spec.spellings(name, front), spec.argparse(name, defaults[name], front))
            for name, spec in cls.options(front).items()
        }
