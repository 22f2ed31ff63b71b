"""Drafters trained here and shipped inside the package, named ``shipped:<name>`` in configs.

Each is a block-drafter checkpoint directory (config.json with the sha256 of its weights, which
is checked on every load; model.safetensors; MODEL_CARD.md saying how it was trained and what it
measured).  docs/shipped-drafter.md describes the one for the embedded SmolLM2.  The drafters'
registration hands them to :func:`specforge.toolkit.checkpoints.ship`, which resolves the names.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = ["shipped_drafters"]


def shipped_drafters() -> dict[str, Path]:
    """``name -> directory`` of every drafter shipped in this package."""
    root = Path(str(files(__name__)))
    return {p.name: p for p in sorted(root.iterdir()) if (p / "config.json").is_file()}
