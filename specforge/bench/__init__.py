"""Benchmarks (``specforge bench WHAT``): prompts, the HF transformers baseline and the vLLM CPU peer,
and one module per benchmark.

Each module of :data:`BENCHES` declares its own sub-command as ``COMMAND`` (or several, ``COMMANDS``)
(:func:`specforge.bench.runner.bench_command`: its options, its measurement, how its result is kept
and shown), and the command line adds whatever :func:`commands` lists.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specforge.commands import Subcommand

__all__ = ["BENCHES", "commands"]

# In the order `specforge bench --help` lists them.
BENCHES = ("engine_bench", "ab", "round", "pass_profile", "drafters", "probe", "serving", "peer_drafter", "attention")


def commands() -> list[Subcommand]:
    """The ``COMMAND`` of every module of :data:`BENCHES` (importing them: the command line needs
    each one's options to build its parser)."""
    found = []
    for module in BENCHES:
        loaded = importlib.import_module(f"{__name__}.{module}")
        found.extend(getattr(loaded, "COMMANDS", None) or [loaded.COMMAND])
    return found
