"""What drafters of up to γ tokens a round share beside their networks: the target shape their
layers copy, the draft-vocabulary bound, the opening of a round and the per-request row a chain
drafter starts it from (docs/design/drafters.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from specforge.components import DraftBlock, DraftContext

__all__ = ["LastRows", "TargetShape", "check_draft_vocab_size", "empty_block", "open_round"]


def check_draft_vocab_size(size: int | None, vocab_size: int) -> None:
    """A draft vocabulary of ``size`` tokens (``None``: none) must leave some of the target's out."""
    if size is not None and size >= vocab_size:
        raise ValueError(f"draft_vocab_size {size} must be smaller than the target's {vocab_size} tokens "
                         "(leave it unset for the whole vocabulary)")


class TargetShape(BaseModel):
    """The shape of a target layer, which a drafter's layers copy: the first fields of a drafter's
    checkpoint config (a subclass adds the drafter's own; its JSON keeps this order)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(ge=1)
    dim: int = Field(ge=1, description="hidden size d of the target (and of the drafter)")
    n_heads: int = Field(ge=1)
    n_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=2)
    intermediate_size: int = Field(ge=1)
    n_target_layers: int = Field(ge=1)
    norm_eps: float = 1e-6
    activation: Literal["silu", "gelu_tanh"] = "silu"

    @model_validator(mode="after")
    def _check_heads(self) -> TargetShape:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        return self

    @staticmethod
    def target_fields(args: Any) -> dict[str, Any]:
        """These fields read off a target's :class:`~specforge.model_args.ModelArgs`."""
        return dict(vocab_size=args.vocab_size, dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                    head_dim=args.head_dim, intermediate_size=args.intermediate_size,
                    n_target_layers=args.n_layers, norm_eps=args.norm_eps, activation=args.activation)


def open_round(ctx: DraftContext, gamma: int, ready: Tensor | None = None) -> tuple[Tensor, Tensor, int]:
    """The opening of a round: ``(uniforms [R, γ], lengths [R], g)``.

    γ uniforms are drawn per request whatever it drafts, so that a seeded request's stream does not
    depend on its batch-mates.  A request drafts γ tokens capped by its ``max_tokens``, none where
    ``ready [R]`` is False (e.g. no committed row to draft from yet); ``g`` is the longest draft,
    0 when the round drafts nothing (return :func:`empty_block`).
    """
    u = ctx.uniforms(gamma)
    lengths = torch.clamp(ctx.max_tokens, max=gamma)
    if ready is not None:
        lengths = torch.where(ready, lengths, 0)
    return u, lengths, int(lengths.max()) if len(ctx) else 0


def empty_block(ctx: DraftContext) -> DraftBlock:
    """The block of a round in which no request drafts."""
    r = len(ctx)
    return DraftBlock(tokens=torch.zeros(r, 0, dtype=torch.long), lengths=torch.zeros(r, dtype=torch.long),
                      anchor=ctx.anchor)


class LastRows:
    """Per request, the newest committed row of what a drafter reads from the target's features —
    what a drafter that starts each round from the position before the anchor keeps between rounds
    (Medusa: the last layer's output there; EAGLE-3: the fused features of that row).

    A request no row has arrived for yet (a one-token prompt, until the target has run) is not
    :meth:`ready`: it drafts nothing that round.
    """

    def __init__(self) -> None:
        self._rows: dict[int, Tensor] = {}

    def update(self, request_ids: Sequence[int], cu_seqlens: Tensor, rows: Tensor) -> None:
        """Keep each request's last row of ``rows [N, ...]``, flattened as
        :class:`~specforge.components.TargetFeatures` are (request r: ``cu_seqlens[r]:cu_seqlens[r + 1]``)."""
        for rid, lo, hi in zip(request_ids, cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            if hi > lo:
                self._rows[rid] = rows[hi - 1].clone()

    def ready(self, request_ids: Sequence[int]) -> Tensor:
        """``[R]`` bool: a row is held for the request."""
        return torch.tensor([rid in self._rows for rid in request_ids], dtype=torch.bool)

    def gather(self, request_ids: Sequence[int], shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """``[R, *shape]`` the requests' rows in ``dtype``, zeros for one that holds none."""
        if not request_ids:
            return torch.zeros(0, *shape, dtype=dtype)
        return torch.stack([self._rows.get(rid, torch.zeros(shape, dtype=dtype)).to(dtype) for rid in request_ids])

    def release(self, request_id: int) -> None:
        self._rows.pop(request_id, None)
