"""What a launch option is: the fronts it can be given on (:class:`Front`), its help, check,
parsing and spellings (:class:`Option`), and :func:`option`, the dataclass field that carries
one. :class:`~nbaccel.launch.request.LaunchRequest` is built from these fields.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Flag, auto
from typing import Any

__all__ = ["Front", "Option", "option"]


class Front(Flag):
    """A way into a launch: where an option can be given, and who launches (each rank's
    ``NBACCEL_LAUNCHER``, :attr:`launcher_name`)."""

    LAUNCHER = auto()  # notebook_launcher(..., name=value) / debug_launcher
    MAGIC = auto()  # %%distributed --name value, and the pool behind it (start_pool)
    CLI = auto()  # nbaccel launch --name value
    TESTING = auto()  # nbaccel.testing.run_on_ranks
    REMOTE = auto()  # not a way in: marks an option that is a field of RemoteOptions
    ALL = LAUNCHER | MAGIC | CLI

    @property
    def launcher_name(self) -> str:
        """What the ranks of a launch through this front see in ``NBACCEL_LAUNCHER``."""
        return _LAUNCHER_NAMES[self]


_LAUNCHER_NAMES = {
    Front.LAUNCHER: "notebook",
    Front.MAGIC: "pool",
    Front.CLI: "cli",
    Front.TESTING: "testing",
}


@dataclass(frozen=True)
class Option:
    """What a :class:`LaunchRequest` field is to the fronts.

    Args:
        help: one line for ``--help`` and the docs.
        fronts: where it can be given.
        check: validates (and normalises) a given value; raises ValueError naming the fix.
        parse: text -> value for the text fronts (the magic, the command line).
        choices: the allowed values, shown in the help.
        flags: the text fronts' spellings, by front (default ``--name``); the command line
            keeps Accelerate's names (``--num_machines`` is ``num_nodes``).
        metavar: the value's name in the help.
    """

    help: str
    fronts: Front
    check: Callable[[Any], Any] | None = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    flags: Mapping[Front, tuple[str, ...]] = field(default_factory=dict)
    metavar: str | None = None

    def spellings(self, name: str, front: Front) -> tuple[str, ...]:
        """The flags of this option on a text front (``--name``, its hyphenated twin, ...)."""
        flags = list(self.flags.get(front, (f"--{name}",)))
        for flag in list(flags):
            twin = flag.replace("_", "-")
            if flag.startswith("--") and twin not in flags:
                flags.append(twin)
        return tuple(flags)

    def dest(self, name: str, front: Front) -> str:
        """Where a text front's parser keeps the value: ``name``, or the first long flag's
        name where the front spells it its own way (``--num_machines``: ``num_machines``)."""
        given = self.flags.get(front)
        if given is None:
            return name
        return next(f for f in given if f.startswith("--"))[2:].replace("-", "_")

    def argparse(self, name: str, default: Any, front: Front) -> dict[str, Any]:
        """``add_argument`` keywords for a text front; not given stays None (the request's
        default applies), so a front can tell what was asked for."""
        dest = self.dest(name, front)
        if isinstance(default, bool) and self.parse is None:
            return {"dest": dest, "action": "store_true", "default": None, "help": self.help}
        kwargs: dict[str, Any] = {"dest": dest, "default": None, "help": self.help}
        if self.parse is not None:
            kwargs["type"] = self.parse
        if self.choices is not None:
            kwargs["choices"] = self.choices
        if self.metavar is not None:
            kwargs["metavar"] = self.metavar
        return kwargs


def option(
    default: Any, help: str, fronts: Front, **spec: Any
) -> Any:  # a dataclass field: typed as its value for the checker
    """A :class:`LaunchRequest` field with its :class:`Option` (``spec``: its other fields)."""
    meta = {"option": Option(help, fronts, **spec)}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
