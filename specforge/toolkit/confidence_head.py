"""DSpark's trained confidence head (paper §3.2.1 eq. 7): c_k = σ(wᵀ[h_k ; E[x_{k−1}]] + b).

Pre-token by construction (docs/design/round.md): it reads the backbone state h_k and the previous
token x_{k−1} only, never x_k.  The network lives in the toolkit because two plug-ins build it:
the ``dspark-head`` confidence component that serves it and the block drafters that train it with
their backbone and save it in their checkpoints (:data:`CONFIDENCE_HEADS`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specforge.components import ComponentWeights, DraftBlock
from specforge.errors import ConfigError
from specforge.toolkit.heads import load_trained

__all__ = ["CONFIDENCE_HEADS", "DSparkConfidence", "DSparkHeadConfig"]


class DSparkHeadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: int = Field(256, ge=1, description="r: width of the previous-token embedding")
    embedding: Literal["own", "head"] = Field(
        "own", description="own: a private V×r table; head: the correction head's W1 (paper eq. 7)")
    vocab_size: int | None = Field(None, ge=1, description="V; None: taken from the target at bind()")
    dim: int | None = Field(None, ge=1, description="backbone hidden size d; None: from the target at bind()")
    weights: str | None = Field(None, description="safetensors file with the head's weights; None: random init")
    seed: int = 0
    eps: float = Field(1e-6, gt=0, lt=0.5, description="c_k is clamped into [eps, 1 - eps]")


class DSparkConfidence(nn.Module):
    """c_k = σ(wᵀ[h_k ; E[x_{k−1}]] + b) (paper §3.2.1 eq. 7), x_0 = the anchor.

    Pre-token by construction: it reads h_k and the *previous* token only.  E is the paper's
    "Markov embedding" W1 when the drafter ties it to its correction head (``embedding="head"``,
    :meth:`tie`); by default the head owns its table so that it composes with any correction head
    (``none`` included) and any drafter that provides hidden states.  A tied table is the head's
    parameter: it is trained by both losses and saved once, with the correction head.
    """

    config_model = DSparkHeadConfig

    def __init__(self, config: DSparkHeadConfig | None = None) -> None:
        super().__init__()
        self.config = config or DSparkHeadConfig()
        self.built = False
        self.__dict__["_tied"] = None  # not a submodule: the tied table stays out of our state_dict
        if self.config.vocab_size is not None and self.config.dim is not None:
            self._build(self.config.vocab_size, self.config.dim)

    def bind(self, target: Any) -> None:
        args = getattr(target, "args", target)
        if not self.built:
            self._build(self.config.vocab_size or args.vocab_size, self.config.dim or args.dim)

    def _build(self, vocab: int, dim: int) -> None:
        self.config = self.config.model_copy(update={"vocab_size": vocab, "dim": dim})  # sizes travel with it
        r, gen = self.config.rank, torch.Generator().manual_seed(self.config.seed)
        rows = getattr(self, "_rows", None)
        if rows is not None:
            vocab = int(rows.max()) + 1  # a row per draft id and one for every other token
            self.config = self.config.model_copy(update={"vocab_size": vocab})
            self.register_buffer("token_rows", rows.clone())
        if self.config.embedding == "own":
            self.embed = nn.Parameter(torch.randn(vocab, r, generator=gen))
        self.proj = nn.Linear(dim + r, 1)
        with torch.no_grad():
            self.proj.weight.uniform_(-(dim + r) ** -0.5, (dim + r) ** -0.5, generator=gen)
            self.proj.bias.zero_()  # c = ½ until trained, whatever the inputs' scale
        self.built = True
        if self.config.weights:
            self.load_state_dict(load_file(self.config.weights))

    def restrict(self, token_rows: Tensor) -> None:
        """Over a draft vocabulary: an own table of N + 1 rows (see the correction heads'
        ``restrict``); a tied table follows its head.  Rebuilds a built head."""
        rows = token_rows.to(torch.long)
        self._rows = rows
        if self.built:
            self._build(int(rows.max()) + 1, self.config.dim or 0)

    def tie(self, head: nn.Module) -> None:
        """Read E from a built correction head's W1 through its ``embed_previous`` (``embedding="head"`` only)."""
        if self.config.embedding != "head":
            raise ValueError("tie() needs embedding='head'")
        if not callable(getattr(head, "embed_previous", None)):
            raise ConfigError(["confidence.embedding: 'head' reads the correction head's token embedding; "
                               f"the pipeline's correction head ({type(head).__name__}) has none "
                               "(use markov, gated or rnn, or embedding='own')"])
        if head.config.rank != self.config.rank:
            raise ValueError(f"the head's rank {head.config.rank} differs from the confidence rank {self.config.rank}")
        self.__dict__["_tied"] = head

    def share(self, correction_head: Any) -> None:
        """Lifecycle hook: with ``embedding="head"``, take the pipeline's correction head's table."""
        if self.config.embedding == "head":
            self.tie(correction_head)

    def load_weights(self, weights: ComponentWeights) -> None:
        """Trained weights handed over by the engine (a drafter checkpoint's confidence head)."""
        load_trained(self, weights, "confidence")

    def embed_previous(self, prev: Tensor) -> Tensor:
        """E's rows for the previous tokens ``prev`` (target ids)."""
        if self.config.embedding == "own":
            rows = getattr(self, "token_rows", None)
            return self.embed[prev if rows is None else rows[prev]]
        if self._tied is None:
            raise RuntimeError("dspark-head with embedding='head' must be tie()d to a correction head")
        return self._tied.embed_previous(prev)

    @property
    def table(self) -> Tensor:
        """E itself (the own table, or the tied head's W1)."""
        if self.config.embedding == "own":
            return self.embed
        if self._tied is None:
            raise RuntimeError("dspark-head with embedding='head' must be tie()d to a correction head")
        return self._tied.w1

    def logits(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor:
        """``hidden [..., d]``, ``prev_tokens [...]`` (x_{k−1}) → pre-sigmoid ``[...]`` (training)."""
        if not self.built:
            raise RuntimeError("dspark-head: bind() it to a target (or give vocab_size/dim) first")
        e = self.embed_previous(prev_tokens)
        return self.proj(torch.cat([hidden.to(e.dtype), e], dim=-1)).squeeze(-1)

    def estimate(self, block: DraftBlock) -> Tensor:
        if block.hidden is None or block.anchor is None:
            raise ValueError("dspark-head needs block.hidden and block.anchor")
        g = block.hidden.shape[1]
        # x_{k−1}: the anchor for k = 1, else the previous draft token; tokens[:, k] never enters.
        prev = torch.cat([block.anchor[:, None], block.tokens[:, : g - 1]], dim=1)
        with torch.no_grad():
            c = torch.sigmoid(self.logits(block.hidden, prev).float())
        return c.clamp(self.config.eps, 1 - self.config.eps)

    def save(self, path: str) -> None:
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, path)


#: The trainable confidence heads by registered name: what a block drafter trains and saves.
CONFIDENCE_HEADS: dict[str, type[DSparkConfidence]] = {"dspark-head": DSparkConfidence}
