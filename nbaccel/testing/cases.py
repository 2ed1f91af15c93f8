"""Test-case bases and assertion helpers for code that uses the distributed state."""

from __future__ import annotations

import io
import shutil
import tempfile
import unittest
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any

import torch

from nbaccel.distributed.state import AcceleratorState, GradientState

__all__ = [
    "AccelerateTestCase",
    "MockingTestCase",
    "NbaccelTestCase",
    "TempDirTestCase",
    "are_the_same_tensors",
    "assert_exception",
    "capture_call_output",
]


class TempDirTestCase(unittest.TestCase):
    """One temporary directory per class (``self.tmpdir``), emptied before each test when
    ``clear_on_setup`` and removed after the class."""

    clear_on_setup = True

    @classmethod
    def setUpClass(cls) -> None:
        cls.tmpdir = Path(tempfile.mkdtemp())

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.tmpdir, ignore_errors=True)

    def setUp(self) -> None:
        if self.clear_on_setup:
            for path in list(self.tmpdir.iterdir()):
                shutil.rmtree(path) if path.is_dir() else path.unlink()


class NbaccelTestCase(unittest.TestCase):
    """Resets ``AcceleratorState``/``PartialState``/``GradientState`` after every test, so
    state created by one test does not leak into the next."""

    def tearDown(self) -> None:
        super().tearDown()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


AccelerateTestCase = NbaccelTestCase


class MockingTestCase(unittest.TestCase):
    """``self.add_mocks(m)`` in ``setUp`` starts patchers that stop after each test."""

    def add_mocks(self, mocks: Any) -> None:
        self.mocks = mocks if isinstance(mocks, list | tuple) else [mocks]
        for m in self.mocks:
            m.start()
            self.addCleanup(m.stop)


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """True when every rank holds the same values in ``tensor``."""
    from nbaccel.distributed.collectives import gather
    from nbaccel.distributed.state import PartialState

    state = PartialState()
    tensor = tensor[None].clone().to(state.device)
    gathered = gather(tensor).cpu()
    tensor = tensor[0].cpu()
    return all(torch.equal(gathered[i], tensor) for i in range(gathered.shape[0]))


@contextmanager
def assert_exception(
    exception_class: type[BaseException], msg: str | None = None
) -> Iterator[None]:
    """Context manager: the block must raise ``exception_class`` (whose message contains
    ``msg`` when given); otherwise an AssertionError says what happened."""
    try:
        yield
    except exception_class as exc:
        if msg is not None and msg not in str(exc):
            raise AssertionError(f"Expected {msg!r} in the message, got {exc}") from exc
        return
    except Exception as exc:
        raise AssertionError(
            f"Expected {exception_class.__name__}, got {type(exc).__name__}: {exc}"
        ) from exc
    raise AssertionError(f"Expected {exception_class.__name__} to be raised, nothing was.")


def capture_call_output(func: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """What ``func(*args, **kwargs)`` prints to stdout."""
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        func(*args, **kwargs)
    return buffer.getvalue()
