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
import types
from collections import ChainMap
from typing import Any

import cloudpickle

__all__ = ["Pickler", "dumps"]

#: the name cloudpickle gives code pickled by value (and the placeholder this module swaps out)
_PLACEHOLDER = "<dynamic-code>"


def _named(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` with its file name back (runs where the payload is loaded)."""
    return code.replace(co_filename=filename)


def _reduce_code(code: types.CodeType) -> Any:
    if code.co_filename == _PLACEHOLDER:
        return cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    # the placeholder copy is pickled by cloudpickle's own reducer (nested code objects in its
    # constants come back through here and keep their names too)
    return _named, (code.replace(co_filename=_PLACEHOLDER), code.co_filename)


class Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, keeping the file names of the code it pickles by value."""

    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)


def dumps(obj: Any, protocol: int = pickle.HIGHEST_PROTOCOL) -> bytes:
    """``cloudpickle.dumps`` with code objects keeping their file names."""
    with io.BytesIO() as buffer:
        Pickler(buffer, protocol=protocol).dump(obj)
        return buffer.getvalue()
