"""A suffix index over token documents: what followed a context, and how often.

The idea of REST (He et al., 2024) and SuffixDecoding (Oliaro et al., 2024), built the way a CPU
likes it: every position p of the concatenated documents is a row holding the ``width`` tokens
that start there (shifted by one so that 0 marks "past the end of the document"), packed three
20-bit tokens to an int64 word, and the rows are sorted lexicographically.  All positions whose
first n tokens equal a context then form one contiguous range, found by two binary searches per
word; and inside that range the token after the context is sorted too, so the continuations and
their counts are runs of equal values.  Proposing is a walk down those runs: take the most
frequent next token, narrow the range to its run, repeat — a greedy path down the suffix tree,
whose share of each step is the empirical conditional frequency of the token proposed.

Built in O(N log N) (a lexsort of N rows); a lookup costs a few ``searchsorted`` calls on
contiguous slices, no Python loop over the corpus.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Proposal", "SuffixIndex"]

# Three 20-bit tokens to an int64 word: 60 bits, so keys stay positive and any vocabulary in use
# (up to a million ids) fits; 0 marks the end of a document, so a token is stored as id + 1.
_PER_WORD = 3
_BITS = 20
MAX_TOKEN = (1 << _BITS) - 2


@dataclass(frozen=True)
class Proposal:
    """A continuation: its tokens, the share of each step (count of the path through it over the
    count of the path before it), the context length matched and how often that context occurs."""

    tokens: list[int]
    shares: list[float]
    context: int
    count: int


class SuffixIndex:
    """Sorted rows of ``width`` tokens over ``documents`` (sequences of token ids)."""

    def __init__(self, documents: Sequence[Sequence[int]], width: int) -> None:
        self.width = width
        self.words = -(-width // _PER_WORD)
        docs = [np.asarray(d, dtype=np.int64) for d in documents if len(d)]
        self.tokens = int(sum(len(d) for d in docs))
        if docs and max(int(d.max()) for d in docs) > MAX_TOKEN:
            raise ValueError(f"token ids above {MAX_TOKEN} do not fit the index's 20-bit packing")
        if docs and min(int(d.min()) for d in docs) < 0:
            raise ValueError("token ids must be non-negative")
        # One 0 after each document, and width - 1 more at the very end, so every row reads
        # `width` values and a row never runs from one document into the next.
        flat = np.zeros(self.tokens + len(docs) + width, dtype=np.int64)
        starts, at = [], 0
        for d in docs:
            flat[at:at + len(d)] = d + 1
            starts.append(np.arange(at, at + len(d)))
            at += len(d) + 1
        self._flat = flat
        positions = np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)
        packed = np.zeros((len(positions), self.words), dtype=np.int64)
        for k in range(self.words * _PER_WORD):
            column = flat[np.minimum(positions + k, len(flat) - 1)] if k < width else 0
            packed[:, k // _PER_WORD] |= np.asarray(column, dtype=np.int64) << (_BITS * (_PER_WORD - 1 - k % _PER_WORD))
        order = np.lexsort(packed.T[::-1]) if len(positions) else positions
        self._positions = positions[order]
        self._packed = np.ascontiguousarray(packed[order].T)  # [words, N]: one sorted column per word

    def __len__(self) -> int:
        return len(self._positions)

    def occurrences(self, context: Sequence[int]) -> tuple[int, int]:
        """The range ``[lo, hi)`` of rows whose first ``len(context)`` tokens are ``context``."""
        if len(context) > self.width:
            raise ValueError(f"a context of {len(context)} tokens is longer than the index's rows ({self.width})")
        lo, hi = 0, len(self._positions)
        shifted = [t + 1 for t in context]
        for w in range(0, len(shifted), _PER_WORD):
            part = shifted[w:w + _PER_WORD]
            key = 0
            for t in part:
                key = (key << _BITS) | t
            free = _BITS * (_PER_WORD - len(part))
            column = self._packed[w // _PER_WORD, lo:hi]
            first = int(np.searchsorted(column, key << free, side="left"))
            last = int(np.searchsorted(column, (key + 1) << free, side="left"))
            lo, hi = lo + first, lo + last
            if lo >= hi:
                break
        return lo, hi

    def _next(self, lo: int, hi: int, offset: int) -> np.ndarray:
        """Token + 1 (0: the document ended) at ``offset`` after each row of ``[lo, hi)``, sorted."""
        word, slot = divmod(offset, _PER_WORD)
        shift = _BITS * (_PER_WORD - 1 - slot)
        return (self._packed[word, lo:hi] >> shift) & ((1 << _BITS) - 1)

    def propose(self, context: Sequence[int], depth: int, min_prob: float) -> Proposal | None:
        """The most frequent continuation of ``context`` (all of it must match), at most
        ``depth`` tokens, stopped before the path's probability — the product of its shares —
        falls below ``min_prob`` or the documents end; None if the context never occurs."""
        lo, hi = self.occurrences(context)
        if lo >= hi:
            return None
        count, prob = hi - lo, 1.0
        tokens: list[int] = []
        shares: list[float] = []
        depth = min(depth, self.width - len(context))
        for offset in range(len(context), len(context) + depth):
            nxt = self._next(lo, hi, offset)
            values, firsts, counts = np.unique(nxt, return_index=True, return_counts=True)
            best = int(np.argmax(counts))  # the most frequent; among equals the smallest id
            share = counts[best] / (hi - lo)
            if values[best] == 0 or prob * share < min_prob:
                break
            prob *= share
            tokens.append(int(values[best]) - 1)
            shares.append(float(share))
            lo, hi = lo + int(firsts[best]), lo + int(firsts[best]) + int(counts[best])
        return Proposal(tokens, shares, len(context), count)
