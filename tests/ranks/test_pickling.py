"""Code sent to ranks keeps its file name (cloudpickle >= 3.1.3 alone would erase it), so a
rank's traceback can point at the notebook cell that raised."""

from __future__ import annotations

import pickle
import traceback

from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import TextRenderer
from nbaccel.launch.wire.pickling import dumps

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


def test_protocol_messages_of_plain_data_skip_cloudpickle_and_load_the_same():
    from nbaccel.launch.wire.pickling import dumps_message
    from nbaccel.launch.wire.protocol import EventKind, Message
    from nbaccel.launch.wire.transport import pack
    from nbaccel.notebook.events import MemorySample

    packed, _ = pack({"loss": 0.5})
    sample = MemorySample(time=1.0, rss=2, rss_peak=3, host_total=4, cuda={"device": "cuda:0"})
    for message in [
        (Message.RESULT, 7, packed),
        (Message.EVENT, EventKind.MEMORY, sample),
        (Message.ERROR, 3, {"frames": [("f.py", 1, "g", "x")], "pickled": b"\x00"}),
    ]:
        data = dumps_message(message)
        assert b"cloudpickle" not in data  # the C pickler wrote it: no reconstructor of theirs
        assert b"Message" not in data  # the tag travels as its value, not as a global
        loaded = pickle.loads(data)
        assert type(loaded[0]) is str and loaded[0] == message[0]  # what receivers compare
        assert hash(loaded[0]) == hash(message[0]) and loaded[0] in (Message.RESULT, message[0])
        assert loaded == message


def test_a_payload_that_refers_to_nothing_shared_travels_as_its_pickle_alone():
    import torch

    from nbaccel.launch.wire.pickling import dumps_message
    from nbaccel.launch.wire.protocol import Message
    from nbaccel.launch.wire.transport import Packed, discard, on_the_wire, pack, take, unpack

    plain, shared = pack({"loss": 0.5, "step": 3})
    assert shared is None
    wire = on_the_wire(plain)
    assert type(wire) is bytes
    data = dumps_message((Message.RESULT, 1, wire))
    assert b"Packed" not in data and b"copyreg" not in data  # no class to look up on loading
    assert unpack(wire) == take(wire) == {"loss": 0.5, "step": 3}
    discard(wire)  # nothing to remove, and no error

    big, shared = pack({"w": torch.arange(100_000, dtype=torch.float32)})
    try:
        assert isinstance(on_the_wire(big), Packed)  # its tensor is in a shared file
        assert torch.equal(unpack(on_the_wire(big))["w"], torch.arange(100_000.0))
    finally:
        shared.release()


def test_protocol_messages_holding_user_objects_still_travel_by_value():
    from nbaccel.launch.wire.pickling import dumps_message
    from nbaccel.launch.wire.protocol import EventKind, Message

    namespace = {"__name__": "__main__"}  # a class defined in a cell: no module to import
    exec("class Point:\n    def __init__(self, x):\n        self.x = x\n", namespace)
    message = (Message.EVENT, EventKind.METRICS, {"point": namespace["Point"](3)})
    data = dumps_message(message)
    assert b"cloudpickle" in data  # pickled by value, as cloudpickle does
    assert pickle.loads(data)[2]["point"].x == 3
    cyclic: list = []
    cyclic.append(cyclic)
    assert pickle.loads(dumps_message((Message.EVENT, EventKind.METRICS, cyclic)))[2][0][0]


def test_a_pool_cell_call_is_packed_by_the_c_pickler_and_loads_as_cloudpickle_would():
    """The engine's own rank functions (registered with ``plain_function``) with plain
    arguments skip cloudpickle's per-object hooks; the payload is the same objects."""
    from nbaccel.launch.wire.pickling import is_plain
    from nbaccel.launch.wire.transport import pack, unpack
    from nbaccel.notebook.rank import pool_worker

    call = (pool_worker.run_cell, ("x = 1\n", "<rank-cell-3>", 2, None), {})
    assert is_plain(call)
    packed, shared = pack(call, element_names=("function", "args", "kwargs"))
    assert shared is None and b"cloudpickle" not in packed.data
    assert unpack(packed) == pickle.loads(dumps(call))
    assert unpack(packed)[0] is pool_worker.run_cell
    # a user's function beside it, or a tensor in the arguments, takes the full path
    assert not is_plain((_cell_function(), (), {}))
    assert not is_plain((pool_worker.push_names, ({"t": __import__("torch").ones(2)},), {}))


def test_only_module_level_functions_can_be_plain():
    import pytest

    from nbaccel.launch.wire.pickling import plain_function

    def nested():
        pass

    with pytest.raises(ValueError, match="not module-level"):
        plain_function(nested)
    with pytest.raises(ValueError, match="not module-level"):
        plain_function(_cell_function())


def test_payloads_with_shared_tensors_or_inherited_objects_still_unpack():
    import multiprocessing

    import torch

    from nbaccel.launch.wire.transport import pack, take, unpack

    big = torch.arange(1 << 16, dtype=torch.float32)
    packed, shared = pack({"t": big})
    try:
        assert packed.records and torch.equal(unpack(packed)["t"], big)
    finally:
        shared.release()
    lock = multiprocessing.get_context("fork").Lock()
    packed, _ = pack((lock,), inherit=True)
    try:
        assert packed.inherited and unpack(packed)[0] is lock
    finally:
        packed.forget_inherited()
    result, _ = pack(None)
    assert not result.records and take(result) is None
