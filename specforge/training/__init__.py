"""Training of model drafters (docs/training.md): the config and the trainer.

What a training method implements — the contract and the losses — is the plug-in authors' toolkit
(:mod:`specforge.toolkit.training`, :mod:`specforge.toolkit.losses`).  The trainer's modules load
the drafter plug-ins, so they are imported on first use: importing this package stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointError", "TrainConfig", "TrainConfigError", "Trainer", "load_train_config"]

_LAZY = {"TrainConfig": "config", "TrainConfigError": "config", "load_train_config": "config",
         "Trainer": "trainer", "CheckpointError": "checkpoint"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"specforge.training.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'specforge.training' has no attribute {name!r}")
