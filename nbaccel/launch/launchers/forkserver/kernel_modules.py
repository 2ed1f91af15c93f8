"""What ranks start with: the libraries the launching process (the notebook's kernel) imported.

A rank forked from the kernel (Accelerate's way) inherits every module the kernel holds; a rank
forked from nbaccel's fork server inherits what the server imported. So the server imports what
the kernel imported too (the *mirror*): the third-party and user modules in the kernel's
``sys.modules``, less the standard library, the kernel's own machinery (IPython, ZeroMQ...) and
what the server has already. The server checks each import (see ``loop``): a module
whose import initialised CUDA, started a thread or opened a socket is kept out (the ranks import
it themselves) and named once.

The setting (:class:`PreloadSetting`), from a launch's ``preload=`` option, else the
``NBACCEL_PRELOAD`` environment variable: ``auto`` (the default: mirror when launching from a
notebook kernel), ``on`` (mirror from anywhere), ``off`` (torch and nbaccel only), and module
names to add (``transformers,peft``) or keep out (``-mymod``), comma-separated.

Standard library only: the kernel's import hook (``notebook.kernel.preload_hook``) uses it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ENV_VARIABLE",
    "KERNEL_MACHINERY",
    "PRELOAD_HELP",
    "PreloadSetting",
    "changed_files",
    "check_preload",
    "file_stamps",
    "in_kernel",
    "is_candidate",
    "kernel_modules",
    "preload_setting",
]

#: the variable read when a launch does not pass ``preload=``
ENV_VARIABLE = "NBACCEL_PRELOAD"
#: the ``preload`` launch option's help (``LaunchRequest``)
PRELOAD_HELP = (
    "what ranks start with imported besides torch: auto (the libraries the notebook imported, "
    "preloaded in the fork server), off, or module names to add (-name keeps one out); "
    "default: NBACCEL_PRELOAD, else auto"
)

#: top-level packages of the kernel's own machinery, never worth a rank's start (and some of
#: them start threads or open sockets when used): left out of the mirror without a word
KERNEL_MACHINERY = frozenset(
    {
        "__main__", "__mp_main__", "nbaccel", "IPython", "ipykernel", "ipykernel_launcher",
        "jupyter_client", "jupyter_core", "zmq", "tornado", "traitlets", "comm", "debugpy",
        "ipywidgets", "widgetsnbextension", "jupyterlab_widgets", "prompt_toolkit", "pexpect",
        "ptyprocess", "matplotlib_inline", "pygments", "jedi", "parso", "stack_data",
        "executing", "asttokens", "pure_eval", "decorator", "wcwidth", "nest_asyncio",
        "pickleshare", "backcall", "pytest", "_pytest", "pluggy", "iniconfig", "xdist",
        "execnet", "pydevd", "pydevd_plugins", "_pydevd_bundle", "_pydev_bundle",
        "pydev_ipython", "google.colab",
        "nbclient", "nbformat", "nbconvert", "papermill", "jupyter_server", "notebook",
        "jupyterlab", "setuptools", "pkg_resources", "_distutils_hack", "pip", "sitecustomize",
        "usercustomize", "coverage",
    }
)  # fmt: skip
_SPELLINGS = {
    "auto": "auto",
    "on": "on",
    "true": "on",
    "yes": "on",
    "1": "on",
    "off": "off",
    "false": "off",
    "no": "off",
    "0": "off",
    "none": "off",
}


@dataclass(frozen=True)
class PreloadSetting:
    """What the fork server imports for a launch beyond torch and nbaccel's own modules.

    Attributes:
        mirror: import the launching process's libraries (None: only inside a notebook kernel).
        add: modules to import as well.
        exclude: modules (and their submodules) never imported there.
    """

    mirror: bool | None = None
    add: tuple[str, ...] = ()
    exclude: frozenset[str] = frozenset()

    def mirrors(self) -> bool:
        """True when this launch's server imports the launching process's libraries."""
        return in_kernel() if self.mirror is None else self.mirror

    def describe(self) -> str:
        """One line for ``nbaccel env``."""
        what = {None: "auto (the notebook's imported libraries, in a kernel)", True: "on"}.get(
            self.mirror, "off (torch and nbaccel only)"
        )
        if self.add:
            what += f"; also {', '.join(self.add)}"
        if self.exclude:
            what += f"; never {', '.join(sorted(self.exclude))}"
        return what


def check_preload(value: Any) -> tuple[str, ...] | None:
    """The ``preload=`` option, normalised: None, or its words (``on``/``off``/``auto`` and
    module names, ``-name`` keeping one out). Raises ValueError naming the accepted forms."""
    if value is None:
        return None
    if isinstance(value, bool):
        return ("on",) if value else ("off",)
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ValueError(
            f"preload must be True, False, 'auto', 'off' or module names ('transformers,peft'; "
            f"'-mymod' keeps one out), got {value!r}."
        )
    words = tuple(w.strip() for w in value if w.strip())
    for word in words:
        name = word.lstrip("-")
        if word.lower() not in _SPELLINGS and not all(p.isidentifier() for p in name.split(".")):
            raise ValueError(
                f"preload: {word!r} is not a module name; give names such as 'transformers' "
                "(or '-mymod' to keep one out), 'auto', 'on' or 'off'."
            )
    return words


def preload_setting(
    value: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ
) -> PreloadSetting:
    """The setting of a launch: its ``preload=`` words (:func:`check_preload`), else
    ``NBACCEL_PRELOAD``'s, else auto."""
    if value is None:
        value = check_preload(environ.get(ENV_VARIABLE) or None)
    mirror: bool | None = None
    add: list[str] = []
    exclude: set[str] = set()
    for word in value or ():
        mode = _SPELLINGS.get(word.lower())
        if mode is not None:
            mirror = {"auto": None, "on": True, "off": False}[mode]
        elif word.startswith("-"):
            exclude.add(word[1:])
        else:
            add.append(word)  # on top of the mode (auto unless said)
    return PreloadSetting(mirror, tuple(dict.fromkeys(add)), frozenset(exclude))


def in_kernel() -> bool:
    """True in a Jupyter kernel's process (not in its ranks, not in a script)."""
    if os.environ.get("NBACCEL_LAUNCHER") or "ipykernel" not in sys.modules:
        return False
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if get is not None else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _top(name: str) -> str:
    return name.partition(".")[0]


def is_candidate(name: str, exclude: Iterable[str] = ()) -> bool:
    """True when module ``name`` is worth the server's import: not the standard library, not
    the kernel's machinery, not kept out by ``exclude`` (names and their submodules)."""
    top = _top(name)
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return False
    if top in KERNEL_MACHINERY or name in KERNEL_MACHINERY:
        return False
    return not any(name == x or name.startswith(x + ".") for x in exclude)


def kernel_modules(
    exclude: Iterable[str] = (), modules: Mapping[str, Any] | None = None
) -> list[str]:
    """The modules of this process worth importing in the fork server, parents first.

    Only real modules imported under their own name count (an alias such as ``six.moves``, a
    module that replaced itself in ``sys.modules``, or one built in memory is left out: the
    server could not import it by that name)."""
    modules = sys.modules if modules is None else modules
    exclude = tuple(exclude)
    found = []
    for name, module in list(modules.items()):
        if module is None or not is_candidate(name, exclude):
            continue
        spec = getattr(module, "__spec__", None)
        if spec is None or spec.name != name:
            continue
        if getattr(spec, "origin", None) is None and not spec.submodule_search_locations:
            continue  # built in memory (a namespace package has no origin, yet imports)
        found.append(name)
    return sorted(found, key=lambda n: (n.count("."), n))


def _user_file(module: Any) -> str | None:
    """The file of ``module`` when it could change under a running kernel: code outside the
    installed packages (``site-packages``) and the standard library."""
    path = getattr(module, "__file__", None)
    if not path or "site-packages" in path or "dist-packages" in path:
        return None
    if path.startswith(sys.base_prefix) or path.startswith(sys.prefix):
        return None
    return path


def file_stamps(names: Iterable[str], modules: Mapping[str, Any] | None = None) -> dict:
    """``{module: (file, mtime_ns)}`` for the modules of ``names`` whose files could be edited
    while the kernel runs (see :func:`changed_files`)."""
    modules = sys.modules if modules is None else modules
    stamps = {}
    for name in names:
        path = _user_file(modules.get(name))
        if path is not None:
            try:
                stamps[name] = (path, os.stat(path).st_mtime_ns)
            except OSError:
                continue
    return stamps


def changed_files(stamps: Mapping[str, tuple[str, int]]) -> list[str]:
    """The modules of ``stamps`` whose file changed (or went) since it was stamped."""
    changed = []
    for name, (path, mtime) in stamps.items():
        try:
            if os.stat(path).st_mtime_ns != mtime:
                changed.append(name)
        except OSError:
            changed.append(name)
    return changed
