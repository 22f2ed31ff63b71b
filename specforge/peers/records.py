"""What every timed decoding run returns, the engine's and each peer's: greedy by default, a fixed
number of new tokens per request (end of sequence ignored), the prompts cycled through rounds of
``c`` concurrent requests, and one record of aggregate and per-request rates per (system, variant,
concurrency) — so the benchmarks put specforge's engine and every peer in one table
(:mod:`specforge.bench.engine_bench`).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["TEMPERATURE", "loadavg", "rounds_for", "summarize"]

#: The temperature every bench decodes at by default: greedy, so that every arm and every system
#: (HF ``generate``, vLLM, the engine plain or speculative) writes the same tokens for a prompt —
#: they do the same work, their speeds compare token for token, and a lossless drafter must leave
#: the output unchanged.  ``bench round`` and ``bench serving`` take ``--temperature`` (acceptance,
#: and so a round's worth, depends on it); the benches whose peers decode greedily do not.
TEMPERATURE = 0.0


def rounds_for(n_prompts: int, concurrency: int, min_rounds: int = 2) -> list[list[int]]:
    """Prompt indices of each timed round: ``c`` per round, at least ``min_rounds`` rounds and at
    least ``n_prompts`` requests (rounded up to whole rounds), cycling through the prompts."""
    if n_prompts < 1 or concurrency < 1:
        raise ValueError("need at least one prompt and concurrency ≥ 1")
    rounds = max(min_rounds, math.ceil(n_prompts / concurrency))
    return [[(r * concurrency + j) % n_prompts for j in range(concurrency)] for r in range(rounds)]


def loadavg() -> float | None:
    """1-minute load average: other work on the machine skews the timings."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def summarize(
    round_times: Sequence[float],
    new_tokens: Sequence[Sequence[int]],
    prompt_tokens: int,
) -> dict[str, Any]:
    """Aggregate and per-request rates from per-round wall times and per-request token counts."""
    wall = float(sum(round_times))
    total = int(sum(sum(r) for r in new_tokens))
    lat = [t for t, r in zip(round_times, new_tokens) for _ in r]
    per_req = [n / t for t, r in zip(round_times, new_tokens) for n in r if t > 0]
    return {
        "n_requests": sum(len(r) for r in new_tokens),
        "rounds": len(round_times),
        "prompt_tokens": int(prompt_tokens),
        "new_tokens": total,
        "wall_s": round(wall, 4),
        "tok_s": round(total / wall, 3) if wall > 0 else None,
        "per_request_tok_s": round(statistics.fmean(per_req), 3) if per_req else None,
        "latency_s": {
            "mean": round(statistics.fmean(lat), 4),
            "p50": round(statistics.median(lat), 4),
            "max": round(max(lat), 4),
        }
        if lat
        else None,
    }
