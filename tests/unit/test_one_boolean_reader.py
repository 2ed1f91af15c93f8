"""One reader of yes/no values: ``nbaccel/values/booleans.py``.

Every yes/no value nbaccel reads (environment variables, config files, flags) means what
Accelerate's ``str_to_bool`` makes of it (y, yes, t, true, on, 1 / n, no, f, false, off, 0, any
case), and any other word is refused naming where it came from. The walk below holds the package
to it: a comparison of a value with ``"1"``, ``"true"``, ``"yes"``... (or a list of such words)
outside ``nbaccel/values/`` is a reader of its own, which sooner or later accepts other words
than the rest (``ACCELERATE_USE_MEGATRON_LM=on`` once read as false).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from nbaccel import Accelerator, PartialState
from nbaccel.distributed.state import DistributedType
from nbaccel.training.strategies.megatron.launch import requested
from nbaccel.training.strategies.megatron.plugin import MegatronLMPlugin
from nbaccel.values.booleans import FALSE_WORDS, TRUE_WORDS, env_flag, literal_bool, parse_bool

PACKAGE = Path(__file__).resolve().parents[2] / "nbaccel"
READER = PACKAGE / "values"
WORDS = {*TRUE_WORDS, *FALSE_WORDS}
# what the one reader's own façade for Accelerate's name may be called by: nothing else in nbaccel
FACADES = {"str_to_bool", "strtobool"}


def _words(node: ast.expr) -> list[str] | None:
    """The string constants ``node`` is (one, or a tuple/list/set of them), lower-cased."""
    elements = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    found = []
    for element in elements:
        if not (isinstance(element, ast.Constant) and isinstance(element.value, str)):
            return None
        found.append(element.value.strip().lower())
    return found


def _reads_text(node: ast.expr) -> bool:
    """``node`` is an environment read, or text folded for a comparison (``.lower()``...)."""
    source = ast.unparse(node)
    folded = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    folded = folded and node.func.attr in ("lower", "upper", "casefold", "strip")
    return folded or "environ" in source or "getenv" in source


def own_readers(tree: ast.AST) -> list[tuple[int, str]]:
    """The places in ``tree`` that read a yes/no value their own way."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) >= 2:
            words = _words(node)  # a list of yes/no words: a comparison, choices=, a constant
            if words and set(words) <= WORDS:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for side, other in ((sides[0], sides[1:]), (sides[-1], sides[:-1])):
                words = _words(side) if isinstance(side, ast.Constant) else None
                if words and words[0] in WORDS and any(_reads_text(o) for o in other):
                    found.append((node.lineno, ast.unparse(node)))
                    break
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            if name in FACADES:
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_walk_finds_the_shapes_it_looks_for():
    code = """
import os
a = os.environ.get("X", "").lower() in ("1", "true", "yes")
b = os.environ.get("X") == "1"
c = value.strip().lower() != "off"
d = str_to_bool(os.environ["X"])
parser.add_argument("mode", choices=("on", "off"))
e = mixed_precision == "no"          # a choice among others, not a yes/no value
f = str(version) == "1"              # a number, not an environment read
"""
    assert sorted(line for line, _ in own_readers(ast.parse(code))) == [3, 4, 5, 6, 7]


def test_no_yes_no_value_is_read_outside_the_one_reader():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if READER in path.parents:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(PACKAGE.parent)
        found += [f"{rel}:{line}: {text}" for line, text in own_readers(tree)]
    assert not found, "read these through nbaccel.values.booleans:\n" + "\n".join(found)


def test_the_words_are_accelerates():
    # what Accelerate's str_to_bool reads (accelerate/utils/environment.py), in its order
    assert TRUE_WORDS == ("y", "yes", "t", "true", "on", "1")
    assert FALSE_WORDS == ("n", "no", "f", "false", "off", "0")
    for word in TRUE_WORDS:
        assert parse_bool(word.upper()) is True and parse_bool(f" {word} ") is True
    for word in FALSE_WORDS:
        assert parse_bool(word.capitalize()) is False
    assert (literal_bool("True"), literal_bool("false"), literal_bool("1")) == (True, False, None)


@pytest.mark.parametrize("word", ["on", "yes", "y", "t", "1", "TRUE"])
def test_accelerate_use_megatron_lm_turns_the_plugin_on(word, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_MEGATRON_LM", word)
    # what a rank's Accelerator() asks (nbaccel launch --use_megatron_lm sets the variable)
    assert isinstance(requested(None, None, PartialState(cpu=True)), MegatronLMPlugin)


@pytest.mark.parametrize("word", ["off", "no", "0", ""])
def test_accelerate_use_megatron_lm_off_leaves_it_off(word, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_MEGATRON_LM", word)
    assert requested(None, None, PartialState(cpu=True)) is None
    accelerator = Accelerator(cpu=True)
    assert accelerator.state.distributed_type != DistributedType.MEGATRON_LM


def test_another_word_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_MEGATRON_LM", "maybe")
    with pytest.raises(ValueError, match=r"ACCELERATE_USE_MEGATRON_LM='maybe' is not a boolean"):
        Accelerator(cpu=True)
    monkeypatch.setenv("NBACCEL_FP8_EMULATE", "sure")
    with pytest.raises(ValueError, match=r"NBACCEL_FP8_EMULATE='sure' is not a boolean: use one"):
        env_flag("NBACCEL_FP8_EMULATE")
