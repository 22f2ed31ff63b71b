"""The sequential stage shared by every drafter whose base logits come in parallel (DSpark, DFlash,
Medusa): left to right over the block, the pipeline's correction head biases slot k's base logits
U_k given x_{k−1} and h_k, and x_k is drawn from the warp of the result with the request's own
uniform.  The law x_k is drawn from is reported as q_k — that is what keeps the verifier exact
(docs/design/drafters.md, "The sequential stage").
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from specforge.components import DraftContext
from specforge.sampling import sample_with_uniform, warp
from specforge.vocab import DraftVocab

__all__ = ["sequential_stage"]


def sequential_stage(ctx: DraftContext, base: Tensor, hidden: Tensor | None, u: Tensor, vocab: DraftVocab | None,
                     candidates: int | None, vocab_size: int) -> tuple[Tensor, Tensor, Tensor, float]:
    """Draw the ``g`` slots of ``base [R, g, N]`` left to right.

    The columns of ``base`` are draft ids (the target's ids without a draft vocabulary ``vocab``).
    Two restrictions make a slot cheaper without touching losslessness, since each q_k is
    reported exactly as sampled and the verifier corrects for any q: a draft vocabulary (q_k is
    zero outside its N tokens) and ``candidates`` (the head's bias, and q_k, only on the top-K of
    U_k, which is fixed before x_k is drawn).  ``u [R, ≥g]`` holds the requests' uniforms.

    Returns target-id ``tokens [R, g]``, ``logits``/``probs`` ``[R, g, vocab_size]`` and the wall
    time spent in the correction head (latency breakdowns report it).
    """
    r, g, n = base.shape
    head = ctx.correction_head
    state = head.init_state(r) if head is not None else None
    k_top = candidates if candidates is not None and candidates < n else None
    whole = vocab is None and k_top is None  # the plain stage: every slot over the whole vocabulary
    if whole:
        logits, probs = torch.empty_like(base), torch.empty_like(base)
    else:  # each slot's K (or N) columns, scattered into [R, g, V] once at the end
        width = k_top or n
        cols_all = torch.empty(r, g, width, dtype=torch.long)
        step_all, law_all = torch.empty(r, g, width, dtype=base.dtype), torch.empty(r, g, width, dtype=base.dtype)
    support = base.topk(k_top, dim=-1).indices if k_top is not None else None  # [R, g, K] draft ids
    every = torch.arange(n).expand(r, n) if support is None else None  # the columns of a whole row
    tokens = torch.empty(r, g, dtype=torch.long)
    prev, in_head = ctx.anchor, 0.0
    for k in range(g):
        h_k = None if hidden is None else hidden[:, k]
        t0 = time.perf_counter()
        if support is None:
            cols, step = every, base[:, k]
            if head is not None:
                step, state = head.step(step, prev, h_k, state)
        else:
            cols, step = support[:, k], base[:, k].gather(1, support[:, k])
            if head is not None:
                step, state = _step_on(head, base[:, k], cols, prev, h_k, state)
        in_head += time.perf_counter() - t0 if head is not None else 0.0
        law = warp(step, ctx.sampling)  # the exact law x_k is drawn from, on ``cols``
        pick = cols.gather(1, sample_with_uniform(law, u[:, k])[:, None])[:, 0]
        if whole:
            logits[:, k], probs[:, k] = step, law
            prev = tokens[:, k] = pick
            continue
        cols_all[:, k], step_all[:, k], law_all[:, k] = cols, step, law
        prev = tokens[:, k] = pick if vocab is None else vocab.ids[pick]
    if not whole:
        cols_t = cols_all if vocab is None else vocab.ids[cols_all]  # the target ids of those columns
        logits = torch.full((r, g, vocab_size), float("-inf"), dtype=base.dtype).scatter_(2, cols_t, step_all)
        probs = torch.zeros(r, g, vocab_size, dtype=base.dtype).scatter_(2, cols_t, law_all)
    return tokens, logits, probs, in_head


def _step_on(head: Any, base: Tensor, support: Tensor, prev: Tensor, hidden: Tensor | None,
             state: Any) -> tuple[Tensor, Any]:
    """The corrected logits of slot k on the candidates ``support [R, K]`` only, from the base
    logits ``base [R, V]``: the head's ``step_on`` when it has one (the shipped low-rank heads
    read K columns of W2), else its full-vocabulary ``step``, gathered."""
    step_on = getattr(head, "step_on", None)
    if callable(step_on):
        return step_on(base.gather(1, support), support, prev, hidden, state)
    out, state = head.step(base, prev, hidden, state)
    return out.gather(1, support), state
