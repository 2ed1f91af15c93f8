"""A rank's exception, described where it was raised and rebuilt in the notebook, arrives whole.

One table of exceptions people meet (the standard library's, torch's, transformers',
huggingface_hub's, safetensors', DeepSpeed's, and user classes of awkward shapes), each raised for
real, described as a rank describes it (``describe_exception``), sent through pickle as the channel
sends it, and rebuilt as the driver rebuilds it (``rebuild_exception``). Each must keep: its type
(or a stand-in of the same name subclassing the nearest importable base), ``str`` exactly as the
rank saw it, the rank named in a note and in ``rank``/``host``, ``args``, the slot fields of
builtin exceptions (``errno``, ``filename``...), its attributes, ``__notes__``, its chain and its
group's members; and it must pickle again. The same shapes through real launches:
``tests/ranks/test_exception_fronts.py``.
"""

from __future__ import annotations

import builtins
import errno
import pickle
import re
import sys
import traceback
from pathlib import Path

import pytest
from exception_table import CASES, raised

from nbaccel.launch.wire.errors import describe_exception, rebuild_exception, remote_traceback

#: the slot fields compared (builtin exceptions keep them outside args and __dict__)
_FIELDS = ("errno", "strerror", "filename", "filename2", "characters_written", "encoding",
           "object", "start", "end", "reason", "lineno", "offset", "text", "msg", "name",
           "path", "value", "code", "returncode", "cmd", "output", "stderr", "timeout", "doc",
           "pos", "colno")  # fmt: skip


_GROUP = getattr(builtins, "BaseExceptionGroup", ())  # Python 3.11+


def _travel(exc: BaseException, rank: int = 1) -> BaseException:
    info = describe_exception(exc)
    return rebuild_exception(pickle.loads(pickle.dumps(info)), rank)


def _field(exc: BaseException, name: str) -> object:
    try:
        return getattr(exc, name)
    except Exception as err:
        return f"<{type(err).__name__}>"


def _importable(cls: type) -> type:
    """``cls``, or its nearest base that can be imported by name (not defined in a function)."""
    return next(c for c in cls.__mro__ if "<locals>" not in c.__qualname__)


def _same(original: BaseException, rebuilt: BaseException, added: tuple[str, ...] = ()) -> None:
    """``rebuilt`` is ``original`` as the notebook holds it; ``added``: the notes the notebook
    added after the rank's own."""
    cls = type(original)
    assert type(rebuilt).__name__ == cls.__name__
    assert type(rebuilt).__module__ == cls.__module__
    assert type(rebuilt).__qualname__ == cls.__qualname__
    assert isinstance(rebuilt, _importable(cls))  # the class itself, or a stand-in's base
    assert str(rebuilt) == str(original)
    assert repr(rebuilt.args) == repr(original.args)
    for name in _FIELDS:
        assert repr(_field(rebuilt, name)) == repr(_field(original, name)), name
    notes = getattr(original, "__notes__", None)
    if added:
        assert rebuilt.__notes__ == [*(notes or ()), *added]
    else:
        assert getattr(rebuilt, "__notes__", None) == notes
    for name, value in vars(original).items():
        if name != "__notes__" and name != "lock":
            assert repr(getattr(rebuilt, name)) == repr(value), name
    if isinstance(original, _GROUP):
        assert len(rebuilt.exceptions) == len(original.exceptions)
        for mine, theirs in zip(rebuilt.exceptions, original.exceptions):
            _same(theirs, mine)


def test_the_table_is_wide():
    assert len(CASES) >= 30
    origins = {case.origin for case in CASES.values()}
    assert origins >= {"stdlib", "torch", "transformers", "huggingface_hub", "safetensors",
                       "deepspeed", "user"}  # fmt: skip


@pytest.mark.parametrize("kind", list(CASES))
def test_an_exception_arrives_whole(kind):
    original = raised(kind)
    rebuilt = _travel(original)
    _same(original, rebuilt, ("raised on rank 1",))
    assert rebuilt.rank == 1 and rebuilt.host is None
    remote = remote_traceback(rebuilt)
    assert remote and "Traceback from rank 1" in remote
    # what the notebook prints: the rank's frames, then the exception, its message, the rank
    shown = "".join(traceback.format_exception(rebuilt))
    if isinstance(original, SyntaxError):  # Python shows its fields (file, line, caret, msg)
        assert f"SyntaxError: {original.msg}" in shown and 'File "cell.py", line 1' in shown
    else:
        assert f"{type(original).__name__}: {original}\n" in shown
    assert re.search(r"^[ |]*raised on rank 1$", shown, re.M)  # the note, under the message
    # and it pickles again (a detached run keeps it; the pool hands it on): same text
    again = pickle.loads(pickle.dumps(rebuilt))
    assert type(again).__name__ == type(original).__name__
    assert isinstance(again, _importable(type(original)))
    assert str(again) == str(rebuilt) and repr(again.args) == repr(original.args)


def test_oserror_of_one_message_shows_its_message_not_an_errno_form():
    rebuilt = _travel(raised("oserror_message"))
    assert str(rebuilt) == "model foo/bar not found"
    assert (rebuilt.errno, rebuilt.strerror, rebuilt.filename, rebuilt.filename2) == (None,) * 4
    assert "Errno" not in "".join(traceback.format_exception(rebuilt))


def test_chain_and_notes_arrive_as_objects():
    original = raised("chained")
    rebuilt = _travel(original)
    cause = rebuilt.__cause__
    assert isinstance(cause, FileNotFoundError) and cause.errno == errno.ENOENT
    assert cause.filename == "/nope/weights.bin" and str(cause) == str(original.__cause__)
    assert cause.__notes__ == ["while loading shard 3"]
    context = cause.__context__
    assert isinstance(context, KeyError) and context.args == ("weights",)
    assert rebuilt.__suppress_context__ and not cause.__suppress_context__
    remote = remote_traceback(rebuilt)
    assert remote.index("KeyError: 'weights'") < remote.index("FileNotFoundError")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception groups are Python 3.11+")
def test_a_group_keeps_its_members_and_their_chains():
    original = raised("exception_group")
    rebuilt = _travel(original)
    assert isinstance(rebuilt, builtins.ExceptionGroup)
    assert [type(e).__name__ for e in rebuilt.exceptions] == ["ValueError", "OSError", "KeyError"]
    assert isinstance(rebuilt.exceptions[1].__cause__, TimeoutError)
    matched, rest = rebuilt.split(OSError)
    assert matched is not None and len(matched.exceptions) == 1 and len(rest.exceptions) == 2


def test_a_class_the_notebook_cannot_import_arrives_as_a_stand_in(tmp_path: Path):
    (tmp_path / "rank_only_errors.py").write_text(
        "class ShardLost(ConnectionError):\n"
        "    def __init__(self, shard):\n"
        "        super().__init__(f'shard {shard} lost')\n"
        "        self.shard = shard\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import rank_only_errors

        try:
            raise rank_only_errors.ShardLost(4)
        except ConnectionError as exc:
            info = pickle.dumps(describe_exception(exc))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("rank_only_errors", None)
    rebuilt = rebuild_exception(pickle.loads(info), 0)
    assert type(rebuilt).__name__ == "ShardLost"
    assert type(rebuilt).__module__ == "rank_only_errors"
    assert isinstance(rebuilt, ConnectionError) and isinstance(rebuilt, OSError)
    assert str(rebuilt) == "shard 4 lost" and rebuilt.shard == 4
    assert rebuilt.__notes__ == ["raised on rank 0"]
    again = pickle.loads(pickle.dumps(rebuilt))
    assert type(again).__name__ == "ShardLost" and str(again) == str(rebuilt)


def test_what_cannot_travel_is_named():
    rebuilt = _travel(raised("unpicklable_member"))
    assert not hasattr(rebuilt, "lock") and rebuilt.path == "/data/shard-3"
    assert "not carried to the notebook: lock (lock, cannot be pickled)" in remote_traceback(
        rebuilt
    )


def test_a_rank_on_another_host_is_named_with_its_host():
    from nbaccel.launch.wire.errors import failure_text, where_raised
    from nbaccel.launch.wire.labels import RankLabels

    info = describe_exception(raised("oserror_message"))
    rebuilt = rebuild_exception(pickle.loads(pickle.dumps(info)), 5, RankLabels({5: "node2"}))
    assert str(rebuilt) == "model foo/bar not found"
    assert (rebuilt.rank, rebuilt.host) == (5, "node2")
    assert rebuilt.__notes__ == ["raised on rank 5 @ node2"]
    assert where_raised(rebuilt) == "rank 5 @ node2"
    assert failure_text(rebuilt) == "OSError: model foo/bar not found (raised on rank 5 @ node2)"
    assert where_raised(ValueError("not from a rank")) is None


def test_a_hint_for_a_rank_reading_stdin_is_a_note_not_part_of_the_message():
    try:
        raise EOFError("EOF when reading a line")
    except EOFError as exc:
        rebuilt = _travel(exc)
    assert str(rebuilt) == "EOF when reading a line"
    assert rebuilt.__notes__[0] == "raised on rank 1"
    assert "ranks have no stdin" in rebuilt.__notes__[1]


class _HostDown(ConnectionError):
    def __init__(self, host: str) -> None:
        super().__init__(f"{host} is down")
        self.host = host


def test_an_exceptions_own_host_attribute_is_kept_and_the_note_names_the_rank():
    from nbaccel.launch.wire.errors import where_raised
    from nbaccel.launch.wire.labels import RankLabels

    info = describe_exception(_HostDown("db1"))
    rebuilt = rebuild_exception(pickle.loads(pickle.dumps(info)), 3, RankLabels({3: "nbh2"}))
    assert (rebuilt.host, rebuilt.rank) == ("db1", 3)  # its own, kept; the rank, added
    assert rebuilt.__notes__ == ["raised on rank 3 @ nbh2"]
    assert where_raised(rebuilt) == "rank 3 @ nbh2"
    assert where_raised(pickle.loads(pickle.dumps(rebuilt))) == "rank 3 @ nbh2"
