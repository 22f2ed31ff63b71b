"""Drafters trained here and shipped inside the package, named ``shipped:<name>`` in configs.

Each is a block-drafter checkpoint directory (config.json with the sha256 of its weights, which
is checked on every load; model.safetensors; MODEL_CARD.md saying how it was trained and what it
measured).  docs/shipped-drafter.md describes the one for the embedded SmolLM2.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = ["PREFIX", "resolve_checkpoint", "shipped_drafters"]

PREFIX = "shipped:"


def shipped_drafters() -> dict[str, Path]:
    """``name -> directory`` of every drafter shipped in this package."""
    root = Path(str(files(__name__)))
    return {p.name: p for p in sorted(root.iterdir()) if (p / "config.json").is_file()}


def resolve_checkpoint(ref: str | Path) -> Path:
    """The directory a config's ``checkpoint`` names: ``shipped:<name>`` or a path."""
    text = str(ref)
    if not text.startswith(PREFIX):
        return Path(ref)
    from specforge_plugins.drafters.checkpoints import DrafterCheckpointError

    name, shipped = text[len(PREFIX):], shipped_drafters()
    if name not in shipped:
        raise DrafterCheckpointError(f"{text}: no such shipped drafter; shipped: "
                                     f"{', '.join(PREFIX + n for n in shipped) or '(none)'}")
    return shipped[name]
