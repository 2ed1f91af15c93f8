"""``nbaccel estimate-memory MODULE:FACTORY``: a model's memory per dtype, built on ``meta``.

The factory is a local function returning an ``nn.Module`` (``my_models:build_gpt``, or
``path/to/file.py:build``); it runs under ``init_empty_weights()``, so nothing is allocated and
nothing is downloaded.
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

__all__ = ["load_factory", "register", "run"]

DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel estimate-memory`` to the command line."""
    parser = subparsers.add_parser(
        "estimate-memory",
        help="memory a model needs per dtype (largest layer, total, training with Adam)",
        description=__doc__,
    )
    parser.add_argument("factory", help="MODULE:FUNCTION or FILE.py:FUNCTION returning a model")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "float16", "int8", "int4"],
        choices=DTYPES,
        help="dtypes to report (default: float32 float16 int8 int4)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run)


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


def run(args: argparse.Namespace) -> int:
    """Print the estimate; exit code 2 on a bad factory."""
    from nbaccel.bigmodel.memory_estimate import estimate_memory

    try:
        factory = load_factory(args.factory)
        estimate = estimate_memory(factory, dtypes=args.dtypes)
    except (ValueError, TypeError, ImportError, AttributeError, FileNotFoundError) as exc:
        print(f"nbaccel estimate-memory: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(estimate.to_dict(), indent=2) if args.json else estimate.text())
    return 0
