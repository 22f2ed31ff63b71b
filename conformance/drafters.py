"""Test-only drafters: correct (lossless) but deliberately bad at guessing.

They make rejections happen at every position, which is what exercises rollback, residual
sampling and correction tokens.  Registered by tests with ``host.add_plugin``, never through an
entry point.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from specforge import hookimpl
from specforge.components import DraftBlock, DraftContext
from specforge.sampling import sample_with_uniform

__all__ = ["RandomDrafter", "RandomDrafterConfig"]


class RandomDrafterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gamma: int = Field(4, ge=1)
    deterministic: bool = Field(
        False, description="true: propose uniformly random ids but report them as one-hot q"
    )


class RandomDrafter:
    """Proposes i.i.d. tokens from a random law over the vocabulary (fixed per position).

    With ``deterministic=False`` the law is reported as q (a sampling drafter); with ``True`` the
    ids are chosen pseudo-randomly and q is one-hot (a deterministic drafter, like ``ngram``).
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(self, config: RandomDrafterConfig | None = None) -> None:
        self.config = config or RandomDrafterConfig()
        self.gamma = self.config.gamma
        self.vocab_size: int | None = None

    def bind(self, target) -> None:
        self.vocab_size = target.vocab_size

    def release(self, request_id: int) -> None:
        pass

    def draft(self, ctx: DraftContext) -> DraftBlock:
        if self.vocab_size is None:
            raise RuntimeError("bind() the drafter to a target first")
        r, g, v = len(ctx), self.gamma, self.vocab_size
        # A skewed but full-support law, different at each position, from a fixed seed.
        law = torch.softmax(torch.randn(g, v, generator=torch.Generator().manual_seed(1234)) * 2, -1)
        law = law.to(torch.float32).expand(r, g, v).contiguous()
        u = torch.stack([torch.rand(g, generator=gen, dtype=torch.float64) for gen in ctx.generators]) \
            if r else torch.empty(0, g, dtype=torch.float64)
        tokens = sample_with_uniform(law, u)
        lengths = torch.minimum(torch.full((r,), g, dtype=torch.long), ctx.max_tokens)
        probs = None if self.config.deterministic else law
        return DraftBlock(tokens=tokens, lengths=lengths, probs=probs, anchor=ctx.anchor)


@hookimpl
def specforge_register_drafters(register):
    register("random", RandomDrafter, config=RandomDrafterConfig,
             description="TEST ONLY: random proposals, so that rejections happen everywhere")
