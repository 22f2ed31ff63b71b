"""``typical``: Medusa's typical acceptance — **lossy**, never certified by conformance.

Accept x iff p(x) > min(ε, δ·exp(−H(p))): a draft token is kept when the target finds it
plausible enough, whatever q is.  On the first rejection a fresh sample of p is emitted.  The
output law is not the target's (it over-represents tokens the drafter proposes), which is why the
verifier registers with ``lossless=False``.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from specforge.toolkit.verification import BaseVerifier, gather_at

__all__ = ["TypicalConfig", "TypicalVerifier"]


class TypicalConfig(BaseModel):
    """Thresholds of Medusa's typical acceptance (its published defaults)."""

    model_config = ConfigDict(extra="forbid")

    epsilon: float = Field(0.09, gt=0.0, le=1.0, description="hard probability threshold ε")
    delta: float = Field(0.3, gt=0.0, description="entropy-scaled threshold δ in δ·exp(−H(p))")


class TypicalVerifier(BaseVerifier):
    """Deterministic acceptance by an entropy-adaptive probability threshold."""

    def __init__(self, config: TypicalConfig | None = None) -> None:
        super().__init__(config or TypicalConfig())

    def threshold(self, p: Tensor) -> Tensor:
        """``[...]`` min(ε, δ·exp(−H(p))), with 0·log 0 = 0 in the entropy."""
        entropy = torch.special.entr(p).sum(-1)
        return torch.clamp(self.config.delta * torch.exp(-entropy), max=self.config.epsilon)

    def accept_probability(self, p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
        return (gather_at(p, x) > self.threshold(p)).to(p.dtype)

    def residual(self, p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
        return p
