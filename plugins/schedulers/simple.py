"""Schedulers that look at one request at a time: ``fixed`` and ``threshold``."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from specforge.toolkit.admission import masked_confidence

__all__ = ["FixedConfig", "FixedScheduler", "ThresholdConfig", "ThresholdScheduler"]


class FixedConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    length: int | None = Field(
        default=None, ge=0, description="tokens to verify per request; null = the whole block (G)"
    )


class FixedScheduler:
    """ℓ_r = min(length, available_r), with ``length`` = G when unset.

    Reads neither confidences nor drafts, so it is trivially causal.
    """

    def __init__(self, config: FixedConfig | None = None) -> None:
        self.config = config or FixedConfig()

    def schedule(self, confidence: Tensor, available: Tensor) -> Tensor:
        _, avail = masked_confidence(confidence, available)
        g = confidence.shape[1]
        length = g if self.config.length is None else self.config.length
        return avail.clamp(max=length)


class ThresholdConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    theta: float = Field(gt=0, lt=1, description="verify while the calibrated c_k ≥ theta")


class ThresholdScheduler:
    """ℓ_r = the number of leading positions whose calibrated c_k ≥ θ, capped by available_r.

    Causal because whether position k is verified depends on c_1..c_k only, and c_k is pre-token
    (it may see x_<k, never x_k).
    """

    def __init__(self, config: ThresholdConfig) -> None:
        self.config = config

    def schedule(self, confidence: Tensor, available: Tensor) -> Tensor:
        c, _ = masked_confidence(confidence, available)
        # Padding past ``available`` is 0 < θ, so the cap comes for free.
        passes = (c >= self.config.theta).to(torch.long)
        return torch.cumprod(passes, dim=1).sum(dim=1)
