"""Acceptance statistics of speculative rounds, defined once (docs/design/metrics.md#acceptance).

In a round a request verifies ℓ draft tokens and accepts the first n of them (0 ≤ n ≤ ℓ), then
commits one more token: the correction after a rejection, or the bonus after a full block.
Positions 1..ℓ were *verified*; positions 1..min(ℓ, n + 1) were *reached* (verified with every
earlier draft accepted: a position verified after a rejection had its fate sealed already);
positions 1..n were *accepted*.  Counts are pooled over rounds (and requests) before dividing:

* τ — committed tokens per round, (Σ n + rounds) / rounds;
* conditional acceptance at k — accepted / reached at k: P(x_k accepted | x_<k accepted);
* survival at k — the product of the conditional acceptances up to k: P(x_1..x_k accepted);
* verify waste — the share of verified tokens that were rejected, (Σ ℓ − Σ n) / Σ ℓ.

The engine counts every request's rounds in an :class:`AcceptanceCounts` (as
:class:`~specforge.engine.RequestStats`); ``specforge eval`` and the benchmarks pool them;
:func:`position_masks` gives the same rule per round as tensors, for the calibration metrics.
Undefined rates (nothing counted) are ``nan``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor

__all__ = ["AcceptanceCounts", "position_masks", "rates", "survival", "tau", "verify_waste"]


def tau(accepted: int, rounds: int) -> float:
    """Committed tokens per round: accepted drafts plus the correction or bonus token."""
    return (accepted + rounds) / rounds if rounds else math.nan


def rates(hits: Sequence[int], trials: Sequence[int]) -> list[float]:
    """``hits[k] / trials[k]`` per position, ``nan`` where there was no trial."""
    return [h / n if n else math.nan for h, n in zip(hits, trials)]


def survival(conditional: Iterable[float]) -> list[float]:
    """Prefix survival per position: the running product of the conditional acceptances."""
    out, running = [], 1.0
    for c in conditional:
        running *= c
        out.append(running)
    return out


def verify_waste(verified: int, accepted: int) -> float:
    """The share of verified draft tokens that were rejected."""
    return (verified - accepted) / verified if verified else math.nan


def position_masks(verified: Tensor, accepted: Tensor, positions: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(verified, reached, accepted)``, each ``[N, positions]`` bool, of N rounds given their
    ``[N]`` verified and accepted counts: mask ``[n, k-1]`` says whether round n verified,
    reached or accepted position k."""
    k = torch.arange(positions, device=verified.device)
    reached = torch.minimum(verified, accepted + 1)
    return tuple(k[None, :] < count[:, None] for count in (verified, reached, accepted))  # type: ignore[return-value]


Counts = TypeVar("Counts", bound="AcceptanceCounts")


@dataclass
class AcceptanceCounts:
    """Round counts of one request or pooled over many; lists cover every position verified."""

    rounds: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)
    reached_per_position: list[int] = field(default_factory=list)  # conditional acceptance's denominator

    def record_round(self, verified: int, accepted: int, drafted: int) -> None:
        """Count one round that drafted ``drafted``, verified ``verified`` and accepted ``accepted``."""
        self.rounds += 1
        self.drafted += drafted
        self.verified += verified
        self.accepted += accepted
        # the module docstring's rule, one round at a time (position_masks: many at once)
        for counts, n in ((self.verified_per_position, verified),
                          (self.reached_per_position, min(verified, accepted + 1)),
                          (self.accepted_per_position, accepted)):
            if len(counts) < verified:  # every list covers every position ever verified
                counts.extend([0] * (verified - len(counts)))
            for k in range(n):
                counts[k] += 1

    def add(self, other: AcceptanceCounts) -> None:
        """Pool ``other``'s rounds into these counts."""
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.verified += other.verified
        self.accepted += other.accepted
        for mine, theirs in ((self.verified_per_position, other.verified_per_position),
                             (self.reached_per_position, other.reached_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for k, n in enumerate(theirs):
                mine[k] += n

    @classmethod
    def pooled(cls: type[Counts], counts: Iterable[AcceptanceCounts]) -> Counts:
        """The counts of several requests added up."""
        total = cls()
        for c in counts:
            total.add(c)
        return total

    @property
    def tau(self) -> float:
        return tau(self.accepted, self.rounds)

    @property
    def verify_waste(self) -> float:
        return verify_waste(self.verified, self.accepted)

    def conditional_acceptance(self) -> list[float]:
        """P(x_k accepted | x_<k accepted and x_k verified), per position."""
        return rates(self.accepted_per_position, self.reached_per_position)

    def survival(self) -> list[float]:
        """P(x_1..x_k all accepted), per position."""
        return survival(self.conditional_acceptance())
