"""Training of model drafters (docs/training.md): the DSpark losses, the config and the trainer.

The trainer's modules import the drafter plug-ins, which may themselves import the losses from
here, so everything but the losses is imported on first use.
"""

from __future__ import annotations

from typing import Any

from specforge.training.losses import DSparkLoss, dspark_loss, position_weights, teacher_probs, valid_prefix

__all__ = ["CheckpointError", "DSparkLoss", "TrainConfig", "TrainConfigError", "Trainer", "dspark_loss",
           "load_train_config", "position_weights", "teacher_probs", "valid_prefix"]

_LAZY = {"TrainConfig": "config", "TrainConfigError": "config", "load_train_config": "config",
         "Trainer": "trainer", "CheckpointError": "checkpoint"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"specforge.training.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'specforge.training' has no attribute {name!r}")
