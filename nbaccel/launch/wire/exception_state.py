"""An exception as plain data, and back: what a rank raised, rebuilt in the notebook whole.

Pickle rebuilds an exception by calling its class with its ``args``, which fails or goes wrong
for many classes: one whose ``__init__`` takes other arguments than it passes up, one with
keyword-only arguments, one holding a lock, one whose ``__reduce__`` raises; and builtin ones
keep fields outside ``args`` (``OSError("no model")`` rebuilt field by field used to read
``[Errno None] None: None -> None``). So an exception travels as what it is made of
(:func:`exception_state`, on the rank), and is put back together without calling its
``__init__`` (:func:`rebuilt_exception`, in the notebook):

- its class by name, with the names of its bases: the notebook uses the very class it imports
  (``except MyError`` works), or, where it cannot import it (a module only the rank has, a class
  defined inside a function), a stand-in of the same name and module subclassing the nearest
  base it can import;
- ``args`` as they were (when they cannot be loaded here, their reprs);
- the attributes of its ``__dict__`` (one that cannot be pickled is named in ``dropped``) and
  the fields builtin exceptions keep in their own slots (``errno``, ``strerror``, ``filename``,
  ``filename2``; a ``UnicodeError``'s ``encoding``/``start``/``end``; ``SyntaxError``'s
  ``lineno``; ``ImportError``'s ``name``...), unset ones left unset;
- ``str(exc)`` exactly as the rank saw it: the rebuilt object shows that text, whatever its
  class's ``__str__`` would make of the rebuilt state;
- its ``__notes__``, the members of an exception group, and its ``__cause__``/``__context__``
  chain (``__suppress_context__`` included), each rebuilt the same way.

The rebuilt object is an instance of a subclass of that class made here (same name, module and
qualified name; :func:`shown_class`), which shows the carried text and pickles back to itself.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import pickle
import types
from typing import Any

from nbaccel.launch.wire.tracebacks import safe_message

__all__ = [
    "copy_as",
    "exception_instance",
    "exception_state",
    "oldest",
    "plain_class",
    "rebuilt_exception",
    "shown_class",
    "slot_fields",
]

_DEPTH = 16  # exceptions carried behind one (chain links and group members, nested)
_TEXT = "_nbaccel_text"  # the text a rebuilt exception shows, in its __dict__
_NOT_FIELDS = frozenset({"args"})
_GROUP: type | None = getattr(builtins, "BaseExceptionGroup", None)  # Python 3.11+


def _name_of(cls: type) -> tuple[str, str]:
    return (cls.__module__, cls.__qualname__)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """The data descriptors builtin exception classes in ``cls``'s bases define (the slots
    that hold ``errno``, ``lineno``, ``encoding``...), ``args`` and dunders aside."""
    names: list[str] = []
    for klass in cls.__mro__:
        if klass.__module__ != "builtins":
            continue
        for name, attr in vars(klass).items():
            descriptor = isinstance(attr, (types.MemberDescriptorType, types.GetSetDescriptorType))
            wanted = not name.startswith("__") and name not in _NOT_FIELDS
            if descriptor and wanted and name not in names:
                names.append(name)
    return tuple(names)


def slot_fields(exc: BaseException) -> dict[str, Any]:
    """The builtin slot fields of ``exc`` that can be read (None included: a field a
    constructor would fill from args, the rank's exception may have left empty)."""
    fields = {}
    for name in _field_names(type(exc)):
        try:
            value = getattr(exc, name)
        except Exception:  # characters_written when unset, and the like
            continue
        if not isinstance(value, BaseException | tuple | list):
            fields[name] = value
    return fields


def _pack(value: Any) -> bytes | None:
    from nbaccel.launch.wire.pickling import dumps

    try:
        return dumps(value)
    except Exception:
        return None


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__} object>"


def exception_state(exc: BaseException) -> dict[str, Any]:
    """What travels of ``exc`` (plain data, bytes for pickled values): see the module's text."""
    return _state(exc, {id(exc)}, 0)


def _state(exc: BaseException, seen: set[int], depth: int) -> dict[str, Any]:
    cls = type(exc)
    group = _GROUP is not None and isinstance(exc, _GROUP)
    args = exc.args[:1] if group else exc.args
    attrs: dict[str, bytes] = {}
    dropped: list[str] = []
    for name, value in getattr(exc, "__dict__", {}).items():
        if name == "__notes__":
            continue
        packed = _pack(value)
        if packed is None:
            dropped.append(f"{name} ({type(value).__name__}, cannot be pickled)")
        else:
            attrs[name] = packed
    fields = {}
    for name, value in slot_fields(exc).items():
        packed = _pack(value)
        if packed is not None:
            fields[name] = packed

    def behind(other: BaseException | None) -> dict[str, Any] | None:
        if other is None or id(other) in seen or depth >= _DEPTH:
            return None
        seen.add(id(other))
        return _state(other, seen, depth + 1)

    notes = getattr(exc, "__notes__", None)
    return {
        "class": _name_of(cls),
        "bases": [_name_of(b) for b in cls.__mro__[1:] if issubclass(b, BaseException)],
        "text": safe_message(exc),
        "args": _pack(args),
        "args_repr": [_safe_repr(a) for a in args],
        "attrs": attrs,
        "fields": fields,
        "dropped": dropped,
        "notes": [safe_message(n) if not isinstance(n, str) else n for n in notes]
        if isinstance(notes, list | tuple)
        else None,
        "members": [behind(m) for m in exc.exceptions] if group else None,
        "cause": behind(exc.__cause__),
        "context": behind(exc.__context__),
        "suppress": exc.__suppress_context__,
    }


# ----------------------------------------------------------------------------- the notebook side
def _import(name: tuple[str, str]) -> type | None:
    module, qualname = name
    if "<" in qualname:
        return None
    try:
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    except Exception:
        return None
    return target if isinstance(target, type) and issubclass(target, BaseException) else None


@functools.cache
def _standin(base: type, module: str, qualname: str) -> type:
    """A class named as the rank's (``module``.``qualname``) that the notebook cannot import,
    subclassing ``base``, the nearest of its bases the notebook can."""
    return type(
        qualname.rpartition(".")[2],
        (base,),
        {
            "__module__": module,
            "__qualname__": qualname,
            "__doc__": f"Stands in for {module}.{qualname}, which this process cannot import "
            f"(a {base.__name__} raised where it can).",
            "_nbaccel_standin": (base, module, qualname),
        },
    )


def plain_class(cls: type) -> type:
    """The class a rebuilt exception's class (:func:`shown_class`) stands for; ``cls`` itself
    for every other class."""
    return cls.__dict__.get("_nbaccel_shown_base", cls)


def _shown_str(self: BaseException) -> str:
    return self.__dict__.get(_TEXT, "")


def _class_ref(cls: type) -> Any:
    """``cls`` as it pickles: itself, or what its stand-in was made from."""
    return cls.__dict__.get("_nbaccel_standin", cls)


def _class_from(ref: Any) -> type:
    return _standin(*ref) if isinstance(ref, tuple) else ref


def _reduce_shown(self: BaseException) -> tuple[Any, ...]:
    base = plain_class(type(self))
    return _from_pickle, (_class_ref(base), self.args, slot_fields(self), dict(vars(self)))


def _reduce_shown_ex(self: BaseException, protocol: int) -> tuple[Any, ...]:
    return _reduce_shown(self)  # over a class's own __reduce_ex__ too


def _from_pickle(ref: Any, args: tuple, fields: dict, state: dict) -> BaseException:
    return exception_instance(shown_class(_class_from(ref)), args, fields, state)


@functools.cache
def shown_class(base: type) -> type:
    """A subclass of ``base`` with its name, module and qualified name that shows the text its
    instances carry (``str``), and pickles as itself. ``base`` where it cannot be subclassed."""
    try:
        return type(
            base.__name__,
            (base,),
            {
                "__module__": base.__module__,
                "__qualname__": base.__qualname__,
                "__doc__": base.__doc__,
                "__str__": _shown_str,
                "__reduce__": _reduce_shown,
                "__reduce_ex__": _reduce_shown_ex,
                "_nbaccel_shown_base": base,
            },
        )
    except Exception:  # a final class, a metaclass or __init_subclass__ that refuses
        return base


def exception_instance(
    cls: type, args: tuple, fields: dict[str, Any], state: dict[str, Any]
) -> Any:
    """An instance of ``cls`` holding ``args``, slot ``fields`` and ``state`` (its ``__dict__``),
    made without calling ``cls.__init__``."""
    try:
        exc = cls.__new__(cls, *args)
    except Exception:
        exc = cls.__new__(cls)
    if not isinstance(exc, cls):  # a __new__ that returns something else
        exc = BaseException.__new__(cls)
    try:
        exc.args = args
    except Exception:
        pass
    for name, value in fields.items():
        try:
            # only where ``__new__`` made it differ: OSError's str reads set fields, even None
            if getattr(exc, name, None) != value:
                setattr(exc, name, value)
        except Exception:  # read-only (an exception group's members), or refused
            pass
    exc.__dict__.update(state)
    return exc


def copy_as(exc: BaseException, cls: type) -> BaseException:
    """``exc`` as an instance of ``cls`` (a subclass of its class): same args, slot fields,
    attributes, chain and traceback."""
    copy = exception_instance(cls, exc.args, slot_fields(exc), dict(getattr(exc, "__dict__", {})))
    copy.__cause__, copy.__context__ = exc.__cause__, exc.__context__
    copy.__suppress_context__ = exc.__suppress_context__
    copy.__traceback__ = exc.__traceback__
    return copy


def _loaded(data: bytes | None) -> Any:
    if data is None:
        raise ValueError("not carried")
    return pickle.loads(data)


def rebuilt_exception(state: dict[str, Any], text: str | None = None) -> BaseException:
    """The exception :func:`exception_state` described, showing ``text`` (default: the text the
    rank saw). Attributes that could not travel or load are listed in ``dropped`` (``state``'s,
    extended here)."""
    try:
        args = tuple(_loaded(state["args"]))
    except Exception:
        args = tuple(state.get("args_repr") or ())
    members = state.get("members")
    if members is not None:
        args = (*args[:1], [rebuilt_exception(m) for m in members if m is not None])
    attrs = {}
    for name, data in state["attrs"].items():
        try:
            attrs[name] = _loaded(data)
        except Exception as exc:
            state["dropped"].append(f"{name} (cannot be loaded here: {type(exc).__name__})")
    if state.get("notes") is not None:
        attrs["__notes__"] = list(state["notes"])
    attrs[_TEXT] = state["text"] if text is None else text
    fields = {}
    for name, data in state["fields"].items():
        try:
            fields[name] = _loaded(data)
        except Exception:
            continue
    exc = None
    own = _import(state["class"])
    bases = [b for b in map(_import, state["bases"]) if b is not None]
    # the rank's own class; else (or where it cannot be built) a stand-in named as it
    candidates = [own] if own is not None else []
    candidates += [_standin(base, *state["class"]) for base in bases]
    for cls in candidates:
        try:
            exc = exception_instance(shown_class(cls), args, fields, attrs)
            break
        except Exception:
            continue
    if exc is None:  # nothing importable builds it (cannot happen for BaseException itself)
        exc = exception_instance(shown_class(Exception), args, fields, attrs)
    cause, context = state.get("cause"), state.get("context")
    exc.__cause__ = None if cause is None else rebuilt_exception(cause)
    exc.__context__ = None if context is None else rebuilt_exception(context)
    exc.__suppress_context__ = bool(state.get("suppress"))
    return exc


def oldest(exc: BaseException) -> BaseException:
    """The exception at the far end of ``exc``'s chain (its root cause), as Python follows it."""
    seen = {id(exc)}
    while True:
        behind = exc.__cause__
        if behind is None and not exc.__suppress_context__:
            behind = exc.__context__
        if behind is None or id(behind) in seen:
            return exc
        seen.add(id(behind))
        exc = behind
