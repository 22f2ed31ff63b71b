"""``greedy``: temperature-0 verification, lossless for greedy decoding only.

Accept while x == argmax p; emit the arg-max at the first mismatch (or after the last accepted
token).  Ties go to the lowest id, exactly like :func:`specforge.sampling.warp` at T = 0, so the
result equals plain greedy decoding token for token.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from specforge.components import VerifyOutput
from specforge.sampling import SamplingParams
from specforge.toolkit.verification import BaseVerifier, VerifyInputs, greedy_outcome

__all__ = ["GreedyConfig", "GreedyVerifier"]


class GreedyConfig(BaseModel):
    """``greedy`` has no parameters."""

    model_config = ConfigDict(extra="forbid")


class GreedyVerifier(BaseVerifier):
    """Arg-max verification; refuses requests sampled at a positive temperature."""

    def __init__(self, config: GreedyConfig | None = None) -> None:
        super().__init__(config or GreedyConfig())

    def accept_probability(self, p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
        return (x == p.argmax(-1)).to(p.dtype)

    def residual(self, p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
        return torch.zeros_like(p).scatter_(-1, p.argmax(-1, keepdim=True), 1.0)

    def _verify(self, inputs: VerifyInputs, sampling: SamplingParams) -> VerifyOutput:
        hot = sampling.temperature > 0
        if bool(hot.any()):
            r = int(hot.nonzero()[0, 0])
            raise ValueError(
                f"request {r}: the greedy verifier needs temperature 0, got "
                f"{float(sampling.temperature[r])}; use 'rejection' or 'match' for sampling"
            )
        return greedy_outcome(inputs)
