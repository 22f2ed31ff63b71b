"""Timing arms against each other on a shared machine: one helper for every measured choice."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

__all__ = ["fast_mean", "interleaved_seconds"]

K = TypeVar("K", bound=Hashable)


def fast_mean(seconds: list[float]) -> float:
    """The mean of the fastest quarter: on shared cores a neighbour only ever adds time, so the
    fast end of the distribution is the arm's own cost."""
    fast = sorted(seconds)[: max(1, len(seconds) // 4)]
    return sum(fast) / len(fast)


def interleaved_seconds(arms: Mapping[K, Callable[[], object]], reps: int, warmup: int = 2) -> dict[K, float]:
    """Seconds of one call of each arm: ``warmup`` untimed calls each, then ``reps`` rounds that
    call every arm once (alternating order, so drift weighs on every arm alike); each arm's
    :func:`fast_mean`."""
    order = list(arms)
    times: dict[K, list[float]] = {k: [] for k in order}
    for _ in range(warmup):
        for k in order:
            arms[k]()
    for i in range(reps):
        for k in (order if i % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            arms[k]()
            times[k].append(time.perf_counter() - start)
    return {k: fast_mean(ts) for k, ts in times.items()}
