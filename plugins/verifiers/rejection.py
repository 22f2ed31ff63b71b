"""``rejection``: standard speculative sampling (Leviathan et al., Chen et al.), lossless.

Accept x iff u·q(x) < p(x), i.e. with probability min(1, p(x)/q(x)); on rejection emit a sample
of norm(max(p − q, 0)).  Then q·a + (1 − Σ q·a)·r = min(p, q) + (p − min(p, q)) = p.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from specforge.components import VerifyOutput
from specforge.sampling import SamplingParams
from specforge.toolkit.verification import BaseVerifier, VerifyInputs, gather_at, greedy_outcome

__all__ = ["RejectionConfig", "RejectionVerifier"]


class RejectionConfig(BaseModel):
    """``rejection`` has no parameters."""

    model_config = ConfigDict(extra="forbid")


class RejectionVerifier(BaseVerifier):
    """Speculative rejection sampling against the warped target distribution."""

    def __init__(self, config: RejectionConfig | None = None) -> None:
        super().__init__(config or RejectionConfig())

    def accept_probability(self, p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
        px = gather_at(p, x)
        if q is None:  # one-hot q: q(x) = 1
            return px.clamp(max=1.0)
        qx = gather_at(q, x)
        # u·q(x) < p(x) with u ∈ [0, 1): certain when q(x) = 0 < p(x), impossible when both are 0.
        ratio = (px / torch.where(qx > 0, qx, torch.ones_like(qx))).clamp(max=1.0)
        return torch.where(qx > 0, ratio, (px > 0).to(p.dtype))

    def _verify(self, inputs: VerifyInputs, sampling: SamplingParams) -> VerifyOutput:
        # At T = 0 every row's law is the one-hot of its arg-max: a draft is accepted exactly when
        # it is the arg-max (its q(x) > 0, so min(1, 1/q(x)) = 1), and on rejection the residual
        # max(p − q, 0) is that one-hot again.  A batch all at T = 0 skips building the laws.
        if not bool((sampling.temperature > 0).any()):
            return greedy_outcome(inputs)
        return super()._verify(inputs, sampling)

    def residual(self, p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
        if q is None:
            # max(p − e_x, 0) is p with x removed, since p(x) ≤ 1.
            excess = p.scatter(-1, x.unsqueeze(-1), 0.0)
        else:
            excess = (p - q).clamp(min=0.0)
        mass = excess.sum(-1, keepdim=True)
        # Zero mass means p ≤ q everywhere, so every draft is accepted and this law is never
        # sampled; p keeps the result a valid distribution all the same.
        safe = torch.where(mass > 0, mass, torch.ones_like(mass))
        return torch.where(mass > 0, excess / safe, p)
