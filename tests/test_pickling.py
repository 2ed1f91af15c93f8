"""Code sent to ranks keeps its file name (cloudpickle >= 3.1.3 alone would erase it), so a
rank's traceback can point at the notebook cell that raised."""

from __future__ import annotations

import pickle
import traceback

from nbaccel import notebook_launcher
from nbaccel.launch.pickling import dumps
from nbaccel.launch.render import TextRenderer

CELL = "/tmp/ipykernel_1/123456.py"
SOURCE = """
def outer(x):
    def inner():
        raise ValueError(f"bad {x}")
    return inner()
"""


def _cell_function():
    namespace = {"__name__": "__main__"}  # like a notebook cell: pickled by value
    exec(compile(SOURCE, CELL, "exec"), namespace)
    return namespace["outer"]


def test_function_and_nested_code_keep_their_file_name():
    loaded = pickle.loads(dumps(_cell_function()))
    assert loaded.__code__.co_filename == CELL
    try:
        loaded(3)
    except ValueError as exc:
        frames = traceback.extract_tb(exc.__traceback__)
    assert [(f.filename, f.name) for f in frames[-2:]] == [(CELL, "outer"), (CELL, "inner")]


def test_payload_is_still_loadable_by_plain_pickle_and_repeatable():
    fn = _cell_function()
    assert dumps(fn) == dumps(fn)
    assert pickle.loads(dumps(lambda: 7))() == 7


def test_rank_traceback_names_the_cell_file():
    try:
        notebook_launcher(
            _cell_function(), (5,), num_processes=2, renderer=TextRenderer(quiet=True)
        )
    except ValueError as exc:
        text = "".join(traceback.format_exception(exc))
    assert f'File "{CELL}", line 4, in inner' in text
    assert "bad 5" in text
