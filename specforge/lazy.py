"""Names a package imports on first use (PEP 562).

A package whose leaf modules are read by light callers (the plug-in authors' toolkit, the CLI's
argument parsing) must not import its heavy modules when one of those leaves is imported, since
importing a leaf runs the package's ``__init__`` first.  Such a package maps each public name to
the submodule that defines it and lets :func:`lazy_getattr` import that submodule when the name
is first read.  This module imports nothing itself, so using it costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """The module-level ``__getattr__`` of ``package``: ``where[name]`` is the submodule (relative
    to the package) whose attribute ``name`` is returned."""

    def __getattr__(name: str) -> Any:
        if name in where:
            import importlib

            return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
