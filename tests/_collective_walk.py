"""Walking a rank through named paths (gather, save, load...) and checking, at the end of each,
that every rank made the same collectives: :class:`CollectiveWalk` counts the calls each rank
makes through ``torch.distributed``'s functions, and :meth:`CollectiveWalk.end` meets the other
ranks with a ``monitored_barrier`` of a short timeout. A collective one rank makes and another
skips leaves one rank waiting in it: the others' barrier fails within the timeout with the
path's name, instead of a run that never ends; calls that pair up but differ in kind or count
fail the comparison, with the path's name and each rank's calls."""

from __future__ import annotations

import datetime
import functools
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_COUNTED = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
    "barrier", "send", "recv", "isend", "irecv", "broadcast_object_list", "all_gather_object",
    "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "all_to_all_single",
    "batch_isend_irecv",
)  # fmt: skip


class CollectiveWalk:
    """Count this rank's collectives per path; :meth:`end` checks them against every rank's."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.calls: list[str] = []
        self.paused = False
        self.paths: list[str] = []
        self._saved: dict[tuple[Any, str], Any] = {}

    def __enter__(self) -> CollectiveWalk:
        wrappers: dict[int, Any] = {}  # one wrapper per function, the same in both modules
        for module in (dist, c10d):  # (torch compares P2POp's op with c10d.isend / irecv)
            for name in _COUNTED:
                original = getattr(module, name, None)
                if original is None:
                    continue
                self._saved[(module, name)] = original
                wrapper = wrappers.setdefault(id(original), self._counting(name, original))
                setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc: Any) -> None:
        for (module, name), original in self._saved.items():
            setattr(module, name, original)

    def _counting(self, name: str, original: Any) -> Any:
        # a send on one rank pairs with a receive on another: both count as one p2p call
        kind = "p2p" if name in ("send", "recv", "isend", "irecv") else name

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.paused:
                self.calls.append(kind)
            return original(*args, **kwargs)

        return call

    def end(self, path: str) -> None:
        """Meet every rank at the end of ``path``; raise naming it when a rank did not come or
        made other collectives than this one."""
        self.paused = True
        try:
            try:
                dist.monitored_barrier(timeout=self.timeout, wait_all_ranks=True)
            except RuntimeError as err:
                raise AssertionError(
                    f"path {path!r}: a rank did not reach its end within "
                    f"{self.timeout.total_seconds():.0f} s: it is waiting in a collective the "
                    f"other ranks did not make ({err})"
                ) from err
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, self.calls)
            if any(calls != every[0] for calls in every):
                counts = "; ".join(f"rank {r}: {calls}" for r, calls in enumerate(every))
                raise AssertionError(
                    f"path {path!r}: the ranks made different collectives: {counts}"
                )
            self.paths.append(path)
            self.calls = []
        finally:
            self.paused = False
