"""The shape of the code, checked from the source with ``ast``: files past the size to review
are the ones reviewed, no module keeps state assigned through ``global`` or in a container it
changes at run time, no function changes a class's attributes (state lives with an owning
object and its lock), and a class in ``launch/`` holds the objects that do its parts rather
than being assembled from mixins that share its private state."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "nbaccel"
LAUNCH = ROOT / "launch"
#: the length at which a file is reviewed: one concept may run past it (then it is listed in
#: REVIEWED with what it holds), several concepts are split into their own files
REVIEW_AT = 500
REVIEWED: dict[str, str] = {}


def _trees(folder: Path) -> dict[str, ast.Module]:
    return {
        str(path.relative_to(ROOT.parent)): ast.parse(path.read_text(), str(path))
        for path in sorted(folder.rglob("*.py"))
    }


def _globals(tree: ast.Module) -> list[int]:
    """Lines of ``global`` statements."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Global)]


_CONTAINER_CALLS = {
    "dict", "list", "set", "deque", "defaultdict", "OrderedDict", "Counter", "bytearray",
    "WeakValueDictionary", "WeakKeyDictionary", "WeakSet",
}  # fmt: skip
_MUTATORS = {
    "append", "appendleft", "extend", "extendleft", "insert", "add", "update", "pop", "popitem",
    "popleft", "remove", "discard", "clear", "setdefault", "sort", "reverse", "rotate",
    "__setitem__", "__delitem__", "difference_update", "intersection_update",
    "symmetric_difference_update",
}  # fmt: skip


def _is_container(node: ast.expr | None) -> bool:
    if isinstance(node, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        return name in _CONTAINER_CALLS
    return False


def _changed_module_containers(tree: ast.Module) -> list[str]:
    """``name:line`` of the containers a module assigns at its top level (``_live = deque()``)
    and changes inside a function (an item set or deleted, a mutating method called): a
    registry in a module global, which the ``global`` check does not see. ``__all__`` (built
    at import) is not state."""
    containers: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if _is_container(value):
            for target in targets:
                if isinstance(target, ast.Name) and target.id != "__all__":
                    containers[target.id] = node.lineno
    changed = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            target: ast.expr | None = None
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
                target = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func.value if node.func.attr in _MUTATORS else None
            choices = [target.body, target.orelse] if isinstance(target, ast.IfExp) else [target]
            for choice in choices:
                if isinstance(choice, ast.Name) and choice.id in containers:
                    changed.add((containers[choice.id], choice.id))
    return [f"{name}:{line}" for line, name in sorted(changed)]


def _changed_class_attributes(tree: ast.Module) -> list[str]:
    """``Class.attr:line`` where a function changes an attribute of a class the module defines
    (``DistributedMagics.auto = True``, ``_State.duties.append(d)``): state every instance and
    the whole process share, which belongs on an instance. Dunder names (class building) are
    not state."""
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}

    def owner(node: ast.expr) -> str | None:
        if isinstance(node, ast.Subscript):
            node = node.value
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in classes
            and not node.attr.startswith("__")
        ):
            return f"{node.value.id}.{node.attr}"
        return None

    changed = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                targets = [node.func.value] if node.func.attr in _MUTATORS else []
            for target in targets:
                if name := owner(target):
                    changed.add((node.lineno, name))
    return [f"{name}:{line}" for line, name in sorted(changed)]


def _base_names(cls: ast.ClassDef) -> list[str]:
    names = []
    for base in cls.bases:
        node = base.value if isinstance(base, ast.Subscript) else base
        if isinstance(node, ast.Name):
            names.append(node.id)
        elif isinstance(node, ast.Attribute):
            names.append(node.attr)
    return names


# classes whose annotations are fields by design (the class builds or describes them)
_FIELD_BASES = {"Protocol", "NamedTuple", "TypedDict", "Enum", "IntEnum", "StrEnum", "Exception"}


def _borrowed_state(cls: ast.ClassDef) -> list[str]:
    """Attributes the methods of ``cls`` read on ``self`` that the class only declares by
    annotation (``_ranks: list[RankState]``) and never assigns: state another class provides,
    which is what a mixin sharing private state looks like."""
    decorated = {(d.func if isinstance(d, ast.Call) else d) for d in cls.decorator_list}
    if any(getattr(d, "id", getattr(d, "attr", "")) == "dataclass" for d in decorated):
        return []
    if _FIELD_BASES & set(_base_names(cls)):
        return []
    declared = {
        node.target.id
        for node in cls.body
        if isinstance(node, ast.AnnAssign)
        and node.value is None
        and isinstance(node.target, ast.Name)
    }
    assigned, read = set(), set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "self":
                (assigned if isinstance(node.ctx, ast.Store) else read).add(node.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node in cls.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if isinstance(node, ast.Assign) or node.value is not None:
                assigned.update(t.id for t in targets if isinstance(t, ast.Name))
    return sorted((declared & read) - assigned)


def _sharing(trees: list[ast.Module]) -> set[str]:
    """Names of the classes that use state they only annotate."""
    return {
        node.name
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and _borrowed_state(node)
    }


def _mixin_problems(tree: ast.Module, where: str, sharing: set[str] | None = None) -> list[str]:
    """What in ``tree`` is a mixin, or is built from one (``sharing``: such classes of other
    modules, by name)."""
    classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    sharing = (sharing or set()) | _sharing([tree])
    problems = []
    for cls in classes:
        if borrowed := _borrowed_state(cls):
            problems.append(f"{where}: {cls.name} uses state it only annotates: {borrowed}")
        for base in _base_names(cls):
            if base.endswith("Mixin") or base in sharing:
                problems.append(f"{where}: {cls.name} inherits {base}")
    return problems


def test_files_past_the_review_mark_were_reviewed():
    """A file past REVIEW_AT lines is a point to review, not a reason to split one concept
    across files: it is listed in REVIEWED with the one concept it holds, or split where it
    holds several. Entries for files back under the mark are dropped."""
    lengths = {
        str(p.relative_to(ROOT.parent)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")
    }
    long = {name: count for name, count in lengths.items() if count > REVIEW_AT}
    unreviewed = {name: count for name, count in long.items() if name not in REVIEWED}
    assert unreviewed == {}, f"review these (one concept: list in REVIEWED; several: split): {long}"
    assert sorted(set(REVIEWED) - set(long)) == []


def test_no_module_state_is_assigned_through_global():
    """State lives with its owner (an object the module holds), in every layer."""
    trees = _trees(ROOT)
    found = {name: lines for name, tree in trees.items() if (lines := _globals(tree))}
    assert found == {}


def test_no_module_keeps_a_container_it_changes_at_run_time():
    """Registries of live objects, caches and once-only sets are attributes of an owning
    object with its lock (``_fleets = _Fleets()``), never a module's dict, list or set."""
    trees = _trees(ROOT)
    found = {name: c for name, tree in trees.items() if (c := _changed_module_containers(tree))}
    assert found == {}


#: class attributes changed at run time by design, with why
CLASS_STATE_ALLOWED = {
    # the rank process's one running loop, reached by the functions user code calls on a rank
    "nbaccel/launch/rank/worker.py": ["RankLoop.current"],
}


def test_no_function_changes_a_class_attribute():
    """State lives on an instance (``self.auto_mode``), not on the class that every instance
    and every kernel shares."""
    found = {}
    for name, tree in _trees(ROOT).items():
        allowed = CLASS_STATE_ALLOWED.get(name, [])
        changed = [c for c in _changed_class_attributes(tree) if c.split(":")[0] not in allowed]
        if changed:
            found[name] = changed
    assert found == {}


def test_no_class_in_the_engine_is_built_from_mixins_sharing_private_state():
    trees = _trees(LAUNCH)
    sharing = _sharing(list(trees.values()))
    problems = [p for name, tree in trees.items() for p in _mixin_problems(tree, name, sharing)]
    assert problems == []


def test_the_checks_see_what_they_forbid():
    """Each check flags the shape it is for, and passes its composed counterpart."""
    mixins = ast.parse(
        textwrap.dedent(
            """
            class Ends:
                _ranks: list
                def check(self):
                    return [r for r in self._ranks]

            class Group(Ends, LoggingMixin):
                def __init__(self):
                    self._ranks = []
            """
        )
    )
    assert _mixin_problems(mixins, "m.py") == [
        "m.py: Ends uses state it only annotates: ['_ranks']",
        "m.py: Group inherits Ends",
        "m.py: Group inherits LoggingMixin",
    ]
    composed = ast.parse(
        textwrap.dedent(
            """
            from dataclasses import dataclass

            @dataclass
            class State:
                rank: int
                def label(self):
                    return str(self.rank)

            class Ends:
                _ranks: list
                def __init__(self, ranks):
                    self._ranks = ranks
                def check(self):
                    return list(self._ranks)

            class Group:
                def __init__(self):
                    self.ends = Ends([])
            """
        )
    )
    assert _mixin_problems(composed, "c.py") == []
    group_elsewhere = ast.parse("class Group(Ends):\n    pass\n")
    assert _mixin_problems(group_elsewhere, "g.py", _sharing([mixins])) == [
        "g.py: Group inherits Ends"
    ]
    assert _globals(ast.parse("x = 0\ndef f():\n    global x\n    x = 1\n")) == [3]
    registries = ast.parse(
        textwrap.dedent(
            """
            _live = deque()
            _by_id: dict = {}
            _seen = set()
            TABLE = {"a": 1}
            __all__ = ["f"]

            def f(view, whole):
                _live.append(view)
                _by_id[id(view)] = view
                (_seen if whole else set()).add(view)
                __all__.append("g")
                return TABLE["a"]
            """
        )
    )
    assert _changed_module_containers(registries) == ["_live:2", "_by_id:3", "_seen:4"]
    owned = ast.parse(
        textwrap.dedent(
            """
            class _Views:
                def __init__(self):
                    self._lock = threading.Lock()
                    self._live = deque()

                def add(self, view):
                    with self._lock:
                        self._live.append(view)

            _views = _Views()
            """
        )
    )
    assert _changed_module_containers(owned) == []
    class_state = ast.parse(
        textwrap.dedent(
            """
            class Magics:
                auto = False
                duties = []
                def on(self):
                    Magics.auto = True
                    Magics.duties.append(1)
                    self.mode = True
                    Magics.__name__ = "M"
            """
        )
    )
    assert _changed_class_attributes(class_state) == ["Magics.auto:6", "Magics.duties:7"]
