"""``nbaccel estimate-memory MODEL``: a model's memory per dtype, built on ``meta``.

``MODEL`` is either a local factory, ``MODULE:FUNCTION`` or ``FILE.py:FUNCTION`` returning an
``nn.Module`` (run under ``init_empty_weights()``: nothing is allocated, nothing downloaded), or
a Hugging Face Hub model name (``bert-base-cased``), built empty from its config with
``transformers`` or ``timm`` as Accelerate's ``estimate-memory`` does (the config is fetched from
the Hub; the weights never are).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from nbaccel.commands.parser import command_parser

__all__ = [
    "add_timm_hub_prefix",
    "create_empty_model",
    "estimate_command",
    "estimate_command_parser",
    "gather_data",
    "load_factory",
    "register",
    "run",
    "verify_on_hub",
]

DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")
LIBRARIES = ("transformers", "timm")


def estimate_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``estimate-memory`` parser (added to ``subparsers`` when given, else standalone)."""
    help_text = "memory a model needs per dtype (largest layer, total, training with Adam)"
    parser = command_parser("estimate-memory", subparsers, help=help_text, description=__doc__)
    parser.add_argument(
        "model_name", metavar="model",
        help="MODULE:FUNCTION or FILE.py:FUNCTION returning a model, or a Hub model name",
    )  # fmt: skip
    parser.add_argument(
        "--library_name", choices=LIBRARIES, default=None,
        help="library of a Hub model (default: the Hub's metadata)",
    )  # fmt: skip
    parser.add_argument(
        "--trust_remote_code", action="store_true",
        help="allow a Hub model's own code to run (transformers)",
    )  # fmt: skip
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "float16", "int8", "int4"],
        choices=DTYPES,
        help="dtypes to report (default: float32 float16 int8 int4)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run)
    return parser


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel estimate-memory`` to the command line."""
    estimate_command_parser(subparsers)


def _is_factory(name: str) -> bool:
    """``module:function`` or ``file.py:function`` (a Hub name has no colon, or ``hf-hub:``)."""
    return ":" in name and not name.startswith("hf-hub:")


def add_timm_hub_prefix(model_name: str) -> str:
    """``timm`` (>= 1.0.29) loads Hub repos only as ``hf-hub:owner/name``: add the prefix to a
    repo id; leave registry names (``resnet50``) and prefixed names alone."""
    if ":" in model_name or "/" not in model_name:
        return model_name
    return f"hf-hub:{model_name}"


def verify_on_hub(repo: str, token: str | None = None) -> Any:
    """The Hub's model info of ``repo``, or ``"gated"`` / ``"repo"`` when it is gated / missing.
    Network failures raise OSError naming the model."""
    try:
        from huggingface_hub import model_info
        from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError
    except ImportError as exc:
        raise ImportError(
            "Hub model names need huggingface_hub: pip install huggingface_hub"
        ) from exc
    try:
        return model_info(repo, token=token)
    except GatedRepoError:
        return "gated"
    except RepositoryNotFoundError:
        return "repo"
    except Exception as exc:  # offline, DNS, proxy: say so instead of a library trace
        raise OSError(f"Could not look up {repo!r} on the Hugging Face Hub: {exc}") from exc


def create_empty_model(
    model_name: str, library_name: str | None = None, trust_remote_code: bool = False
) -> Any:
    """The Hub model ``model_name`` built on ``meta`` from its config (no weights download)."""
    from nbaccel.bigmodel.empty import init_empty_weights

    info = verify_on_hub(model_name)
    if info == "gated":
        raise OSError(
            f"Repo for model `{model_name}` is gated: request access on the Hub and log in "
            "(`huggingface-cli login`) or set HF_TOKEN."
        )
    if info == "repo":
        raise OSError(
            f"Repo for model `{model_name}` does not exist on the Hub; check the name, or pass "
            "a local MODULE:FUNCTION factory instead."
        )
    library = library_name or getattr(info, "library_name", None)
    if library is None:
        raise ValueError(
            f"Model `{model_name}` does not have any library metadata on the Hub: pass "
            f"--library_name ({' or '.join(LIBRARIES)})."
        )
    if library == "timm":
        try:
            import timm
        except ImportError as exc:
            raise ImportError(f"`{model_name}` is a timm model: pip install timm") from exc
        with init_empty_weights():
            try:
                return timm.create_model(add_timm_hub_prefix(model_name), pretrained=False)
            except Exception as exc:
                raise RuntimeError(
                    f"Tried to load `{model_name}` with `timm` but it failed: {exc}. Check "
                    "--library_name."
                ) from exc
    if library != "transformers":
        raise ValueError(f"Library `{library}` of `{model_name}` is not supported: use "
                         f"{' or '.join(LIBRARIES)}.")  # fmt: skip
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"`{model_name}` is a transformers model: pip install transformers"
        ) from exc
    try:
        config = transformers.AutoConfig.from_pretrained(
            model_name, trust_remote_code=trust_remote_code
        )
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise ValueError(f"`{model_name}` ships its own code: pass --trust_remote_code "
                             "after reading it.") from exc  # fmt: skip
        raise
    except OSError as exc:
        raise RuntimeError(
            f"Tried to load `{model_name}` with `transformers` but it failed: {exc}"
        ) from exc
    with init_empty_weights():
        return transformers.AutoModel.from_config(config, trust_remote_code=trust_remote_code)


def load_factory(spec: str) -> Callable[[], Any]:
    """``"pkg.module:build"`` or ``"file.py:build"`` -> the function (current directory first)."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"expected MODULE:FUNCTION (e.g. my_models:build), got {spec!r}")
    if target.endswith(".py") or os.sep in target:
        path = os.path.abspath(target)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no such file: {target}")
        module_spec = importlib.util.spec_from_file_location("_nbaccel_factory", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{target} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{spec} is a {type(obj).__name__}, not a function building a model")
    return obj


def _estimate(args: argparse.Namespace) -> Any:
    from nbaccel.bigmodel.memory_estimate import estimate_memory

    if _is_factory(args.model_name):
        return estimate_memory(load_factory(args.model_name), dtypes=args.dtypes)
    model = create_empty_model(args.model_name, args.library_name, args.trust_remote_code)
    return estimate_memory(model, dtypes=args.dtypes)


def gather_data(args: argparse.Namespace) -> list[list[Any]]:
    """Rows ``[dtype, largest layer bytes, total bytes, {"adam": training bytes}]``."""
    estimate = _estimate(args)
    return [
        [row.dtype, row.largest_layer, row.total, {"adam": row.training or row.total}]
        for row in estimate.rows
    ]


def estimate_command(args: argparse.Namespace) -> Any:
    """Print the estimate as a table and return it (errors raise)."""
    estimate = _estimate(args)
    print(estimate.text())
    return estimate


def run(args: argparse.Namespace) -> int:
    """Print the estimate; exit code 2 on a bad factory or model name."""
    try:
        estimate = _estimate(args)
    except (ValueError, TypeError, ImportError, AttributeError, OSError, RuntimeError) as exc:
        print(f"nbaccel estimate-memory: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(estimate.to_dict(), indent=2) if args.json else estimate.text())
    return 0
