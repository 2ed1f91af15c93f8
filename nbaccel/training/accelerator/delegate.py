"""A method of a class served by one of the objects its instances hold.

The :class:`~nbaccel.Accelerator` keeps Accelerate's one flat API while its work is done by parts
with their own state (process control, checkpointing, ...). ``gather = Delegate("_control",
ProcessControl.gather)`` in its body makes ``accelerator.gather`` the bound method of
``accelerator._control``: same signature, same docstring, nothing copied by hand.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["Delegate", "DelegatedAttribute"]


class Delegate:
    """``getattr(instance.<holder>, function.__name__)``, read on each access."""

    def __init__(self, holder: str, function: Callable[..., Any]) -> None:
        self.holder = holder
        self.function = function
        functools.update_wrapper(self, function)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:  # on the class: the part's function, for help() and the docs
            return self.function
        return self.function.__get__(getattr(instance, self.holder))


class DelegatedAttribute:
    """An attribute of the class's instances that lives on one of the objects they hold
    (``flag_tensor = DelegatedAttribute("_control", "flag_tensor")``): read and written there."""

    def __init__(self, holder: str, name: str) -> None:
        self.holder = holder
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return getattr(getattr(instance, self.holder), self.name)

    def __set__(self, instance: Any, value: Any) -> None:
        setattr(getattr(instance, self.holder), self.name, value)
