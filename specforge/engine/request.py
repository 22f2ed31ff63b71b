"""Requests, their statistics and what the engine streams back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specforge.acceptance import AcceptanceCounts

__all__ = ["FinishReason", "GenerationRequest", "RequestOutput", "RequestStats", "StreamEvent", "positions_needed"]

# Positions past a request's last token that a round may still write: a block of drafts (γ ≤ 15)
# and the bonus token.
_DRAFT_ROOM = 16


def positions_needed(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """The positions any of these prompts can reach with ``max_new_tokens`` new tokens and a block
    of drafts past them: the context a job that knows its prompts sizes its KV cache for (a bench,
    an evaluation, a peer's ``n_ctx``), not the 4,096 a server keeps for prompts it has not seen."""
    return max(map(len, prompt_ids), default=0) + max_new_tokens + _DRAFT_ROOM


class FinishReason:
    EOS = "eos"
    STOP = "stop"  # a stop string
    LENGTH = "length"  # max_new_tokens
    CONTEXT = "context"  # the context limit
    ERROR = "error"


@dataclass
class GenerationRequest:
    """One prompt and how to continue it.  Sampling fields left ``None`` take the pipeline's
    defaults.  Give either ``prompt`` (text or chat messages) or ``prompt_ids``."""

    prompt: str | Sequence[dict[str, str]] | None = None
    prompt_ids: Sequence[int] | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    request_id: int | None = None
    chat: bool = True


@dataclass
class RequestStats(AcceptanceCounts):
    """Counters of one request: its rounds' acceptance counts (:mod:`specforge.acceptance`), its
    tokens and its times (names and definitions: docs/design/metrics.md)."""

    emitted: int = 0
    prompt_tokens: int = 0
    started: float = 0.0
    first_token: float | None = None
    finished: float | None = None

    @property
    def tokens_per_second(self) -> float:
        end = self.finished
        if end is None or end <= self.started:
            return 0.0
        return self.emitted / (end - self.started)

    def add(self, other: AcceptanceCounts) -> None:
        """Pool ``other``'s rounds, and its tokens when it is a request's too."""
        super().add(other)
        if isinstance(other, RequestStats):
            self.emitted += other.emitted
            self.prompt_tokens += other.prompt_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.emitted,
            "drafted": self.drafted,
            "verified": self.verified,
            "accepted": self.accepted,
            "tau": round(self.tau, 4) if self.rounds else 0.0,
            "accepted_per_position": list(self.accepted_per_position),
            "verified_per_position": list(self.verified_per_position),
            "reached_per_position": list(self.reached_per_position),
            "tokens_per_s": round(self.tokens_per_second, 3),
            "time_to_first_token_s": None if self.first_token is None else round(self.first_token - self.started, 4),
            "seconds": None if self.finished is None else round(self.finished - self.started, 4),
        }


@dataclass(frozen=True)
class StreamEvent:
    """New tokens of one request after a round (``finished`` on its last event)."""

    request_id: int
    token_ids: tuple[int, ...]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stats: RequestStats
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "tokens": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "stats": self.stats.to_dict(),
        }
