"""The top-level import name ``kernels`` is the installed ``kernels`` distribution (Hugging
Face hub kernels, which transformers >= 5.25 requires and imports as ``kernels``), never one of
this repository's source files that share the name: ``kernels/`` (installed as
``radixkv.kernels``) at the repository root and ``bench/kernels.py`` (the ``bench kernels``
driver). Either shadows the distribution while its folder is on ``sys.path``: the root under
``python -m pytest``, ``bench/`` once a bench driver puts it first; transformers then fails
with ``cannot import name ... from 'kernels'``.

:func:`install` (run when ``radixkv`` is imported) puts a finder first on ``sys.meta_path`` that
looks ``kernels`` up on ``sys.path`` without those two folders. Where the distribution is not
installed and one of those folders is on ``sys.path``, it hands out an empty module with no
file and no version: transformers (< 5.25, where the distribution is optional) imports a
``kernels`` it finds without distribution metadata, and reads that as not installed, where
``bench/kernels.py`` would run as ``kernels`` (its imports and path changes). With none of the
folders on the path the usual finders run (``import kernels`` raises ModuleNotFoundError).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType


def _is_own_folder(entry: str) -> bool:
    """A ``sys.path`` entry holding this repository's ``kernels`` sources: the root (its
    ``kernels/csrc``) or ``bench/`` (``kernels.py`` beside ``_step_measure.py``)."""
    base = os.path.abspath(entry or os.curdir)
    return (os.path.isdir(os.path.join(base, "kernels", "csrc"))
            or (os.path.isfile(os.path.join(base, "kernels.py"))
                and os.path.isfile(os.path.join(base, "_step_measure.py"))))


class KernelsDistributionFinder(importlib.abc.MetaPathFinder):
    """Finds the top-level ``kernels`` on ``sys.path`` minus this repository's folders."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "kernels" or path is not None:
            return None
        entries = [entry for entry in sys.path if not _is_own_folder(entry)]
        spec = importlib.machinery.PathFinder.find_spec(fullname, entries)
        if spec is None and len(entries) < len(sys.path):
            return importlib.machinery.ModuleSpec(fullname, _EmptyModuleLoader(), origin=None)
        return spec


class _EmptyModuleLoader(importlib.abc.Loader):
    """Loads an empty module (the stand-in for an absent ``kernels`` distribution)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        return None


def install() -> None:
    """Put :class:`KernelsDistributionFinder` first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, KernelsDistributionFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, KernelsDistributionFinder())
