"""Reading and temporarily changing ``os.environ``: the helpers launch configs and tests rely on.

``patch_environment`` / ``clear_environment`` are context managers that always restore the
environment as it was; ``purge_nbaccel_environment`` does the same around a test function or
every test of a class (subclasses included) for the ``ACCELERATE_*`` and ``NBACCEL_*`` variables a
run may leave behind.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from nbaccel.values.booleans import parse_bool

__all__ = [
    "clear_environment",
    "convert_dict_to_env_variables",
    "get_int_from_env",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "purge_accelerate_environment",
    "purge_nbaccel_environment",
    "str_to_bool",
]

_PURGED_PREFIXES = ("ACCELERATE_", "NBACCEL_")
_FORBIDDEN = (";", "\n", "<", ">", " ")
_LOG = logging.getLogger("nbaccel.utils.environment")
_T = TypeVar("_T")


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """``"yes"/"true"/"1"...`` -> 1, ``"no"/"false"/"0"...`` -> 0 (``True``/``False`` with
    ``to_bool``); anything else is a ``ValueError`` naming the accepted spellings."""
    flag = parse_bool(value)
    return flag if to_bool else int(flag)


def get_int_from_env(env_keys: list[str] | tuple[str, ...], default: int) -> int:
    """The first of ``env_keys`` that is set and non-negative, as an int, else ``default``."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Environment variable ``key`` read as a boolean (``default`` when unset)."""
    return parse_bool(os.environ.get(key, str(default)), key)


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """Environment variable ``key`` as a string (``default`` when unset)."""
    return str(os.environ.get(key, str(default)))


def convert_dict_to_env_variables(current_env: dict) -> list[str]:
    """``{"A": "1"}`` -> ``["A=1\\n"]`` for an env file. Entries with an empty part or a shell
    metacharacter (``; < >``, space, newline) are skipped with a warning on the
    ``nbaccel.utils.environment`` logger (the public path of this helper)."""
    lines = []
    for key, value in current_env.items():
        key, value = str(key), str(value)
        if key and value and not any(c in key + value for c in _FORBIDDEN):
            lines.append(f"{key}={value}\n")
        else:
            _LOG.warning(f"Skipping {key}={value}: empty, or contains one of {list(_FORBIDDEN)}.")
    return lines


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set each keyword as an (upper-cased) environment variable inside the block; afterwards
    every one of them is restored to its previous value or removed."""
    saved = {key.upper(): os.environ.get(key.upper()) for key in kwargs}
    for key, value in kwargs.items():
        os.environ[key.upper()] = str(value)
    try:
        yield
    finally:
        _restore(saved)


@contextmanager
def clear_environment() -> Iterator[None]:
    """Run the block with an empty ``os.environ``; the original mapping is restored after,
    including variables the block set or removed."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def _purged() -> Iterator[None]:
    before = {k: v for k, v in os.environ.items() if k.startswith(_PURGED_PREFIXES)}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(_PURGED_PREFIXES)]:
            if key not in before:
                del os.environ[key]
        os.environ.update(before)


def _purging(func: Callable[..., _T]) -> Callable[..., _T]:
    if getattr(func, "_nbaccel_purges_environment", False):
        return func

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        with _purged():
            return func(*args, **kwargs)

    wrapper._nbaccel_purges_environment = True  # type: ignore[attr-defined]
    return wrapper


def _purge_class(cls: type) -> type:
    for name, attr in list(vars(cls).items()):
        if name.startswith("test") and callable(attr):
            setattr(cls, name, _purging(attr))
    parent_hook = cls.__init_subclass__

    def __init_subclass__(sub: type, **kwargs: Any) -> None:
        parent_hook(**kwargs)
        _purge_class(sub)

    cls.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
    return cls


def purge_nbaccel_environment(func_or_cls: _T) -> _T:
    """Decorator: ``ACCELERATE_*``/``NBACCEL_*`` variables set by the function (or by any test
    method of the class and its subclasses) are removed, and changed ones restored, after it."""
    if isinstance(func_or_cls, type):
        return _purge_class(func_or_cls)  # type: ignore[return-value]
    return _purging(func_or_cls)  # type: ignore[arg-type,return-value]


purge_accelerate_environment = purge_nbaccel_environment
