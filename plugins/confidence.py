"""Shipped confidence estimators: ``constant``, ``entropy``, ``reported`` and DSpark's trained
``dspark-head``.

All four are pre-token (docs/design/round.md): c_k may use what is known before x_k is drawn —
the drafter's distribution at slot k (``entropy``), the backbone state h_k and the previous token
x_{k−1} (``dspark-head``) — and never ``block.tokens[:, k]``.  That is what lets a scheduler stop
on c_k without biasing which tokens get verified.  The ``dspark-head`` network is the toolkit's
(:mod:`specforge.toolkit.confidence_head`): block drafters train it and save it in their checkpoints.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from specforge import hookimpl
from specforge.components import DraftBlock
from specforge.toolkit.confidence_head import DSparkConfidence, DSparkHeadConfig

__all__ = ["ConstantConfidence", "ConstantConfig", "EntropyConfidence", "EntropyConfig", "ReportedConfidence",
           "ReportedConfig"]


class ConstantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: float = Field(0.8, gt=0, lt=1, description="c_k for every position")


class ConstantConfidence:
    """The same c_k everywhere: a baseline that carries no per-token information."""

    def __init__(self, config: ConstantConfig | None = None) -> None:
        self.config = config or ConstantConfig()

    def estimate(self, block: DraftBlock) -> Tensor:
        return torch.full(tuple(block.tokens.shape), self.config.value,
                          dtype=torch.get_default_dtype(), device=block.tokens.device)


class EntropyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scale: float = Field(1.0, gt=0, description="c_k = exp(-H_k / scale), H_k in nats")
    eps: float = Field(1e-6, gt=0, lt=0.5, description="c_k is clamped into [eps, 1 - eps]")


class EntropyConfidence:
    """c_k = exp(−H(q_k)/scale): a peaked draft distribution is more likely to survive.

    H_k is the entropy (nats) of the drafter's distribution at slot k: softmax of
    ``block.logits`` when the drafter exposes them (the unwarped model belief), otherwise
    ``block.probs`` (the law x_k was drawn from).  Deterministic drafters that expose neither
    give no signal, so that is an error rather than a silent constant.
    """

    def __init__(self, config: EntropyConfig | None = None) -> None:
        self.config = config or EntropyConfig()

    def estimate(self, block: DraftBlock) -> Tensor:
        if block.logits is not None:
            src = block.logits
            dtype = torch.promote_types(src.dtype, torch.float32)
            logp = torch.log_softmax(src.to(dtype), dim=-1)
            p = logp.exp()
        elif block.probs is not None:
            src = block.probs
            dtype = torch.promote_types(src.dtype, torch.float32)
            p = src.to(dtype)
            logp = p.log()
        else:
            raise ValueError("entropy confidence needs block.logits or block.probs; the drafter gave neither")
        # 0·log 0 = 0: masked vocabulary entries (−inf logits, zero probability) add nothing.
        plogp = torch.where(p > 0, p * logp, torch.zeros((), dtype=dtype, device=p.device))
        entropy = -plogp.sum(-1)
        eps = self.config.eps
        return torch.exp(-entropy / self.config.scale).clamp(eps, 1 - eps)


class ReportedConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    eps: float = Field(1e-6, gt=0, lt=0.5, description="c_k is clamped into [eps, 1 - eps]")


class ReportedConfidence:
    """The confidence the drafter reported itself (``DraftBlock.confidence``): an n-gram match
    length, a composed drafter's members' own estimates (docs/composition.md).  The drafter
    answers for it being pre-token; the conformance suite checks that like any estimator's."""

    def __init__(self, config: ReportedConfig | None = None) -> None:
        self.config = config or ReportedConfig()

    def estimate(self, block: DraftBlock) -> Tensor:
        if block.confidence is None:
            raise ValueError("reported confidence: the drafter reports none (DraftBlock.confidence is None); "
                             "choose an estimator that reads its other fields (entropy, dspark-head)")
        eps = self.config.eps
        return block.confidence.to(torch.promote_types(block.confidence.dtype, torch.float32)).clamp(eps, 1 - eps)


@hookimpl
def specforge_register_confidence_estimators(register):
    register("constant", ConstantConfidence, config=ConstantConfig, pre_token=True, trainable=False,
             examples=({"value": 0.3}, {"value": 0.8}),
             description="the same confidence at every position")
    register("entropy", EntropyConfidence, config=EntropyConfig, pre_token=True, trainable=False,
             needs_any=("logits", "probs"), examples=({}, {"scale": 0.5}),
             description="exp(-entropy of the draft distribution at slot k)")
    register("reported", ReportedConfidence, config=ReportedConfig, pre_token=True, trainable=False,
             needs_any=("confidence",), examples=({},),
             description="the drafter's own estimate (DraftBlock.confidence): n-gram match length, "
                         "a composition's members")
    register("dspark-head", DSparkConfidence, config=DSparkHeadConfig, pre_token=True, trainable=True,
             needs_any=("hidden",), examples=({"rank": 8}, {"rank": 16, "seed": 1}),
             description="trained sigmoid(w.[h_k ; E[x_{k-1}]] + b) (DSpark confidence head)")
