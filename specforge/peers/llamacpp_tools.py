"""llama.cpp's command-line tools (``llama-speculative-simple``, ``llama-server``, ``llama-bench``,
``llama-cli``) as ``make llama.cpp`` builds them for this CPU (``scripts/build-llama-cpp-tools.sh``,
into :func:`~specforge.runtime.llamacpp.build.tools_dir`), for tests and benchmarks that run llama.cpp itself.
"""

from __future__ import annotations

import os
from pathlib import Path

from specforge.runtime.llamacpp.build import tools_dir

__all__ = ["BUILD", "TOOLS", "missing_reason", "tool"]

#: What builds them (one line, the reason a test or benchmark gives when they are not there).
BUILD = "make llama.cpp"
TOOLS = ("llama-speculative-simple", "llama-server", "llama-bench", "llama-cli")


def _places() -> list[Path]:
    """Where the programs may be: the cache's (``$SPECFORGE_CACHE_DIR``), then the default cache's
    (``~/.cache/specforge``: the tools are the machine's, and a run with a cache of its own — the
    tests' — still finds them there)."""
    return list(dict.fromkeys([tools_dir() / "bin", tools_dir(Path.home() / ".cache" / "specforge") / "bin"]))


def tool(name: str) -> Path | None:
    """The path of llama.cpp's program ``name`` built for this CPU, or None when it is not built."""
    for place in _places():
        path = place / name
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def missing_reason(*names: str) -> str | None:
    """None when every program of ``names`` (default: all of :data:`TOOLS`) is built; else the one
    line that says so and what builds them."""
    missing = [n for n in (names or TOOLS) if tool(n) is None]
    if not missing:
        return None
    return f"llama.cpp's {', '.join(missing)} not built for this CPU (in {tools_dir() / 'bin'}): run `{BUILD}`"
