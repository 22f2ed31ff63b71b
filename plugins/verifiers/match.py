"""``match``: DFlash's sample-and-match verification, lossless.

Draw y ~ p at every position and accept the draft token iff it equals y; at the first mismatch
emit that y.  Whatever q is, the emitted token is a draw of p, so the rule is exact; it accepts
less than ``rejection`` at T > 0 (p(x) instead of min(1, p(x)/q(x))) and needs no draft law.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from specforge.components import VerifyOutput
from specforge.sampling import SamplingParams, sample_with_uniform
from specforge.toolkit.verification import BaseVerifier, VerifyInputs, accepted_prefix, gather_at

__all__ = ["MatchConfig", "MatchVerifier"]


class MatchConfig(BaseModel):
    """``match`` has no parameters."""

    model_config = ConfigDict(extra="forbid")


class MatchVerifier(BaseVerifier):
    """Sample the target at each position; accept while the samples equal the drafts."""

    def __init__(self, config: MatchConfig | None = None) -> None:
        super().__init__(config or MatchConfig())

    def accept_probability(self, p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
        return gather_at(p, x)

    def residual(self, p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
        # y given y ≠ x: p with x removed.  When p(x) = 1 rejection cannot happen; p stands in.
        rest = p.scatter(-1, x.unsqueeze(-1), 0.0)
        mass = rest.sum(-1, keepdim=True)
        safe = torch.where(mass > 0, mass, torch.ones_like(mass))
        return torch.where(mass > 0, rest / safe, p)

    def _verify(self, inputs: VerifyInputs, sampling: SamplingParams) -> VerifyOutput:
        p = self.target_probs(inputs, sampling)
        # One draw per row, acceptance and emission alike: y_k decides position k and is the
        # correction if k is the first mismatch; y at row ℓ_r is the bonus.
        y = sample_with_uniform(p, inputs.uniforms[..., 1])
        n = accepted_prefix(y[:, : inputs.gamma] == inputs.tokens, inputs.valid)
        rows = torch.arange(y.shape[0], device=y.device)
        return VerifyOutput(num_accepted=n, next_token=y[rows, n])
