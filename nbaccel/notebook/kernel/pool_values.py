"""Named values between the notebook and a pool's ranks: ``%dist_push`` and ``%dist_pull``.

A push defines names on the ranks (large CPU tensors travel through shared memory, mapped by
each rank, never copied through a socket); a pull brings one name's value back from each rank.
Both are ordinary pool calls of :mod:`nbaccel.notebook.rank.pool_worker`; what is theirs is the
wording of a refusal: the name the user typed, not "the function" and "its return value".
``pool`` is a :class:`~nbaccel.notebook.kernel.pool.Pool` (typed ``Any``: the pool imports this
module, and layers point one way).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.wire.transport import pack
from nbaccel.launch.wire.unpicklable import ResultNotSendable, UnpicklableError
from nbaccel.notebook.rank import pool_worker

__all__ = ["pull", "push"]


def push(
    pool: Any,
    values: dict[str, Any],
    ranks: Iterable[int] | None = None,
    renderer: Renderer | None = None,
) -> None:
    """Define ``values`` (name -> object) on ``ranks`` of ``pool``. A value that cannot travel
    is named in the error (``UnpicklableError``), and no shared memory is left behind."""
    __tracebackhide__ = True
    try:
        pool.call(pool_worker.push_names, values, ranks=ranks, renderer=renderer)
    except UnpicklableError:
        for name, value in values.items():  # which name: pack each alone, by its name
            try:
                _, shared = pack(value, name=name)
            except UnpicklableError as exc:
                raise UnpicklableError(str(exc)) from None
            if shared is not None:
                shared.release()
        raise


def pull(
    pool: Any, name: str, ranks: Iterable[int] | None = None, renderer: Renderer | None = None
) -> dict[int, Any]:
    """The value of ``name`` on each of ``ranks`` of ``pool`` (default all)."""
    __tracebackhide__ = True
    try:
        return pool.call(pool_worker.pull_name, name, ranks=ranks, renderer=renderer)
    except ResultNotSendable as exc:  # worded for a call: "the function ... return value"
        if exc.culprit is None:
            raise
        where = (exc.where or "").replace(exc.value_name, name, 1) or name
        raise ResultNotSendable(
            f"{where} ({exc.culprit}) on rank {getattr(exc, 'rank', '?')} cannot be brought "
            f"into the notebook: {exc.cause}. Make something picklable from it on the ranks "
            f"(numbers, tensors, lists, dicts, a state_dict; list({name}) of a generator) and "
            "pull that instead."
        ) from None
