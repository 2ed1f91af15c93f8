"""How a rank's exception or exit reads in the notebook: one launch per shape of exception.

Every case runs a real two-rank launch; rank 1 misbehaves. The rules (``launch/wire/errors.py``):
the original type, ``str`` as the rank saw it and the rank named beside it (a note and ``e.rank``),
whatever the exception's args or ``__str__`` look like; ``sys.exit(0)``/``exit()`` are success; a
value the notebook cannot unpickle is named as such, not as the rank's import error.
"""

from __future__ import annotations

import os
import pickle
import re
import sys
import threading
import traceback

import pytest
import torch
from recorder import Recorder

from nbaccel import ResultNotLoadable, notebook_launcher
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.wire.errors import RankCrashed, remote_traceback


def _on_rank_1(exc: BaseException) -> None:
    if os.environ["RANK"] == "1":
        raise exc


class _BrokenStr(Exception):
    def __str__(self) -> str:
        raise AttributeError("no message here")


class _NeedsKeyword(Exception):
    def __init__(self, *, code: int) -> None:
        super().__init__(f"code {code}")
        self.code = code


def _raise(kind: str) -> None:
    import errno

    made = {
        "value_int": lambda: ValueError(42),
        "value_two_args": lambda: ValueError("bad", 7),
        "os_error": lambda: FileNotFoundError(errno.ENOENT, "No such file", "/nope/x"),
        "key_error": lambda: KeyError("weights"),
        "broken_str": lambda: _BrokenStr("x"),
        "keyword_only": lambda: _NeedsKeyword(code=3),
        "keyboard_interrupt": lambda: KeyboardInterrupt("raised by the code"),
    }[kind]()
    _on_rank_1(made)


CASES = {
    # kind: (type, exact message)
    "value_int": (ValueError, "42"),
    "value_two_args": (ValueError, "('bad', 7)"),
    "os_error": (FileNotFoundError, "[Errno 2] No such file: '/nope/x'"),
    "key_error": (KeyError, "'weights'"),
    "broken_str": (
        _BrokenStr,
        "<_BrokenStr.__str__ failed: AttributeError: no message here>",
    ),
    "keyword_only": (_NeedsKeyword, "code 3"),
    "keyboard_interrupt": (KeyboardInterrupt, "raised by the code"),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_rank_exception_keeps_type_and_label(kind):
    expected_type, message = CASES[kind]
    with pytest.raises(BaseException) as info:
        notebook_launcher(_raise, (kind,), num_processes=2, renderer=Renderer())
    exc = info.value
    assert isinstance(exc, expected_type) and type(exc).__name__ == expected_type.__name__
    assert str(exc) == message
    assert exc.rank == 1 and exc.__notes__[-1] == "raised on rank 1"
    if kind == "os_error":
        assert (exc.errno, exc.filename) == (2, "/nope/x")
    if kind in ("value_int", "value_two_args"):  # the args themselves are kept
        assert exc.args == ((42,) if kind == "value_int" else ("bad", 7))
        again = pickle.loads(pickle.dumps(exc))  # and it pickles, label and args kept
        assert isinstance(again, ValueError) and again.args == exc.args
        assert str(again) == message


def _exits(how: str) -> str:
    if os.environ["RANK"] == "1":
        if how == "sys.exit(0)":
            sys.exit(0)
        if how == "exit()":
            exit()
        sys.exit(5)
    return "done"


def test_sys_exit_zero_and_exit_are_success():
    assert notebook_launcher(_exits, ("sys.exit(0)",), num_processes=2, renderer=Renderer()) == [
        "done",
        None,
    ]
    assert notebook_launcher(_exits, ("exit()",), num_processes=2, renderer=Renderer()) == [
        "done",
        None,
    ]
    with pytest.raises(Exception, match=r"rank 1 exited with code 5 \(sys.exit\)"):
        notebook_launcher(_exits, ("sys.exit(5)",), num_processes=2, renderer=Renderer())


def _rank_only_value(folder: str):
    sys.path.insert(0, folder)
    import nbaccel_rank_only_module

    return nbaccel_rank_only_module.Thing()


def test_result_the_notebook_cannot_load_is_named(tmp_path):
    (tmp_path / "nbaccel_rank_only_module.py").write_text("class Thing:\n    pass\n")
    with pytest.raises(ResultNotLoadable) as info:
        notebook_launcher(_rank_only_value, (str(tmp_path),), num_processes=2, renderer=Renderer())
    text = str(info.value)
    assert "the function succeeded" in text
    assert "'nbaccel_rank_only_module'" in text and "importable in the notebook" in text
    assert not isinstance(info.value, ModuleNotFoundError)


def _shm() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("nbaccel-")}


def _returns_tensor(n: int):
    rank = int(os.environ["RANK"])
    whole = torch.arange(n, dtype=torch.float32) + rank
    return {"whole": whole, "view": whole[1:3], "small": torch.ones(2) * rank}


def _mapped_file(address: int) -> str:
    """The file behind the memory at ``address`` in this process ('' for anonymous memory)."""
    with open("/proc/self/maps") as handle:
        for line in handle:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


def test_large_result_arrives_through_shared_memory_and_leaves_nothing():
    before = _shm()
    n = 1 << 16  # 256 KiB: above the shared-memory threshold
    results = notebook_launcher(_returns_tensor, (n,), num_processes=2, renderer=Renderer())
    for rank, value in enumerate(results):
        assert torch.equal(value["whole"], torch.arange(n, dtype=torch.float32) + rank)
        assert torch.equal(value["small"], torch.ones(2) * rank)
        # a view stays a view of the same storage, and that storage is writable here
        assert (
            value["view"].untyped_storage().data_ptr()
            == value["whole"].untyped_storage().data_ptr()
        )
        value["whole"][1] = -1.0
        assert float(value["view"][0]) == -1.0
        # the kernel holds the pages the rank wrote (a shared file, already unlinked): no copy
        where = _mapped_file(value["whole"].data_ptr())
        assert where.startswith("/dev/shm/nbaccel-") and where.endswith("(deleted)"), where
    assert _shm() - before == set()


def _runaway(kind: str) -> None:
    def down(n: int) -> int:
        return down(n + 1)

    if os.environ["RANK"] == "1":
        if kind == "recursion":
            down(0)
        raise ValueError("m" * 500_000 + "END")


def test_a_huge_message_is_cut_with_a_notice_and_kept_whole_in_args():
    with pytest.raises(ValueError) as info:
        notebook_launcher(_runaway, ("message",), num_processes=2, renderer=Renderer())
    exc = info.value
    shown = str(exc)
    assert shown.startswith("mmm") and "END" not in shown
    assert shown.endswith(
        "[490,003 more characters not shown: the whole message is in the exception's args]"
    )
    assert exc.args == ("m" * 500_000 + "END",)  # nothing lost
    text = "".join(traceback.format_exception(exc))  # what the notebook prints, cause included
    assert len(text) < 25_000 and text.count("more characters not shown") == 2
    again = pickle.loads(pickle.dumps(exc))
    assert isinstance(again, ValueError) and again.args == exc.args


def test_a_runaway_recursion_collapses_as_python_collapses_it():
    with pytest.raises(RecursionError) as info:
        notebook_launcher(_runaway, ("recursion",), num_processes=2, renderer=Renderer())
    remote = remote_traceback(info.value)
    assert remote.count("in down") == 3  # three shown, then the notice, as Python does
    repeated = re.search(r"\[Previous line repeated (\d+) more times\]", remote)
    assert repeated and int(repeated.group(1)) > 900
    assert len(remote.splitlines()) < 20
    assert str(info.value) == "maximum recursion depth exceeded" and info.value.rank == 1


def test_frame_runs_collapse_like_pythons_own_tracebacks():
    """format_frames against traceback.format_list on the same frames: runs of 1 to 5 calls."""
    from nbaccel.launch.wire.tracebacks import format_frames

    def run(depth: int, n: int = 0) -> None:
        if n < depth:
            run(depth, n + 1)
        else:
            raise KeyError("bottom")

    for depth in range(6):
        try:
            run(depth)
        except KeyError as err:
            summary = traceback.extract_tb(err.__traceback__)
        ours = format_frames(
            {
                "frames": [(f.filename, f.lineno, f.name, f.line) for f in summary],
                "name": "KeyError",
                "message": "'bottom'",
            },
            None,
        )
        pythons = [
            line
            for chunk in summary.format()
            for line in chunk.splitlines()
            if not set(line.strip()) <= {"^", "~"}  # Python 3.11's carets under the code
        ]
        assert ours.splitlines()[1:-1] == pythons, depth


def _load(path: str) -> str:
    with open(path) as file:
        return file.read()


def _chained(how: str) -> None:
    if os.environ["RANK"] != "1":
        return
    try:
        try:
            _load("/nope/weights.bin")
        except OSError as err:
            if how == "from None":
                raise RuntimeError("could not load the checkpoint") from None
            if how == "cycle":
                wrapper = RuntimeError("could not load the checkpoint")
                err.__context__ = wrapper  # a chain that points back at itself
                raise wrapper from err
            raise RuntimeError("could not load the checkpoint") from err
    except RuntimeError:
        if how == "while handling":
            {}["learning_rate"]
        raise


@pytest.mark.parametrize("how", ["from", "while handling", "from None", "cycle"])
def test_a_ranks_chain_of_causes_reaches_the_notebook(how):
    """``raise ... from err`` and an error while handling another: the root cause (the missing
    file) is shown before the error that reported it, with Python's words between them."""
    raised = KeyError if how == "while handling" else RuntimeError
    with pytest.raises(raised) as info:
        notebook_launcher(_chained, (how,), num_processes=2, renderer=Renderer())
    remote = remote_traceback(info.value)
    root = "FileNotFoundError: [Errno 2] No such file or directory: '/nope/weights.bin'"
    if how == "from None":
        assert root not in remote and "During handling" not in remote
        assert remote.count("Traceback from rank 1") == 1
        return
    assert root in remote and 'File "' in remote.split(root)[0]
    direct = "The above exception was the direct cause of the following exception:"
    assert remote.index(root) < remote.index(direct) < remote.index("could not load")
    if how == "while handling":
        during = "During handling of the above exception, another exception occurred:"
        assert remote.index("could not load") < remote.index(during)
        assert remote.rstrip().endswith("KeyError: 'learning_rate'")
    else:
        assert remote.count("Traceback from rank 1") == 2  # a cycle is followed once


def _segfault_in_user_code() -> str:
    import ctypes

    def read_null() -> None:
        ctypes.string_at(0)

    if os.environ["RANK"] == "1":
        read_null()
    return "ok"


def test_a_native_crash_shows_the_ranks_python_stack_before_the_error():
    """A segfault in native code: the rank's Python stack at the crash (faulthandler) reaches
    the cell's output, naming the user's function, and the launch raises RankCrashed."""

    lines = Recorder()
    with pytest.raises(RankCrashed, match="SIGSEGV"):
        notebook_launcher(_segfault_in_user_code, num_processes=2, renderer=lines)
    text = lines.text(rank=1)
    assert "Fatal Python error: Segmentation fault" in text
    assert re.search(r'File ".*test_rank_errors\.py", line \d+ in read_null', text)
    assert text.index("in read_null") < text.index("in _segfault_in_user_code")


def _reads_stdin(how: str) -> int:
    if how == "input":
        return len(input("your name? "))
    breakpoint()
    return 1


@pytest.mark.parametrize("how", ["input", "breakpoint"])
def test_reading_stdin_in_a_rank_ends_at_once_and_says_why(how):
    """Ranks have no keyboard: input() and pdb end at once (no hang) with what to do instead."""
    import bdb

    # a hang would end in the launch's timeout (LaunchTimeout), not in the reader's own error
    with pytest.raises(EOFError if how == "input" else bdb.BdbQuit) as info:
        notebook_launcher(_reads_stdin, (how,), num_processes=2, renderer=Renderer(), timeout=60)
    assert str(info.value) == ("EOF when reading a line" if how == "input" else "")
    notes = info.value.__notes__  # either rank may be first
    assert notes[0] == f"raised on rank {info.value.rank}" and "no stdin" in notes[1]


class ShardError(Exception):
    """A class whose ``__init__`` takes other arguments than its ``args``: pickle alone cannot
    rebuild it."""

    def __init__(self, shard: int, reason: str) -> None:
        super().__init__(f"shard {shard}: {reason}")
        self.shard = shard
        self.reason = reason


def _raise_shard_error(with_lock: bool) -> None:
    if os.environ["RANK"] != "1":
        return
    try:
        {}["weights"]
    except KeyError as err:
        err.add_note("looking up the weights of shard 3")
        error = ShardError(3, "checksum mismatch")
        if with_lock:
            error.lock = threading.Lock()  # an attribute that cannot travel
        raise error from err


@pytest.mark.parametrize("with_lock", [False, True], ids=["attributes", "unpicklable attribute"])
def test_an_exception_with_its_own_init_arrives_as_its_class_with_its_attributes(with_lock):
    with pytest.raises(ShardError) as info:
        notebook_launcher(_raise_shard_error, (with_lock,), num_processes=2, renderer=Renderer())
    exc = info.value
    assert str(exc) == "shard 3: checksum mismatch" and exc.__notes__ == ["raised on rank 1"]
    assert (exc.shard, exc.reason) == (3, "checksum mismatch")
    assert not hasattr(exc, "lock")  # the one attribute that could not travel
    remote = remote_traceback(exc)  # the cause's note, under its message, as Python shows it
    assert "KeyError: 'weights'\nlooking up the weights of shard 3" in remote
    cause = exc.__cause__  # the rank's own cause, rebuilt as an object too
    assert isinstance(cause, KeyError) and cause.args == ("weights",)
    assert cause.__notes__ == ["looking up the weights of shard 3"]


def _argv() -> list[str]:
    return list(sys.argv)


def _parse_args() -> float:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    return parser.parse_args().lr


def test_ranks_see_the_notebooks_argv_and_argparse_errors_say_why(monkeypatch):
    """A rank's sys.argv is the notebook's (not the rank's start-up command), so parse_args()
    behaves as it would called in the notebook, and its exit names the reason and the fix."""
    kernel_argv = ["/venv/lib/ipykernel_launcher.py", "-f", "/run/jupyter/kernel-1.json"]
    monkeypatch.setattr(sys, "argv", kernel_argv)
    assert notebook_launcher(_argv, num_processes=2, renderer=Renderer()) == [kernel_argv] * 2
    lines = Recorder()
    with pytest.raises(RankCrashed, match=r"exited with code 2 \(sys.exit\): argparse's") as info:
        notebook_launcher(_parse_args, num_processes=2, renderer=lines)
    assert "parse_args(['--lr', '0.1'])" in str(info.value)
    shown = lines.text()
    assert "error: unrecognized arguments: -f /run/jupyter/kernel-1.json" in shown
    monkeypatch.setattr(sys, "argv", ["train.py", "--lr", "0.5"])
    assert notebook_launcher(_parse_args, num_processes=2, renderer=Renderer()) == [0.5, 0.5]


def _returns_a_generator():
    return (i for i in range(3))


def test_a_return_value_that_cannot_travel_says_what_to_return():
    """The message is about the way back (to the notebook), not about passing arguments."""
    with pytest.raises(TypeError) as info:
        notebook_launcher(_returns_a_generator, num_processes=2, renderer=Renderer())
    text = str(info.value)
    assert "the return value (generator) cannot be sent to the notebook" in text
    assert "Return something picklable instead" in text and "worker processes" not in text
