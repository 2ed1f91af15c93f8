"""The one cloudpickle set-up the launch engine sends code and values with.

cloudpickle 3.1.3 and later replace the file name of every code object they pickle by value with
``"<dynamic-code>"`` (so that payloads are deterministic). For nbaccel that would erase where a
rank's error happened: a function defined in a notebook cell would report
``File "<dynamic-code>", line 6`` and the notebook could no longer show the cell's line. This
pickler keeps each code object's real file name, whichever cloudpickle version is installed.
"""

from __future__ import annotations

import io
import pickle
import threading
import types
from collections import ChainMap
from enum import Enum
from typing import Any

import cloudpickle

__all__ = [
    "Pickler",
    "code_named",
    "dumps",
    "dumps_message",
    "is_plain",
    "plain_class",
    "plain_function",
]

#: the name cloudpickle gives code pickled by value (and the placeholder this module swaps out)
_PLACEHOLDER = "<dynamic-code>"


def code_named(code: types.CodeType, filename: str) -> types.CodeType:
    """``code``, and the code of the functions and classes it defines, under ``filename``
    (where a traceback looks for its lines). Runs where a payload is loaded, and for each run
    of a cached notebook cell."""
    consts = tuple(
        code_named(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    return code.replace(co_filename=filename, co_consts=consts)


def _reduce_code(code: types.CodeType) -> Any:
    if code.co_filename == _PLACEHOLDER:
        return cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    # the placeholder copy is pickled by cloudpickle's own reducer (nested code objects in its
    # constants come back through here and keep their names too)
    return code_named, (code.replace(co_filename=_PLACEHOLDER), code.co_filename)


def _flat(table: Any) -> dict:
    """One dict with what ``table`` (a dict, or a ChainMap of them) maps, first map winning."""
    if isinstance(table, ChainMap):
        flat: dict = {}
        for mapping in reversed(table.maps):
            flat.update(_flat(mapping))
        return flat
    return dict(table)


class Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, keeping the file names of the code it pickles by value."""

    def __init__(self, file: Any, protocol: int | None = None, **options: Any) -> None:
        # A plain dict, which the C pickler searches in C (cloudpickle's ChainMap is searched in
        # Python on every lookup), made per pickler so that later copyreg registrations count.
        self.dispatch_table = _flat(cloudpickle.Pickler.dispatch_table)
        self.dispatch_table[types.CodeType] = _reduce_code
        super().__init__(file, protocol=protocol, **options)


def dumps(obj: Any, protocol: int = pickle.HIGHEST_PROTOCOL) -> bytes:
    """``cloudpickle.dumps`` with code objects keeping their file names."""
    with io.BytesIO() as buffer:
        Pickler(buffer, protocol=protocol).dump(obj)
        return buffer.getvalue()


#: types the C pickler saves exactly as cloudpickle would: builtins, and classes registered with
#: :func:`plain_class` (importable nbaccel classes: the protocol's words, a packed payload)
class _PlainKinds:
    """What the C pickler saves as cloudpickle would: ``atoms`` (builtins, enums and classes
    registered whole), ``instances`` (classes whose instances are plain when their attributes
    are), ``words`` (str enums: a message's tag travels as its value) and ``functions``
    (module-level functions sent by name). Registered at import; read on every message."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.atoms: set[type] = {type(None), bool, int, float, complex, str, bytes}
        self.instances: set[type] = set()
        self.words: set[type] = set()
        self.functions: set[types.FunctionType] = set()

    def add_class(self, cls: type, whole: bool) -> None:
        with self._lock:
            (self.atoms if whole or issubclass(cls, Enum) else self.instances).add(cls)
            if issubclass(cls, Enum) and issubclass(cls, str):
                self.words.add(cls)

    def add_function(self, function: types.FunctionType) -> None:
        with self._lock:
            self.functions.add(function)


_KINDS = _PlainKinds()


def plain_class(cls: type | None = None, *, whole: bool = False) -> Any:
    """Register ``cls`` (importable by name on both ends): an enum's members, or instances whose
    attributes are plain, are then pickled by :func:`dumps_message` without cloudpickle.

    ``whole=True`` (``@plain_class(whole=True)``): every attribute of every instance is always
    of an importable type (the engine's own payloads), so an instance is plain without looking
    inside it: one message costs a few checks, not one per attribute."""

    def register(cls: type) -> type:
        _KINDS.add_class(cls, whole)
        return cls

    return register if cls is None else register(cls)


def plain_function(function: types.FunctionType) -> types.FunctionType:
    """Register a module-level nbaccel ``function`` that the engine itself sends to ranks (a
    pool cell's runner): the C pickler saves it by name, as cloudpickle would, so a call to it
    with plain arguments is packed without cloudpickle's per-object Python hooks."""
    if function.__module__ == "__main__" or "<" in function.__qualname__:
        raise ValueError(f"{function.__qualname__} cannot be pickled by name: not module-level")
    _KINDS.add_function(function)
    return function


def _plain(obj: Any) -> bool:
    """True when ``obj`` is built of builtins and registered classes only (``_PlainKinds``)."""
    kind = type(obj)
    if kind in _KINDS.atoms:
        return True
    if kind is tuple or kind is list:
        return all(map(_plain, obj))
    if kind is dict:
        return all(map(_plain, obj)) and all(map(_plain, obj.values()))
    if kind in _KINDS.instances:
        return all(map(_plain, vars(obj).values()))
    return kind is types.FunctionType and obj in _KINDS.functions


def dumps_message(obj: Any) -> bytes:
    """Pickle one message of the launch protocol: with the C pickler when it holds only plain
    data (a few µs, the common case: outcomes, samples, events), else with :func:`dumps` (a
    user's object in an event, a function). Both give the same bytes to ``pickle.loads``.

    A message's tag (a str enum member first in its tuple: ``Message.RESULT``) travels as its
    plain value, which the receiver compares with the members (equal, same hash): loading a
    member by name looks up its module and class, several times the cost of the whole message
    on a core that idled (a cell's call and outcome on each rank)."""
    if type(obj) is tuple and obj and type(obj[0]) in _KINDS.words:
        obj = (str(obj[0]), *obj[1:])
    if is_plain(obj):
        return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    return dumps(obj)


def is_plain(obj: Any) -> bool:
    """True when the C pickler alone pickles ``obj`` as cloudpickle would: builtins, and
    instances of :func:`plain_class` classes, all the way down."""
    try:
        return _plain(obj)
    except RecursionError:  # deeply nested or cyclic: cloudpickle copes, or says why
        return False
