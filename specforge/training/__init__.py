"""Training of model drafters (SPEC §7): losses now; data, packing and the trainer build on them."""

from __future__ import annotations

from specforge.training.losses import DSparkLoss, dspark_loss, position_weights, teacher_probs, valid_prefix

__all__ = ["DSparkLoss", "dspark_loss", "position_weights", "teacher_probs", "valid_prefix"]
