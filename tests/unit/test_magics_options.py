"""Option parsing of the magics (no kernel needed)."""

from __future__ import annotations

import pytest

from nbaccel.notebook.kernel.magics import AutoMode
from nbaccel.notebook.kernel.rank_spec import parse_names, parse_ranks


@pytest.mark.parametrize(
    ("spec", "ranks"),
    [
        (None, [0, 1, 2, 3]),
        ("all", [0, 1, 2, 3]),
        ("0", [0]),
        ("0,2", [0, 2]),
        ("1-3", [1, 2, 3]),
        ("3, 0-1", [0, 1, 3]),
    ],
)
def test_rank_specs(spec, ranks):
    assert parse_ranks(spec, 4) == ranks


@pytest.mark.parametrize(
    ("spec", "words"), [("4", "not in the pool"), ("a", "not a rank"), ("3-1", "not a rank")]
)
def test_bad_rank_specs(spec, words):
    with pytest.raises(ValueError, match=words):
        parse_ranks(spec, 4)


def test_names():
    assert parse_names(["a,b", "c a"]) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="not a variable name"):
        parse_names(["a-b"])


def test_auto_mode_transform():
    """Each kernel's magics own their auto mode: turning one on changes no other."""
    mode, other = AutoMode(), AutoMode()
    assert mode(["%%local\n", "x = 1\n"]) == ["x = 1\n"]
    assert mode(["x = 1\n"]) == ["x = 1\n"]
    mode.on = True
    assert mode(["x = 1\n"]) == ["%%distributed\n", "x = 1\n"]
    assert mode(["%dist_mode off\n"]) == ["%dist_mode off\n"]
    assert mode(["%%local\n", "y\n"]) == ["y\n"]
    assert other(["x = 1\n"]) == ["x = 1\n"]
