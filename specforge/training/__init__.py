"""Training of model drafters (docs/training.md): the config and the trainer.

What a training method implements — the contract and the losses — is the plug-in authors' toolkit
(:mod:`specforge.toolkit.training`, :mod:`specforge.toolkit.losses`).  The trainer's modules load
the drafter plug-ins, so they are imported on first use: importing this package stays cheap.
"""

from __future__ import annotations

from specforge.lazy import lazy_getattr

_LAZY = {"TrainConfig": "config", "TrainConfigError": "config", "load_train_config": "config",
         "Trainer": "trainer", "CheckpointError": "checkpoint"}

__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
