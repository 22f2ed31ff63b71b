"""Draft vocabularies: a drafter that proposes only the N most frequent tokens of the target's own
answers (FR-Spec, ACL 2025; EAGLE-3's ``d2t``/``t2d`` maps).

A drafter's LM head over the target's full vocabulary (49,152 rows for SmolLM2) is a large part
of what a draft position costs on a CPU.  Restricting it to the tokens the target actually
writes cuts that cost by V/N while losing only the rare tokens: q is zero outside the draft
vocabulary, the verifier still sees the full-vocabulary q, and the output law is the target's
whatever q is (docs: design/verification.md).

The maps follow EAGLE-3's convention, which vLLM and SGLang load:

* draft id i ↔ target id ``i + d2t[i]`` (``d2t`` holds int64 *offsets*; draft ids are the kept
  target ids in ascending order, so ``d2t`` is non-decreasing and all zeros for the full vocabulary);
* ``t2d[t]`` is True iff target id t is in the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from specforge.errors import SpecforgeError

__all__ = ["DraftVocab", "DraftVocabError"]


class DraftVocabError(SpecforgeError, ValueError):
    """A draft vocabulary that cannot be used (too large, or maps that do not fit the target)."""


@dataclass(frozen=True)
class DraftVocab:
    """The N target ids a drafter proposes, with both maps.

    Attributes:
        ids: ``[N]`` int64 target id of each draft id, ascending.
        target_size: V, the target's vocabulary size.
    """

    ids: Tensor
    target_size: int

    def __post_init__(self) -> None:
        ids = self.ids
        if ids.dim() != 1 or ids.numel() == 0:
            raise DraftVocabError("a draft vocabulary needs at least one token id")
        if ids.numel() > self.target_size:
            raise DraftVocabError(f"a draft vocabulary of {ids.numel()} tokens is larger than the target's "
                                  f"{self.target_size}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.target_size:
            raise DraftVocabError(f"draft vocabulary ids must lie in 0..{self.target_size - 1}")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise DraftVocabError("draft vocabulary ids must be distinct and ascending")

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def most_frequent(cls, counts: Tensor, size: int) -> DraftVocab:
        """The ``size`` target ids with the largest ``counts [V]`` (ties: the smaller id)."""
        v = int(counts.numel())
        if not 1 <= size <= v:
            raise DraftVocabError(f"draft vocabulary size {size} must be between 1 and the target's {v} tokens")
        # A stable sort on descending counts keeps smaller ids first among equal counts.
        order = torch.sort(counts.to(torch.float64), descending=True, stable=True).indices[:size]
        return cls(torch.sort(order).values.to(torch.long), v)

    @classmethod
    def random(cls, size: int, target_size: int, seed: int) -> DraftVocab:
        """A seeded random draft vocabulary of ``size`` ids (random inits: tests, conformance)."""
        if not 1 <= size < target_size:
            raise DraftVocabError(f"draft_vocab={size} must be between 1 and the target's {target_size - 1}")
        gen = torch.Generator().manual_seed(seed)
        return cls(torch.randperm(target_size, generator=gen)[:size].sort().values, target_size)

    @classmethod
    def from_data(cls, counts: Tensor | None, size: int) -> tuple[DraftVocab, float]:
        """A training method's draft vocabulary: the ``size`` most frequent supervised tokens of
        its data (``counts [V]``, :attr:`~specforge.toolkit.training.DataSummary.token_counts`)
        and the share of those tokens it covers."""
        if counts is None:
            raise ValueError("a draft vocabulary needs the data's token counts")
        vocab = cls.most_frequent(counts, size)
        return vocab, float(counts[vocab.ids].sum() / counts.sum().clamp_min(1))

    @classmethod
    def from_maps(cls, d2t: Tensor, t2d: Tensor) -> DraftVocab:
        """Rebuild from EAGLE-3-style maps, checking that they agree."""
        ids = torch.arange(d2t.numel(), dtype=torch.long) + d2t.to(torch.long)
        vocab = cls(ids, int(t2d.numel()))
        if not torch.equal(vocab.t2d, t2d.to(torch.bool)):
            raise DraftVocabError("d2t and t2d disagree: t2d must be True exactly at the ids d2t maps to")
        return vocab

    # -- the maps ----------------------------------------------------------------------------------

    @property
    def d2t(self) -> Tensor:
        """``[N]`` int64 offsets: target id = draft id + d2t[draft id]."""
        return self.ids - torch.arange(self.size, dtype=torch.long)

    @cached_property
    def t2d(self) -> Tensor:
        """``[V]`` bool: the target id is in the draft vocabulary."""
        return torch.zeros(self.target_size, dtype=torch.bool).index_fill_(0, self.ids, True)

    @cached_property
    def _draft_index(self) -> Tensor:
        # Built once: training maps every step's labels through it.
        index = torch.full((self.target_size,), -1, dtype=torch.long)
        index[self.ids] = torch.arange(self.size, dtype=torch.long)
        return index

    def to_draft(self, target_ids: Tensor, outside: int = -1) -> Tensor:
        """Draft ids of ``target_ids`` (any shape); ``outside`` where a token is not in the vocabulary."""
        ids = self._draft_index.to(target_ids.device)[target_ids.clamp(0, self.target_size - 1)]
        return ids if outside == -1 else ids.masked_fill(ids < 0, outside)

    def token_rows(self) -> Tensor:
        """``[V]`` int64: the draft id of every target id, N for one outside the vocabulary — the
        row a table of N + 1 rows (a draft id each, one shared by all other tokens) reads."""
        return self.to_draft(torch.arange(self.target_size), outside=self.size)

    def to_target(self, draft_ids: Tensor) -> Tensor:
        return self.ids.to(draft_ids.device)[draft_ids]

    def spread(self, values: Tensor, fill: float) -> Tensor:
        """``[..., N]`` values over the draft ids → ``[..., V]`` over the target's, ``fill``
        elsewhere (0 for a law, −inf for logits)."""
        out = torch.full((*values.shape[:-1], self.target_size), fill, dtype=values.dtype, device=values.device)
        return out.scatter_(-1, self.ids.to(values.device).expand(*values.shape[:-1], -1), values)

    def coverage(self, target_ids: Tensor) -> float:
        """Share of ``target_ids`` inside the vocabulary (NaN for none)."""
        if target_ids.numel() == 0:
            return float("nan")
        return float(self.t2d.to(target_ids.device)[target_ids].float().mean())

    def tensors(self) -> dict[str, Tensor]:
        """What a checkpoint stores: ``{"d2t", "t2d"}``."""
        return {"d2t": self.d2t, "t2d": self.t2d}

    def check_target(self, vocab_size: int, where: str) -> None:
        """One clear error when the maps were made for a target of another vocabulary size."""
        if self.target_size != vocab_size:
            raise DraftVocabError(f"{where}: the draft vocabulary maps a target of {self.target_size} tokens; "
                                  f"the bound target has {vocab_size}")
