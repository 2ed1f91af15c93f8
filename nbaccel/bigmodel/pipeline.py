"""Pipeline-parallel inference on ``torch.distributed.pipelining`` (Accelerate's ``prepare_pippy``).

``prepare_pippy(model, split_points="auto", example_args=(...))`` cuts the model into one stage
per rank, traces it with torch's ``pipeline`` (``torch.export``), keeps this rank's stage and
runs it with a GPipe schedule: calling the model on rank 0 feeds micro-batches (``num_chunks``)
through every stage; the output appears on the last rank, or on every rank with
``gather_output=True``.

``"auto"`` cuts only at the start of whole blocks (``no_split_module_classes``, by default the
model's ``_no_split_modules``: decoder layers), balancing parameter bytes between stages
(:func:`generate_device_map`). Split points are checked before tracing: a name the model does not
have, or more stages than blocks, is refused naming the numbers and the fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from nbaccel.distributed.collectives import find_batch_size, send_to_device

__all__ = [
    "build_pipeline",
    "find_pippy_batch_size",
    "generate_device_map",
    "pippy_forward",
    "prepare_pippy",
]


def _param_bytes(module: nn.Module, recurse: bool = True) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    )


def _units(model: nn.Module, no_split: set[str]) -> list[tuple[str, int, bool]]:
    """``(name, bytes, is_block)`` of the pieces a pipeline may be cut between, in model order:
    whole blocks (``no_split`` classes) and the leaf modules outside them."""
    found: list[tuple[str, int, bool]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if type(child).__name__ in no_split:
                found.append((full, _param_bytes(child), True))
            elif next(child.children(), None) is None:
                found.append((full, _param_bytes(child), False))
            else:
                own = _param_bytes(child, recurse=False)
                if own:
                    found.append((full, own, False))
                visit(full + ".", child)

    visit("", model)
    return found


def _no_split(model: nn.Module, no_split_module_classes: Sequence[str] | None) -> set[str]:
    if no_split_module_classes is None:
        no_split_module_classes = getattr(model, "_no_split_modules", None) or []
    if isinstance(no_split_module_classes, str):
        no_split_module_classes = [no_split_module_classes]
    classes = {type(m).__name__ for m in model.modules()}
    missing = sorted(set(no_split_module_classes) - classes)
    if missing:
        raise ValueError(
            f"no_split_module_classes names classes that {type(model).__name__} does not have: "
            f"{missing}. Classes in the model: {sorted(classes)[:12]}."
        )
    return set(no_split_module_classes)


def generate_device_map(
    model: nn.Module,
    num_processes: int = 1,
    no_split_module_classes: Sequence[str] | None = None,
    max_memory: dict[int, int | str] | None = None,
) -> dict[str, int]:
    """Which rank (pipeline stage) holds each piece of ``model``: ``{module name: rank}``.

    Pieces are cut at block starts only (``no_split_module_classes``, default the model's
    ``_no_split_modules``), with parameter bytes balanced between the ``num_processes`` stages;
    ``max_memory`` (``{rank: bytes or "10MB"}``) caps each stage and raises when the model
    does not fit.
    """
    from nbaccel.values.sizes import parse_size

    units = _units(model, _no_split(model, no_split_module_classes))
    cuts = _balanced_cuts(units, num_processes)
    device_map: dict[str, int] = {}
    stage = 0
    for index, (name, _, _) in enumerate(units):
        while stage + 1 < num_processes and index == cuts[stage]:
            stage += 1
        device_map[name] = stage
    if max_memory is not None:
        for rank in range(num_processes):
            used = sum(size for (name, size, _) in units if device_map[name] == rank)
            cap = max_memory.get(rank)
            cap = parse_size(cap, f"max_memory[{rank}]") if cap is not None else None
            if cap is not None and used > cap:
                raise ValueError(
                    f"Pipeline stage {rank} needs {used} bytes but max_memory[{rank}] is {cap}: "
                    f"raise max_memory or use more processes (now {num_processes})."
                )
    return device_map


def _balanced_cuts(units: list[tuple[str, int, bool]], stages: int) -> list[int]:
    """Indices into ``units`` where stages 1..stages-1 begin (block starts when there are
    blocks), each as close as possible to an equal share of the bytes."""
    if stages <= 1:
        return []
    candidates = [i for i, u in enumerate(units) if u[2]] or list(range(1, len(units)))
    if len(candidates) < stages - 1:
        raise ValueError(
            f"The model has {len(candidates)} places to cut (block starts) but {stages} pipeline "
            f"stages need {stages - 1}: use at most {len(candidates) + 1} processes, or pass "
            "no_split_module_classes naming smaller blocks."
        )
    prefix = [0]
    for _, size, _ in units:
        prefix.append(prefix[-1] + size)
    total = prefix[-1] or 1
    cuts: list[int] = []
    for k in range(1, stages):
        left = [c for c in candidates if not cuts or c > cuts[-1]]
        left = left[: len(left) - (stages - 1 - k)]  # keep one place for each later cut
        cuts.append(min(left, key=lambda c: abs(prefix[c] - k * total / stages)))
    return cuts


def find_pippy_batch_size(args: Any, kwargs: Any) -> int | None:
    """The batch size of the first tensor in ``args``, else in ``kwargs`` (None if none)."""
    for group in (args or (), tuple((kwargs or {}).values())):
        for item in group:
            found = find_batch_size(item)
            if found is not None:
                return found
    return None


def _check_split_points(model: nn.Module, split_points: list[str], stages: int) -> None:
    names = {n for n, _ in model.named_modules() if n}
    missing = [p for p in split_points if p not in names]
    if missing:
        near = sorted(n for n in names if n.count(".") <= 2)[:10]
        raise ValueError(
            f"split_points {missing} are not modules of {type(model).__name__}: name modules "
            f"where a stage begins, e.g. {near}."
        )
    if len(split_points) + 1 != stages:
        raise ValueError(
            f"{len(split_points)} split points make {len(split_points) + 1} stages, but the run "
            f"has {stages} processes (one stage each): pass {stages - 1} split points, or "
            "split_points='auto'."
        )


def build_pipeline(
    model: nn.Module, split_points: list[str], args: tuple, kwargs: dict | None, num_chunks: int
) -> Any:
    """Trace ``model`` on ``args``/``kwargs`` as given (the example is one micro-batch, as in
    Accelerate: a call's batch is split into ``num_chunks`` micro-batches of the example's
    shape), cut it at ``split_points`` and return this rank's GPipe schedule."""
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    from nbaccel.distributed.state import PartialState

    state = PartialState()
    with _recording_output_spec() as spec:
        pipe = pipeline(
            model,
            mb_args=tuple(args),
            mb_kwargs=dict(kwargs) if kwargs else None,
            split_spec={name: SplitPoint.BEGINNING for name in split_points},
        )
    stage = pipe.build_stage(state.process_index, device=state.device)
    _contiguous_transfers(stage)
    schedule = ScheduleGPipe(stage, num_chunks)
    schedule.nbaccel_output_spec = spec.get("out")
    return schedule


def _contiguous_transfers(stage: Any) -> None:
    """Make what ``stage`` sends and receives between ranks contiguous.

    The traced program keeps each activation's strides, and torch's stage allocates its receive
    buffers with them: an expanded tensor passed between stages (BERT's extended attention
    mask, stride 0 along the batch) gives a non-contiguous send and receive, which gloo and NCCL
    refuse ("input tensor has to be contiguous"). The values are the same either way; the next
    stage's code does not depend on the strides it receives."""
    prepare = getattr(stage, "_prepare_forward_infra", None)
    sends = getattr(stage, "get_fwd_send_ops", None)
    if prepare is None or sends is None or not hasattr(stage, "args_recv_info"):
        return  # another torch: as it comes

    def prepare_contiguous(*args: Any, **kwargs: Any) -> Any:
        result = prepare(*args, **kwargs)
        for infos in stage.args_recv_info.values():
            for info in infos:
                buffer = getattr(info, "buffer", None)
                if isinstance(buffer, torch.Tensor) and not buffer.is_contiguous():
                    fresh = torch.empty(buffer.shape, dtype=buffer.dtype, device=buffer.device)
                    info.buffer = fresh.requires_grad_(buffer.requires_grad)
        return result

    def contiguous_sends(*args: Any, **kwargs: Any) -> Any:
        ops = sends(*args, **kwargs)
        for op in ops:
            if not op.tensor.is_contiguous():
                op.tensor = op.tensor.contiguous()
        return ops

    stage._prepare_forward_infra = prepare_contiguous
    stage.get_fwd_send_ops = contiguous_sends


@contextlib.contextmanager
def _recording_output_spec() -> Iterator[dict[str, Any]]:
    """While torch's ``pipeline`` traces the model, record the traced program's output
    structure (a ``ModelOutput``, a tuple...): the last stage returns only its flat tensors, and
    the caller gets them back in the model's own output type, as the model returns them."""
    from torch.distributed.pipelining._IR import Pipe

    found: dict[str, Any] = {}
    trace = Pipe.__dict__.get("_trace_with_export")
    if not isinstance(trace, staticmethod):  # another torch: the flat output is returned
        yield found
        return

    def recording(*args: Any, **kwargs: Any) -> Any:
        program = trace.__func__(*args, **kwargs)
        found["out"] = getattr(getattr(program, "call_spec", None), "out_spec", None)
        return program

    Pipe._trace_with_export = staticmethod(recording)
    try:
        yield found
    finally:
        Pipe._trace_with_export = trace


def _restructure(output: Any, spec: Any) -> Any:
    """The last stage's flat output (a tensor or a tuple of them) in the traced model's output
    structure (unchanged when the count of tensors does not match it)."""
    if spec is None:
        return output
    from torch.utils._pytree import tree_unflatten

    leaves = list(output) if isinstance(output, tuple | list) else [output]
    if spec.num_leaves != len(leaves):
        return output
    return tree_unflatten(leaves, spec)


def _pad(value: Any, size: int) -> Any:
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] < size:
        extra = value[-1:].expand(size - value.shape[0], *value.shape[1:])
        return torch.cat([value, extra])
    return value


def _trim(value: Any, size: int) -> Any:
    if isinstance(value, torch.Tensor) and value.ndim > 0:
        return value[:size]
    if isinstance(value, tuple | list):
        return type(value)(_trim(v, size) for v in value)
    return value


def pippy_forward(
    forward: Any, num_chunks: int, gather_output: bool, *args: Any, **kwargs: Any
) -> Any:
    """One pipelined call: rank 0 feeds the inputs (padded to a multiple of ``num_chunks``),
    the last rank returns the output (in the model's output type when ``forward`` is a
    schedule's ``step`` from :func:`build_pipeline`); with ``gather_output`` every rank
    returns it."""
    output_spec = getattr(getattr(forward, "__self__", None), "nbaccel_output_spec", None)
    import torch.distributed as dist

    from nbaccel.distributed.state import PartialState

    state = PartialState()
    if state.num_processes == 1:
        return forward(*args, **kwargs)
    output = None
    size = None
    if state.process_index == 0:
        size = find_pippy_batch_size(args, kwargs)
        if size is None:
            raise ValueError("pippy_forward found no tensor with a batch dimension in the inputs.")
        padded = -(-size // num_chunks) * num_chunks
        args, kwargs = send_to_device((args, kwargs), state.device)
        args = tuple(_pad(a, padded) for a in args)
        kwargs = {k: _pad(v, padded) for k, v in kwargs.items()}
        forward(*args, **kwargs)
    elif state.is_last_process:
        output = forward()
    else:
        forward()
    box = [size]
    dist.broadcast_object_list(box, src=0)  # the true batch size, to drop the padding
    if output is not None:
        output = _restructure(_trim(output, box[0]), output_spec)
    if gather_output:
        box = [output]
        dist.broadcast_object_list(box, src=state.num_processes - 1)
        output = send_to_device(box[0], state.device)
    return output


def prepare_pippy(
    model: nn.Module,
    split_points: str | list[str] | None = "auto",
    no_split_module_classes: list[str] | None = None,
    example_args: tuple | None = (),
    example_kwargs: dict[str, Any] | None = None,
    num_chunks: int | None = None,
    gather_output: bool = False,
) -> nn.Module:
    """Make ``model`` a pipeline over the run's ranks, one stage per rank (every rank calls it).

    Args:
        split_points: ``"auto"`` (balanced cuts at block starts) or the module names where
            stages 2..N begin.
        no_split_module_classes: blocks never cut (default: the model's ``_no_split_modules``).
        example_args: one micro-batch as the model takes it (positional), traced whole
            (a call's batch is padded to ``num_chunks`` micro-batches of this shape).
        example_kwargs: the same micro-batch's keyword arguments.
        num_chunks: micro-batches per call (default: the number of processes).
        gather_output: send the output from the last rank to every rank.
    """
    from nbaccel.distributed.state import PartialState

    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model: torch's pipeline tracing "
            "(torch.export of the whole model) cannot capture it as one graph, and Accelerate "
            "does not run encoder-decoder models with prepare_pippy either. Run it with "
            "device_map='auto' (big-model inference) instead, or pipeline a decoder-only model."
        )
    state = PartialState()
    stages = state.num_processes
    num_chunks = num_chunks or stages
    example_args = send_to_device(tuple(example_args or ()), "cpu")
    example_kwargs = send_to_device(example_kwargs, "cpu") if example_kwargs else None
    if split_points in ("auto", None):
        device_map = generate_device_map(model, stages, no_split_module_classes)
        split_points = [next(n for n, r in device_map.items() if r == i) for i in range(1, stages)]
    elif isinstance(split_points, str):
        split_points = [split_points]
    split_points = list(split_points)
    _check_split_points(model, split_points, stages)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # a cache object is no tensor: a traced pipeline cannot pass it
    schedule = build_pipeline(model, split_points, example_args, example_kwargs, num_chunks)
    model._original_forward = model.forward
    model._original_call = model.__call__
    model.pippy_stage = schedule
    model.hf_split_points = split_points

    def forward(*args: Any, **kwargs: Any) -> Any:
        return pippy_forward(schedule.step, num_chunks, gather_output, *args, **kwargs)

    forward.__wrapped__ = model._original_forward  # unwrapping gives the plain forward back
    model.forward = forward
    return model
