"""Re-pointing an optimizer after its model's parameters were replaced.

FSDP2 sharding (``fully_shard``) and moving a model to an XLA device give the model new Parameter
objects; an optimizer built before that still holds the old ones and would update tensors nobody
uses. The strategy that replaced them records ``old -> new`` on the model
(:func:`remember_moves`); :func:`repoint_optimizer` then points any optimizer at the new ones,
whichever order the user prepared things in.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

__all__ = ["remember_moves", "repoint_optimizer"]

_MOVES = "_nbaccel_param_moves"
# torch's activation-checkpoint wrapper inserts this into parameter names
_CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."


def _plain(name: str) -> str:
    return name.replace(_CHECKPOINT_WRAPPER, "")


def remember_moves(
    model: nn.Module, before: Mapping[str, nn.Parameter], after: Mapping[str, nn.Parameter]
) -> None:
    """Record on ``model`` which new parameter replaced each old one (matched by name).

    Kept as ``id(old) -> (weakref(old), new)``: the weak reference guards against id reuse, so a
    new object that gets a freed parameter's id is never mistaken for it.
    """
    plain_after = {_plain(n): p for n, p in after.items()}
    moves = {}
    for name, old in before.items():
        new = plain_after.get(_plain(name))
        if new is not None and new is not old:
            moves[id(old)] = (weakref.ref(old), new)
    target = getattr(model, "_orig_mod", model)
    object.__setattr__(target, _MOVES, {**getattr(target, _MOVES, {}), **moves})


def repoint_optimizer(optimizer: Any, models: nn.Module | Iterable[nn.Module]) -> int:
    """Point ``optimizer``'s param groups at the parameters that replaced the old ones in
    ``models``; return how many were re-pointed (0 when nothing moved).

    Raises when the optimizer already has state for an old parameter (it has stepped: that state
    belongs to a tensor the model no longer uses).
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    models = [models] if isinstance(models, nn.Module) else list(models)
    moves: dict[int, tuple[weakref.ref, nn.Parameter]] = {}
    for model in models:
        moves.update(getattr(getattr(model, "_orig_mod", model), _MOVES, {}))
    if not moves:
        return 0

    def new_for(p: Any) -> nn.Parameter | None:
        entry = moves.get(id(p))
        return entry[1] if entry is not None and entry[0]() is p else None

    if any(inner.state[p] and new_for(p) is not None for p in inner.state):
        raise RuntimeError(
            "This optimizer already has state (it has stepped) for parameters that prepare then "
            "replaced (FSDP2 sharding or a move to an XLA device). Create the optimizer before "
            "its first step, then call accelerator.prepare(model, optimizer)."
        )
    count = 0
    for group in inner.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            new = new_for(p)
            if new is not None:
                params[i] = new
                count += 1
    return count
