"""The notebook's warning filters rebuilt in a rank by name (launch/rank/warning_filters.py): a
category whose module the rank has not imported is never imported for it, and its filter
still applies once the module is imported."""

from __future__ import annotations

import sys
import textwrap
import warnings

import pytest

from nbaccel.launch.rank import warning_filters


@pytest.fixture
def late_module(tmp_path, monkeypatch):
    """A module defining a warning category, on sys.path but not imported."""
    name = f"late_category_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            class Outer:
                class LateWarning(UserWarning):
                    pass

            class ChildWarning(Outer.LateWarning):
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_category_not_imported_yet_is_not_imported_and_matches_later(late_module):
    entries = [("error", None, late_module, "Outer.LateWarning", None, 0)]
    with warnings.catch_warnings(record=True) as seen:
        warning_filters.install(entries)
        assert late_module not in sys.modules
        warnings.warn("unrelated", UserWarning, stacklevel=1)  # not matched: shown, not raised
        assert [str(w.message) for w in seen] == ["unrelated"]
        module = __import__(late_module)
        with pytest.raises(module.Outer.LateWarning):
            warnings.warn("now matched", module.Outer.LateWarning, stacklevel=1)
        with pytest.raises(module.ChildWarning):  # subclasses match, as for the class itself
            warnings.warn("a subclass", module.ChildWarning, stacklevel=1)


def test_filters_round_trip_with_their_patterns_and_order():
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.filterwarnings("ignore", message="noisy", category=DeprecationWarning)
        warnings.filterwarnings("error", category=RuntimeWarning, module="mylib", lineno=3)
        warnings.filters.insert(0, ("ignore", None, ImportWarning, "plain.text", 0))
        warnings._filters_mutated()  # as Python's own default filters: a plain-text module
        captured = warning_filters.capture()
        before = list(warnings.filters)
        warnings.resetwarnings()
        warning_filters.install(captured)
        assert warnings.filters == before


def test_categories_defined_in_the_notebook_stay_there():
    class Local(UserWarning):
        pass

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=Local)
        names = [(owner, name) for _, _, owner, name, _, _ in warning_filters.capture()]
    assert not [n for n in names if "Local" in n[1]]
