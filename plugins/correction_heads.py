"""Shipped correction heads: ``none``, the identity (a parallel drafter drafts unbiased), and
DSpark's trainable ``markov``, ``gated`` and ``rnn`` heads (docs/design/drafters.md; the networks are
the toolkit's, :mod:`specforge.toolkit.heads`: block drafters train them and save them in their
checkpoints)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from specforge import hookimpl
from specforge.toolkit.heads import GatedHead, HeadConfig, MarkovHead, RnnHead

__all__ = ["NoCorrection"]


class NoCorrection:
    """Returns the backbone's logits unchanged and carries no state."""

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def init_state(self, batch: int) -> None:
        return None

    def step(self, logits: Tensor, prev_token: Tensor, hidden: Tensor | None, state: Any) -> tuple[Tensor, Any]:
        return logits, state


@hookimpl
def specforge_register_correction_heads(register):
    register("none", NoCorrection, trainable=False, identity=True, description="no sequential correction (identity)")
    # Examples switch zero_init off so that a conformance run exercises a real, non-zero bias.
    examples = ({"rank": 8, "zero_init": False}, {"rank": 16, "zero_init": False, "seed": 1})
    register("markov", MarkovHead, config=HeadConfig, trainable=True, identity=False, examples=examples,
             description="first-order transition bias W1[x_{k-1}] W2 (DSpark, low rank r)")
    register("gated", GatedHead, config=HeadConfig, trainable=True, identity=False, examples=examples,
             description="Markov embedding gated by the backbone state h_k, then W2")
    register("rnn", RnnHead, config=HeadConfig, trainable=True, identity=False, examples=examples,
             description="gated recurrence over the block prefix (DSpark RNN head)")
