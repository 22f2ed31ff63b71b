"""A fingerprint of the code a conformance run tests, so that its seeds are pooled only with
seeds run on the same code.

A 50-seed false-alarm run takes hours on 2 cores, longer than one sitting; its resumable files
outlive the session that started them, and the code may change in between.  Every seed's report
carries this fingerprint; a resumed run keeps only the seeds of its own fingerprint, and
``specforge conformance summary`` refuses to pool seeds of different ones.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

from specforge.resume import tree_digest

__all__ = ["PACKAGES", "code_fingerprint", "fingerprint_of"]

# Everything a run exercises: the core, the shipped plug-ins, the kernels and the suite itself.
PACKAGES = ("specforge", "specforge_plugins", "specforge_kernels", "specforge_conformance")


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """The fingerprint (:func:`fingerprint_of`) of the installed :data:`PACKAGES`."""
    roots = {}
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        roots[package] = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return fingerprint_of(roots)


def fingerprint_of(roots: dict[str, list[Path]]) -> str:
    """16 hex digits of the :func:`~specforge.resume.tree_digest` of every ``.py`` file under each
    package's directories: the same code gives the same fingerprint on any machine or checkout."""
    return tree_digest(roots, ".py")[:16]
