"""Booleans as people and environments spell them: the one reader of ``"yes"``, ``"0"``, ``"on"``.

True: y, yes, t, true, on, 1. False: n, no, f, false, off, 0 (any case, spaces around ignored):
the words Accelerate's ``str_to_bool`` reads, so a variable set for ``accelerate launch`` means
the same here. Anything else is a ``ValueError`` naming the value, where it came from and the
accepted spellings (a typo in ``FSDP_SYNC_MODULE_STATES`` must not quietly mean False). Every
yes/no value nbaccel reads (environment variables, config files, flags, magics' arguments) goes
through this module; ``tests/unit/test_one_boolean_reader.py`` walks the package for any other.
"""

from __future__ import annotations

import os

__all__ = ["TRUE_WORDS", "FALSE_WORDS", "env_flag", "literal_bool", "parse_bool"]

TRUE_WORDS = ("y", "yes", "t", "true", "on", "1")
FALSE_WORDS = ("n", "no", "f", "false", "off", "0")


def parse_bool(value: object, what: str = "value") -> bool:
    """``"yes"`` -> True, ``"off"`` -> False, ``True`` -> True; ``what`` names it in the error."""
    if isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in FALSE_WORDS:
        return False
    raise ValueError(
        f"{what}={value!r} is not a boolean: use one of {', '.join(TRUE_WORDS)} for true or "
        f"{', '.join(FALSE_WORDS)} for false."
    )


def env_flag(name: str, default: bool | None = False) -> bool | None:
    """Environment variable ``name`` as a boolean; ``default`` when it is unset or empty."""
    value = os.environ.get(name, "")
    return default if not value.strip() else parse_bool(value, name)


def literal_bool(text: str) -> bool | None:
    """``"True"``/``"false"`` (a boolean as Python, JSON or YAML write it) -> the bool; None for
    any other text (``"1"`` stays a number where a value's type is guessed from its text)."""
    word = text.strip().lower()
    return parse_bool(word) if word in ("true", "false") else None
