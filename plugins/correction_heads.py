"""Shipped correction heads: ``none``, the identity (a parallel drafter drafts unbiased)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from specforge import hookimpl

__all__ = ["NoCorrection"]


class NoCorrection:
    """Returns the backbone's logits unchanged and carries no state."""

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def init_state(self, batch: int) -> None:
        return None

    def step(self, logits: Tensor, prev_token: Tensor, hidden: Tensor | None, state: Any) -> tuple[Tensor, Any]:
        return logits, state


@hookimpl
def specforge_register_correction_heads(register):
    register("none", NoCorrection, trainable=False, identity=True, description="no sequential correction (identity)")
