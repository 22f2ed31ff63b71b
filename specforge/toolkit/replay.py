"""The tally of a drafter's greedy rounds replayed over finished text (the ``Replays`` protocol,
``specforge bench probe --drafter``; docs/reference-run.md#replay).

A drafter that replays scores, at every anchor of a text (every position whose next token is an
answer token), the drafts it would propose there against the tokens that follow: ``hit [A, γ]``,
with ``valid [A, γ]`` where the slot still lies inside the answer.  From those, per slot, the
top-1 agreement (the conditional acceptance of a chain at T = 0: a slot is only verified after
its predecessors matched — teacher forcing gives exactly that), and the walk the engine takes at
T = 0 over the same text: anchor, accept the drafts while they match, the target's token, the
next anchor — with its τ.  Every method's replay hands its scores to one tally, so the figures
mean the same for each.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["ReplayTally"]


class ReplayTally:
    """Per-slot agreement and the greedy walk over the anchors of each text, added one text at a time."""

    def __init__(self, gamma: int) -> None:
        self.hits, self.seen = torch.zeros(gamma), torch.zeros(gamma)
        self.rounds = self.tokens = 0

    def add(self, hit: Tensor, valid: Tensor) -> None:
        """One text's anchors, in order: ``hit``/``valid [A, γ]`` booleans (a slot counts only
        where it and every slot before it lie inside the answer)."""
        valid = torch.cumprod(valid.long(), 1).bool()
        hit = hit & valid
        self.hits += hit.float().sum(0)
        self.seen += valid.float().sum(0)
        run = torch.cumprod(hit.long(), 1).sum(1).tolist()  # drafts a round anchored here accepts
        i, n = 0, len(run)
        while i < n:
            self.rounds += 1
            self.tokens += min(run[i] + 1, n - i)
            i += run[i] + 1

    def result(self) -> dict[str, Any]:
        """``{"top1": [agreement per slot], "replay_tau", "rounds"}``."""
        return {"top1": (self.hits / self.seen.clamp_min(1)).tolist(),
                "replay_tau": self.tokens / max(self.rounds, 1), "rounds": self.rounds}
