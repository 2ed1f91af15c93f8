"""The FP8 recipe handlers of ``Accelerator(kwargs_handlers=[...])``: torchao's
(``AORecipeKwargs``), Transformer Engine's (``TERecipeKwargs``) and Accelerate's older
``FP8RecipeKwargs`` (which picks one of them by ``backend``). Checked when built, so a wrong
recipe fails before training starts."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nbaccel.training.config.kwargs_handlers import KwargsHandler

__all__ = ["AORecipeKwargs", "FP8RecipeKwargs", "MSAMPRecipeKwargs", "TERecipeKwargs"]


def _require_torchao() -> None:
    from nbaccel.distributed.probes import is_torchao_available

    if not is_torchao_available():
        raise ImportError(
            "FP8 training with torchao needs torchao >= 0.10: pip install 'nbaccel[torchao]'."
        )


@dataclass
class AORecipeKwargs(KwargsHandler):
    """FP8 training with torchao's ``Float8Linear``.

    ``config``: a ``torchao.float8.Float8LinearConfig`` (default: dynamic tensorwise scaling
    with ``pad_inner_dim=True``). ``module_filter_func(module, fqn) -> bool``: which linears
    to convert (default: every linear whose sizes are multiples of 16, except the model's first
    and last, as Accelerate does). ``emulate`` (nbaccel): run the FP8 matmuls emulated in
    higher precision, for hardware without FP8 (GPUs before compute capability 8.9); default:
    the ``NBACCEL_FP8_EMULATE`` environment variable (which the launchers' FP8 check reads too).
    """

    config: Any = None
    module_filter_func: Callable | None = None
    pad_inner_dim: bool | None = None
    enable_fsdp_float8_all_gather: bool | None = None
    emulate: bool | None = None

    def __post_init__(self) -> None:
        _require_torchao()
        if self.module_filter_func is not None and not callable(self.module_filter_func):
            raise TypeError("module_filter_func must be callable(module, fqn) -> bool.")

    def float8_config(self) -> Any:
        """The ``Float8LinearConfig`` this recipe trains with."""
        import dataclasses

        from torchao.float8 import Float8LinearConfig

        from nbaccel.distributed.host_info import fp8_emulation_requested

        config = self.config or Float8LinearConfig(pad_inner_dim=True)
        emulate = self.emulate
        if emulate is None and fp8_emulation_requested():
            emulate = True  # NBACCEL_FP8_EMULATE=1, as the launch check read it
        changes = {
            k: v
            for k, v in (
                ("pad_inner_dim", self.pad_inner_dim),
                ("enable_fsdp_float8_all_gather", self.enable_fsdp_float8_all_gather),
                ("emulate", emulate),
            )
            if v is not None
        }
        return dataclasses.replace(config, **changes) if changes else config

    @property
    def backend(self) -> str:
        return "AO"


@dataclass
class TERecipeKwargs(KwargsHandler):
    """FP8 training with NVIDIA Transformer Engine (its ``DelayedScaling`` recipe's options)."""

    use_autocast_during_eval: bool | None = None
    margin: int | None = None
    interval: int | None = None
    fp8_format: str | None = None
    amax_history_len: int | None = None
    amax_compute_algo: str | None = None
    override_linear_precision: tuple[bool, bool, bool] | None = None
    use_mxfp8_block_scaling: bool | None = None

    def __post_init__(self) -> None:
        if importlib.util.find_spec("transformer_engine") is None:
            raise ImportError(
                "TERecipeKwargs needs NVIDIA Transformer Engine, which is not installed (it "
                "runs on NVIDIA GPUs of compute capability 8.9+): pip install "
                "'transformer_engine[pytorch]', or use AORecipeKwargs() (torchao; CPU and GPU)."
            )
        if self.fp8_format is not None and self.fp8_format.upper() not in ("HYBRID", "E4M3"):
            raise ValueError(f"fp8_format must be 'HYBRID' or 'E4M3', not {self.fp8_format!r}.")

    @property
    def backend(self) -> str:
        return "TE"


@dataclass
class MSAMPRecipeKwargs(KwargsHandler):
    """MS-AMP's recipe: not driven by nbaccel (use ``AORecipeKwargs``)."""

    opt_level: str | None = None

    def __post_init__(self) -> None:
        raise ValueError(
            "MS-AMP is not supported by nbaccel (it is unmaintained): use AORecipeKwargs() for "
            "FP8 training with torchao, or TERecipeKwargs() with Transformer Engine."
        )


class FP8RecipeKwargs(KwargsHandler):
    """Accelerate's older recipe: ``FP8RecipeKwargs(backend="te", ...)`` builds a
    :class:`TERecipeKwargs`, ``backend="ao"`` (nbaccel's default) an :class:`AORecipeKwargs`,
    ``"msamp"`` is refused."""

    def __new__(cls, backend: str | None = None, **kwargs: Any) -> KwargsHandler:  # type: ignore[misc]
        name = (backend or "ao").lower()
        if name == "te":
            return TERecipeKwargs(**kwargs)
        if name == "ao":
            return AORecipeKwargs(**kwargs)
        if name == "msamp":
            return MSAMPRecipeKwargs(**kwargs)
        raise ValueError(f"Unknown FP8 backend {backend!r}: use 'ao' (torchao) or 'te'.")
