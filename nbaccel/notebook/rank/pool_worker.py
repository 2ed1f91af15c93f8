"""What runs on the pool's workers: cells in a persistent namespace, names in and out, status.

Every function here is sent by reference (this module is importable on the workers) and runs in
the worker's main thread. The namespace is a ``__main__`` module, as in an IPython kernel, so
functions and classes defined in cells pickle the same way as notebook ones. ``display(...)``
and matplotlib figures are sent to the notebook as display bundles (``publish``).
``%%distributed`` options that set environment variables for one cell (``--mixed_precision``)
are undone when the cell ends.
"""

from __future__ import annotations

import ast
import builtins
import functools
import os
import sys
import types
from typing import Any

from nbaccel.launch.rank.worker import emit
from nbaccel.launch.wire.pickling import code_named, plain_function
from nbaccel.launch.wire.protocol import EventKind
from nbaccel.launch.wire.tracebacks import hide_frames_of
from nbaccel.notebook.rank.publish import publish

__all__ = [
    "display",
    "pull_name",
    "push_names",
    "publish",
    "run_cell",
    "setup_worker",
    "worker_status",
]

hide_frames_of(__file__)


class _Worker:
    """This worker's cell namespace (the ``__main__`` of its cells) and display formatter,
    made on first use."""

    module: types.ModuleType | None = None
    formatter: Any = None


_worker = _Worker()


_PLACEHOLDER = "<nbaccel-cell>"  # the file name of cached cell code, until it runs (_named)


def _format(obj: Any, **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    if _worker.formatter is None:
        from IPython.core.formatters import DisplayFormatter

        _worker.formatter = DisplayFormatter()
        png = _worker.formatter.formatters["image/png"]
        png.for_type_by_name("matplotlib.figure", "Figure", _figure_png)
    return _worker.formatter.format(obj, **options)


def _figure_png(figure: Any) -> str:
    from nbaccel.notebook.rank.mpl_backend import figure_bundle

    return figure_bundle(figure)["image/png"]


def display(
    *objs: Any,
    include: Any = None,
    exclude: Any = None,
    metadata: dict | None = None,
    raw: bool = False,
    **kwargs: Any,
) -> None:
    """``IPython.display.display`` on a worker: shown in the notebook under the rank's label."""
    for obj in objs:
        if raw:
            publish(obj, metadata)
            continue
        data, md = _format(obj, include=include, exclude=exclude)
        if data:
            publish(data, {**md, **(metadata or {})})


def _install_display() -> None:
    """Route ``display`` (builtin, ``IPython.display`` and ``IPython.core.display_functions``)."""
    try:
        import IPython.core.display as core
        import IPython.core.display_functions as functions
        import IPython.display as public
    except ImportError:
        return
    for module in (functions, core, public):
        module.display = display
    _format(None)  # build the formatter now, not in the first cell


def _install_namespace() -> None:
    module = _worker.module = types.ModuleType("__main__", "the namespace of %%distributed cells")
    module.__dict__.update(__builtins__=builtins, display=display)
    sys.modules["__main__"] = module


def _ns() -> dict[str, Any]:
    if _worker.module is None:
        _install_namespace()
    return _worker.module.__dict__


def setup_worker(backend: str | None = None) -> None:
    """Runs once per worker before it reports ready: process group, namespace, display hooks."""
    from nbaccel.distributed.state import PartialState

    state = PartialState(backend=backend) if backend else PartialState()
    import torch.distributed as dist

    if not dist.is_initialized():  # a pool of one still gets a process group, for dist.* calls
        dist.init_process_group(state.backend, init_method="env://", rank=0, world_size=1)
    # the group outlives the cell: Accelerator.end_training() in a cell keeps it
    os.environ["NBACCEL_PERSISTENT_GROUP"] = "1"
    _install_namespace()
    _install_display()
    emit(
        EventKind.POOL_INFO,
        {"device": str(state.device), "backend": state.backend, "pid": os.getpid()},
    )


def _send_open_figures() -> None:
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None or "nbaccel" not in str(pyplot.get_backend()):
        return
    from nbaccel.notebook.rank.mpl_backend import send_figures

    send_figures()


@plain_function
def run_cell(
    source: str, filename: str, first_line: int = 1, env: dict[str, str] | None = None
) -> dict[str, Any] | None:
    """Execute ``source`` in the persistent namespace; the display bundle of its last expression.

    ``filename`` is the name under which the notebook registered the source in its linecache,
    so remote tracebacks show the cell's lines; ``first_line`` is the body's line in the cell.
    """
    if not env:
        return _run_source(source, filename, first_line)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return _run_source(source, filename, first_line)
    finally:  # the options were for this cell only
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@functools.lru_cache(maxsize=64)
def _compiled(source: str, first_line: int) -> tuple[types.CodeType, types.CodeType | None]:
    """The cell's statements, and its last expression when it ends with one (whose value is
    displayed), under a placeholder file name. Cached by text: a cell run again (a training
    step, a warm cell) is not parsed again; each run gets its own name (:func:`_cell_code`)."""
    tree = ast.parse(source, _PLACEHOLDER)
    ast.increment_lineno(tree, first_line - 1)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = compile(ast.Expression(tree.body.pop().value), _PLACEHOLDER, "eval")
    return compile(tree, _PLACEHOLDER, "exec"), last


@functools.lru_cache(maxsize=64)
def _cell_code(
    source: str, filename: str, first_line: int
) -> tuple[types.CodeType, types.CodeType | None]:
    """:func:`_compiled` under ``filename``, the name the notebook keeps this run's lines
    under (for tracebacks)."""
    try:
        body, last = _compiled(source, first_line)
    except SyntaxError:
        ast.parse(source, filename)  # the same error, naming the cell
        raise
    return code_named(body, filename), last and code_named(last, filename)


def _run_source(source: str, filename: str, first_line: int) -> dict[str, Any] | None:
    namespace = _ns()
    body, last = _cell_code(source, filename, first_line)
    try:
        exec(body, namespace)
        value = eval(last, namespace) if last else None
    finally:
        _send_open_figures()
    if value is None or source.rstrip().endswith(";"):
        return None
    namespace["_"] = value
    data, metadata = _format(value)
    return {"data": data, "metadata": metadata} if data else None


@plain_function
def push_names(values: dict[str, Any]) -> None:
    """Define ``values`` (name -> object) in the namespace."""
    _ns().update(values)


@plain_function
def pull_name(name: str) -> Any:
    """The value of ``name`` in the namespace."""
    namespace = _ns()
    if name not in namespace:
        raise NameError(f"name {name!r} is not defined", name=name)
    return namespace[name]


@plain_function
def worker_status() -> dict[str, Any]:
    """Device and memory of this rank, for ``%dist_status``."""
    import psutil

    from nbaccel.distributed.state import PartialState

    state = PartialState()
    info: dict[str, Any] = {
        "device": str(state.device),
        "rss": psutil.Process().memory_info().rss,
        "names": sorted(k for k in _ns() if not k.startswith("_") and k != "display"),
    }
    if state.device.type == "cuda":
        import torch

        info["device_memory"] = torch.cuda.memory_allocated(state.device)
        info["device_total"] = torch.cuda.get_device_properties(state.device).total_memory
    return info
