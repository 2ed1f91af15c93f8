"""Accelerate's import paths over nbaccel's own tree: one alias table, one import hook.

Why: code written for Hugging Face Accelerate imports from about forty module paths
(``accelerate.logging``, ``accelerate.utils.operations``, ``accelerate.test_utils.testing``...).
nbaccel keeps its tree by concept (distributed/, training/, bigmodel/, data/...), so instead of
forty files of re-exports these paths are *data*:

- :mod:`nbaccel.compat.aliases` holds ``ALIASES``: façade path -> the nbaccel modules (and
  optionally the names) it exposes. Nothing else: no function or class is defined there.
- :mod:`nbaccel.compat.finder` is a ``sys.meta_path`` finder registered by ``nbaccel/__init__``.
  When ``nbaccel.utils.operations`` (or any path in the table) is imported, it builds a module of
  that name whose attributes are the objects of the listed nbaccel modules -- the same objects,
  so ``isinstance`` checks, pickling (objects keep their real ``__module__``) and identity hold.
  Façade paths that have children in the table are packages, so ``import nbaccel.utils.memory``,
  ``from nbaccel.big_modeling import ...`` and ``mock.patch("nbaccel.utils.other.x")`` all work.
  Extra top-level names (``nbaccel.DeepSpeedPlugin``...) resolve through the package's
  ``__getattr__`` from the ``"nbaccel"`` entry of the table.

Deliberate limit: ``mock.patch`` on a façade path replaces the attribute of the façade module
only; it does not reach into the nbaccel module that uses the name. Patch the real module
(``module.__nbaccel_sources__`` lists them) to change behaviour.
"""

from nbaccel.compat.finder import install

__all__ = ["install"]
