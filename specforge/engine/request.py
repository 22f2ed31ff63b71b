"""Requests, their statistics and what the engine streams back."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FinishReason", "GenerationRequest", "RequestOutput", "RequestStats", "StreamEvent"]


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
class RequestStats:
    """Counters of one request (names and definitions: docs/design/metrics.md)."""

    rounds: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    emitted: int = 0
    prompt_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)
    # rounds in which position k was verified *and* every earlier draft was accepted: the
    # denominator of the conditional acceptance (verified_per_position also counts positions
    # verified after an earlier rejection, whose fate was already sealed)
    reached_per_position: list[int] = field(default_factory=list)
    started: float = 0.0
    first_token: float | None = None
    finished: float | None = None

    @property
    def tau(self) -> float:
        """Mean tokens committed per round: accepted drafts plus the correction/bonus token."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        end = self.finished
        if end is None or end <= self.started:
            return 0.0
        return self.emitted / (end - self.started)

    def record_round(self, verified: int, accepted: int, drafted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.verified += verified
        self.accepted += accepted
        for counts in (self.verified_per_position, self.accepted_per_position, self.reached_per_position):
            if len(counts) < verified:  # the lists always cover every position ever verified
                counts.extend([0] * (verified - len(counts)))
        for k in range(verified):
            self.verified_per_position[k] += 1
        for k in range(min(verified, accepted + 1)):
            self.reached_per_position[k] += 1
        for k in range(accepted):
            self.accepted_per_position[k] += 1

    @classmethod
    def pooled(cls, stats: Iterable[RequestStats]) -> RequestStats:
        """The counters of several requests added up (rounds, counts and per-position counts)."""
        total = cls()
        for s in stats:
            total.rounds += s.rounds
            total.drafted += s.drafted
            total.verified += s.verified
            total.accepted += s.accepted
            total.emitted += s.emitted
            total.prompt_tokens += s.prompt_tokens
            for mine, theirs in ((total.verified_per_position, s.verified_per_position),
                                 (total.reached_per_position, s.reached_per_position),
                                 (total.accepted_per_position, s.accepted_per_position)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for k, n in enumerate(theirs):
                    mine[k] += n
        return total

    def conditional_acceptance(self) -> list[float]:
        """P(x_k accepted | x_<k accepted and x_k verified), per position."""
        return [a / n if n else float("nan") for a, n in zip(self.accepted_per_position, self.reached_per_position)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.emitted,
            "drafted": self.drafted,
            "verified": self.verified,
            "accepted": self.accepted,
            "tau": round(self.tau, 4),
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
