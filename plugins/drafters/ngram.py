"""``ngram``: prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` speculative method).

No model: the drafter looks for the most recent earlier occurrence of the request's last n tokens
(n from ``max_ngram`` down to ``min_ngram``, the anchor x_0 being the last token) and proposes the
tokens that followed it.  Code, maths and chat answers that quote their prompt repeat themselves
often enough for this to pay on its own, and a proposal costs no forward pass.

The search is vectorised over the whole batch: histories are left-padded into one ``[R, L]``
tensor so that every request's suffix sits in the same columns, and for each candidate end
position ``j`` one comparison per offset ``k < max_ngram`` tells whether ``h[j-k] == h[L-1-k]``.
A running AND over ``k`` gives the length of the common suffix ending at ``j`` (capped at
``max_ngram``); the longest length wins and, among positions that reach it, the last one.  That is
exactly "longest n first, then most recent occurrence" at O(R·L·max_ngram) tensor work.

**Its confidence.**  The length n of the match is known before any token is proposed, and a
longer match is a better bet: the block reports c_k = n / (n + 1) at every slot
(``DraftBlock.confidence``; 0.5 for a one-token match, 0.75 for three).  It is a raw signal, read
by the ``reported`` confidence estimator and mapped to acceptance rates by a calibrator fitted
on this pipeline's rounds (docs/composition.md#confidence-per-member).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from specforge.components import DraftBlock, DraftContext

__all__ = ["NgramConfig", "NgramDrafter"]


class NgramConfig(BaseModel):
    """Parameters of the ``ngram`` drafter."""

    model_config = ConfigDict(extra="forbid")

    gamma: int = Field(5, ge=1, description="most tokens proposed per round")
    max_ngram: int = Field(3, ge=1, description="longest suffix tried first")
    min_ngram: int = Field(1, ge=1, description="shortest suffix accepted as a match")
    search_window: int | None = Field(
        None, ge=2, description="search only the last W tokens of each history (None: all of it)"
    )

    @model_validator(mode="after")
    def _ordered(self) -> NgramConfig:
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram})"
            )
        return self


class NgramDrafter:
    """Deterministic drafter: copies the continuation of the latest matching n-gram."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self.gamma = self.config.gamma

    def bind(self, target: Any) -> None:
        """Nothing to share with the target: the drafter reads token ids only."""

    def release(self, request_id: int) -> None:
        """No per-request state: every round searches the history it is given."""

    def draft(self, ctx: DraftContext) -> DraftBlock:
        histories = ctx.histories
        device = histories[0].device if histories else torch.device("cpu")
        if not histories:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return DraftBlock(tokens=empty.view(0, 0), lengths=empty, anchor=empty,
                              confidence=torch.zeros(0, 0))
        start, matched, padded = self._match(histories)
        width = padded.shape[1]
        cap = ctx.max_tokens.to(device=device, dtype=torch.long).clamp(0, self.gamma)
        # The continuation runs from just after the match to the end of the history (the anchor
        # included), so it is never empty when there is a match; start < 0 means no match.
        lengths = torch.where(start >= 0, torch.minimum(cap, width - start), torch.zeros_like(cap))
        g = int(lengths.max())
        offsets = torch.arange(g, device=device)
        cols = (start.clamp_min(0).unsqueeze(1) + offsets).clamp_max(width - 1)
        tokens = padded.gather(1, cols).long()
        tokens = torch.where(offsets < lengths.unsqueeze(1), tokens, torch.zeros_like(tokens))
        n = matched.to(torch.get_default_dtype()).unsqueeze(1).expand(-1, g)
        return DraftBlock(tokens=tokens, lengths=lengths, anchor=ctx.anchor.to(device), confidence=n / (n + 1))

    def _match(self, histories: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Return the continuation start column per request (-1: no match), the match length
        (0: none) and the padded batch."""
        window = self.config.search_window
        # int32 halves the memory traffic of the comparisons; token ids fit easily.
        rows = [h.reshape(-1).to(torch.int32) for h in histories]
        if window is not None:
            rows = [h[-window:] for h in rows]
        # Left padding aligns every suffix on the last columns.  Pads are -1, and a pad read as
        # part of a too-short suffix is turned into -2 below, so no comparison ever matches a pad
        # (token ids are non-negative).
        padded = torch.nn.utils.rnn.pad_sequence(
            rows, batch_first=True, padding_value=-1, padding_side="left"
        )
        n_rows, width = padded.shape
        device = padded.device
        # Candidate match ends j = 0 .. width-2: a match must end strictly before the anchor.
        ends = width - 1
        # run[r, j]: length of the common suffix of h[..j] and h (capped at max_ngram); a byte is
        # enough for any sensible n and keeps the per-offset update cheap.
        small = self.config.max_ngram <= torch.iinfo(torch.uint8).max
        run = torch.zeros(n_rows, ends, dtype=torch.uint8 if small else torch.int32, device=device)
        alive = torch.ones(n_rows, ends, dtype=torch.bool, device=device)
        for k in range(min(self.config.max_ngram, ends)):
            # Offset k compares h[j-k] with h[L-1-k]; ends j < k have nothing at j-k.
            needle = padded[:, ends - k : ends - k + 1]
            needle = needle.masked_fill(needle < 0, -2)
            if k:
                alive[:, k - 1] = False
            alive[:, k:] &= padded[:, : ends - k] == needle
            run += alive
        if ends == 0:
            none = torch.full((n_rows,), -1, dtype=torch.long, device=device)
            return none, none + 1, padded
        best = run.amax(1, keepdim=True)
        cols = torch.arange(ends, device=device)
        last = torch.where(run == best, cols, -1).amax(1)
        found = best.squeeze(1) >= self.config.min_ngram
        return torch.where(found, last + 1, -1), torch.where(found, best.squeeze(1).long(), 0), padded
