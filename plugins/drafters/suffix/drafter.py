"""``suffix``: propose what most often followed the request's last tokens in a corpus of the
target's own answers and in the answers this drafter has already seen finished (docs/composition.md#suffix).

Prompt lookup (``ngram``) searches one request's history; this drafter searches what the target
wrote elsewhere — a model answering many prompts repeats its own phrasing ("To solve this
problem, we need to", a function's boilerplate) — the idea of REST (a datastore) and
SuffixDecoding (a tree over earlier outputs).  Two :class:`~.index.SuffixIndex` es: a static one
over ``corpus`` (JSONL conversations — a regenerated-data directory of ``specforge train`` is
one — whose assistant turns are tokenised with the target's tokenizer at ``bind``), and one over
the outputs of requests this drafter has released (``learn``), rebuilt as they accumulate.

**The proposal** comes from the index whose match is the longest context (``max_context`` down to
``min_context`` tokens, the anchor last), then the one where it occurs more often; it follows the
most frequent continuation while the product of its steps' shares stays ≥ ``min_prob``.  Each
slot's share — how often the proposed token followed the path before it — is the drafter's
confidence (``DraftBlock.confidence``): known before the slot's token is chosen, and an empirical
acceptance estimate a calibrator can sharpen.  The drafts are deterministic (q one-hot), so any
lossless verifier keeps the target's law.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from specforge.components import DraftBlock, DraftContext
from specforge.errors import SpecforgeError
from specforge.toolkit.corpus import answer_documents
from specforge_plugins.drafters.suffix.corpora import resolve_corpus
from specforge_plugins.drafters.suffix.index import MAX_TOKEN, Proposal, SuffixIndex

__all__ = ["SuffixConfig", "SuffixDrafter"]


class SuffixConfig(BaseModel):
    """Parameters of the ``suffix`` drafter."""

    model_config = ConfigDict(extra="forbid")

    gamma: int = Field(8, ge=1, description="most tokens proposed per round")
    corpus: list[str] = Field(default_factory=list,
                              description="JSONL files of conversations, or directories of them, whose "
                                          "assistant turns are searched (e.g. a regenerated-data directory), "
                                          "or shipped:<name> for a corpus shipped with specforge")
    learn: bool = Field(True, description="also search the outputs of requests this drafter has seen finish")
    learn_tokens: int = Field(200_000, ge=1, description="learned output tokens kept (the oldest go first)")
    max_context: int = Field(6, ge=1, description="longest context matched first")
    min_context: int = Field(2, ge=1, description="shortest context matched")
    min_prob: float = Field(0.1, ge=0, le=1, description="stop once the continuation's probability (the "
                                                         "product of its shares) would fall below this")

    @model_validator(mode="after")
    def _ordered(self) -> SuffixConfig:
        if self.min_context > self.max_context:
            raise ValueError(f"min_context ({self.min_context}) must not exceed max_context ({self.max_context})")
        return self


class SuffixDrafter:
    """Deterministic drafter over a static corpus and the outputs it has seen finish."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self.gamma = self.config.gamma
        self._width = self.config.max_context + self.gamma
        self._corpus: SuffixIndex | None = None
        self._learned: list[list[int]] = []  # finished outputs, oldest first
        self._learned_tokens = 0  # their total length (kept, not summed again every round)
        self._learned_index: SuffixIndex | None = None
        self._indexed = 0  # learned tokens the index holds
        self._open: dict[int, tuple[int, torch.Tensor]] = {}  # request id → (prompt length, its last history)

    def bind(self, target: Any) -> None:
        """Tokenise the corpus with the target's tokenizer and index it."""
        if target.vocab_size - 1 > MAX_TOKEN:
            raise SpecforgeError(f"drafter suffix: a vocabulary of {target.vocab_size:,} ids does not fit "
                                 f"the index (at most {MAX_TOKEN + 1:,})")
        if self.config.corpus:
            paths = [resolve_corpus(entry, f"drafter.corpus.{i}") for i, entry in enumerate(self.config.corpus)]
            documents = answer_documents(paths, lambda text: target.encode(text, chat=False), key="drafter.corpus")
            self._corpus = SuffixIndex(documents, self._width)

    def release(self, request_id: int) -> None:
        """Learn the finished request's output (what it wrote after its prompt)."""
        prompt_len, history = self._open.pop(request_id, (0, None))
        if self.config.learn and history is not None and len(history) > prompt_len:
            self._learned.append(history[prompt_len:].tolist())
            self._learned_tokens += len(self._learned[-1])
            while self._learned_tokens > self.config.learn_tokens and len(self._learned) > 1:
                self._learned_tokens -= len(self._learned.pop(0))

    def forget(self) -> None:
        """Drop the learned outputs (the corpus stays): :class:`specforge.protocols.Learns`."""
        self._learned, self._learned_index, self._indexed, self._learned_tokens = [], None, 0, 0

    def draft(self, ctx: DraftContext) -> DraftBlock:
        self._refresh()
        cap = ctx.max_tokens.clamp(0, self.gamma).tolist()
        proposals = []
        for rid, history, room in zip(ctx.request_ids, ctx.histories, cap):
            history = history.reshape(-1)
            # the first history a request shows is its prompt and the anchor: its output starts there
            prompt_len = self._open.get(rid, (len(history) - 1, None))[0]
            self._open[rid] = (prompt_len, history)  # kept as it is, read once at release
            proposals.append(self._propose(history[-self.config.max_context:].tolist(), room))
        g = max([len(p.tokens) for p in proposals if p is not None] + [0])
        tokens = torch.zeros(len(proposals), g, dtype=torch.long)
        confidence = torch.zeros(len(proposals), g)
        lengths = torch.zeros(len(proposals), dtype=torch.long)
        for r, p in enumerate(proposals):
            if p is not None and p.tokens:
                n = len(p.tokens)
                tokens[r, :n] = torch.tensor(p.tokens)
                confidence[r, :n] = torch.tensor(p.shares)
                lengths[r] = n
        return DraftBlock(tokens=tokens, lengths=lengths, anchor=ctx.anchor, confidence=confidence)

    def _propose(self, history: list[int], room: int) -> Proposal | None:
        """The longest context found in either index (then the more frequent), continued."""
        if room <= 0:
            return None
        indexes = [ix for ix in (self._learned_index, self._corpus) if ix is not None and len(ix)]
        for n in range(min(self.config.max_context, len(history)), self.config.min_context - 1, -1):
            context = history[-n:]
            found = [(hi - lo, ix) for ix in indexes for lo, hi in [ix.occurrences(context)] if hi > lo]
            if found:
                _, best = max(found, key=lambda pair: pair[0])
                return best.propose(context, room, self.config.min_prob)
        return None

    def _refresh(self) -> None:
        """Index the learned outputs again once they grew by more than a quarter (or lost some):
        a rebuild sorts every learned row, so growing by a constant factor keeps its cost per
        learned token logarithmic however many requests finish."""
        if not self.config.learn:
            return
        total = self._learned_tokens
        if total - self._indexed > self._indexed // 4 or total < self._indexed:
            self._learned_index = SuffixIndex(self._learned, self._width)
            self._indexed = total
