"""torchdata's ``StatefulDataLoader`` under nbaccel's loaders (``use_stateful_dataloader=True``).

A loader built with it reads its batches through an inner torchdata ``StatefulDataLoader`` built
with the same arguments (its ``base_dataloader``), and *is* one for ``isinstance``: its class
becomes a subclass of both its own class and ``StatefulDataLoader``. Its ``state_dict()`` is
torchdata's state as of the last batch the loader *yielded* (the prepared loaders read one batch
ahead to know when the epoch ends), so ``load_state_dict`` on a fresh loader -- or on a plain
``StatefulDataLoader`` -- continues right after that batch. A state saved after the last batch of
an epoch is marked finished, so loading it starts the next epoch.
"""

from __future__ import annotations

import functools
import types
from typing import Any

__all__ = ["attach_stateful_base", "stateful_base_class", "stateful_variant"]


def stateful_base_class() -> type:
    """torchdata's ``StatefulDataLoader`` class, or ImportError naming the package to install."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as exc:
        raise ImportError(
            "use_stateful_dataloader=True needs torchdata >= 0.8: pip install torchdata"
        ) from exc
    return StatefulDataLoader


def stateful_variant(cls: type) -> type:
    """The subclass of ``cls`` and ``StatefulDataLoader`` a stateful loader of ``cls`` gets."""
    base = stateful_base_class()
    if issubclass(cls, base):
        return cls
    return _variant(cls, base)


@functools.cache
def _variant(cls: type, base: type) -> type:
    """The subclass of ``cls`` and ``base``, made once per class."""

    def body(ns: dict[str, Any]) -> None:
        ns.update(__module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__)

    return types.new_class(cls.__name__, (cls, base), exec_body=body)


def attach_stateful_base(loader: Any, dataset: Any, kwargs: dict[str, Any]) -> None:
    """Give ``loader`` its inner ``StatefulDataLoader`` (same dataset and ``DataLoader``
    arguments), an initial state snapshot, and the stateful class."""
    inner = stateful_base_class()(dataset, **kwargs)
    loader._stateful_base = inner
    loader._stateful_snapshot = inner.state_dict()
    loader.__class__ = stateful_variant(type(loader))


def is_torchdata_state(state: Any) -> bool:
    """True for a state dict written by torchdata (not nbaccel's own position record)."""
    return (
        isinstance(state, dict)
        and "iteration" not in state
        and ("_snapshot" in state or "_num_yielded" in state or "_iterator_finished" in state)
    )
