"""The table of exceptions (``tests/exception_table.py``) raised in real ranks, through each front:
``notebook_launcher`` (2 ranks), the pool that ``%%distributed`` runs its cells on, and a detached
run. Each arrives with its type (or a stand-in of its name), ``str`` as the rank saw it, ``args``
and the rank named (a note under the message, ``e.rank``). The pure round trip of the whole table
is ``tests/unit/test_exception_travel.py``; the SSH and Ray lanes raise from their hosts
(``tests/hosts``, ``tests/ray``).
"""

from __future__ import annotations

import pytest
from detached import runs_fixture  # noqa: F401 (the fixture `runs`)
from exception_table import CASES, raise_on_rank, raised

from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.wire.errors import remote_traceback

# The shapes through a one-shot launch each (every case runs through the pool below).
LAUNCHED = [
    "oserror_message",
    "oserror_errno",
    "file_not_found_message",
    "timeout_message",
    "connection_refused",
    "key_error",
    "unicode_decode",
    "transformers_missing",
    "hub_repo_not_found",
    "safetensors_corrupt",
    "keyword_only",
    "unpicklable_member",
    "reduce_raises",
    "chained",
]


def _arrived(kind: str, exc: BaseException, rank: int = 1) -> None:
    original = raised(kind)  # the same shape, raised here: what the rank saw
    assert type(exc).__name__ == type(original).__name__
    assert type(exc).__module__ == type(original).__module__
    assert isinstance(exc, next(c for c in type(original).__mro__ if "<" not in c.__qualname__))
    assert str(exc) == str(original)
    assert repr(exc.args) == repr(original.args)
    assert exc.rank == rank and exc.host is None
    assert exc.__notes__ == [*getattr(original, "__notes__", ()), f"raised on rank {rank}"]
    assert f"Traceback from rank {rank}" in remote_traceback(exc)


@pytest.mark.parametrize("kind", LAUNCHED)
def test_notebook_launcher(kind):
    with pytest.raises(BaseException) as info:
        notebook_launcher(raise_on_rank, (kind,), num_processes=2, renderer=Renderer())
    _arrived(kind, info.value)
    if kind == "oserror_message":
        assert "Errno" not in str(info.value) and info.value.errno is None


def test_the_pool_of_distributed_cells(pool):
    """Every case of the table, as ``%%distributed`` cells on one pool of 2 ranks."""
    for kind in CASES:
        with pytest.raises(BaseException) as info:
            pool.run_cell(f"from exception_table import raise_on_rank\nraise_on_rank({kind!r})")
        _arrived(kind, info.value)
    assert pool.call(lambda: "still serving") == {0: "still serving", 1: "still serving"}


@pytest.mark.parametrize("kind", ["oserror_message", "extra_attributes"])
def test_a_detached_run(kind, runs, monkeypatch):
    _, _, env = runs
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = notebook_launcher(raise_on_rank, (kind,), num_processes=2, cpu=True, detach=True)
    with pytest.raises(BaseException) as info:
        run.result(timeout=120)
    _arrived(kind, info.value)
