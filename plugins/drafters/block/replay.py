"""A block drafter's greedy rounds replayed on the training path (``specforge bench probe
--drafter``, docs/reference-run.md#replay).

Over cached features of finished text, every answer position is an anchor: one backbone pass
over all of them drafts what the drafter would propose there, the correction head teacher-forced
with the true previous token.  From that, per slot, the top-1 agreement of the draft with the
text (the conditional acceptance of a chain at T = 0: a draft is only verified after its
predecessors matched), and the walk the engine takes at T = 0 over the same text — anchor, accept
the drafts while they match, the target's token, next anchor — with its τ.  The replay's first
slot is lower than the teacher-forced one because rounds start where the last draft failed.

Run over the engine's own output, the walk reproduces the engine's rounds exactly
(tests/test_replay.py): the check that serving hands the drafter the features, positions and
context that training does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specforge.toolkit.replay import ReplayTally
from specforge_plugins.drafters.block.model import BlockBackbone

__all__ = ["replay_rounds"]


def replay_rounds(backbone: BlockBackbone, head: nn.Module | None, features: list[Any]) -> dict[str, Any]:
    """``{"top1": [per slot], "replay_tau", "rounds"}`` of ``backbone`` (bound) and its correction
    ``head`` (bound, or None) over ``features`` (:class:`~specforge.features.SequenceFeatures`)."""
    gamma, vocab = backbone.config.gamma, backbone.vocab
    tally = ReplayTally(gamma)
    with torch.no_grad():
        for f in features:
            n, mask = len(f), f.loss_mask.bool()
            a = torch.nonzero(mask[1:]).reshape(-1)  # every position whose next token is an answer token
            if len(a) == 0:
                continue
            hidden, logits = backbone(backbone.make_block(f.input_ids[a]), f.taps.flatten(1)[None], a,
                                      ctx_index=torch.zeros(len(a), dtype=torch.long))
            pos = a[:, None] + 1 + torch.arange(gamma)[None]
            labels = f.input_ids[pos.clamp(max=n - 1)]
            if head is not None:
                logits = head.forward_train(logits, torch.cat([f.input_ids[a][:, None], labels[:, :-1]], 1), hidden)
            pred = logits.argmax(-1) if vocab is None else vocab.to_target(logits.argmax(-1))
            tally.add(pred == labels, (pos < n) & mask[pos.clamp(max=n - 1)])
    return tally.result()
