"""Where specforge keeps what it measured or built once per machine: one root,
``$SPECFORGE_CACHE_DIR``, else ``~/.cache/specforge``.

========================================  ==============================================================
under the root                            what
========================================  ==============================================================
``profiles/<target>-<kind>-<key>.json``   choices measured once per machine: precision plan, compiled
                                          forward, backend, drafting cost (:func:`profile_file`)
``profiles/<target>-<key>.json``          a target's step curve SPS(B) (:mod:`specforge.toolkit.step_curve`)
``gguf/<name>-<hash>/``                   a GGUF's converted Hugging Face checkpoint (:mod:`specforge.model_files`)
``wheels/llama-cpp-<cpu>/``               the llama.cpp binding's wheel for one CPU (:mod:`specforge.runtime.llamacpp.build`)
``llama-cpp-tools-<cpu>/``                llama.cpp's programs for one CPU (``make llama.cpp``)
========================================  ==============================================================

Every file in it can be deleted: it is measured or built again on the next run that needs it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["cache_root", "profile_file"]


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """specforge's cache directory: ``$SPECFORGE_CACHE_DIR``, else ``~/.cache/specforge``."""
    base = (os.environ if env is None else env).get("SPECFORGE_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "specforge"


def profile_file(target: str, key: str, kind: str | None = None) -> Path:
    """The record of something measured on ``target`` (a name or a path: its file name is used)
    under ``key``; ``kind`` names what (``precision``, ``compile``, ``backend``, ``draft``)."""
    stem = Path(target).name + (f"-{kind}" if kind else "")
    return cache_root() / "profiles" / f"{stem}-{key}.json"
