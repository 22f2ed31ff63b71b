"""EAGLE-3's greedy rounds replayed on the training path (the ``Replays`` protocol, ``specforge
bench probe --drafter``, docs/reference-run.md#replay).

Over cached features of finished text, every position whose next token is an answer token is an
anchor a, and the chain of training-time test runs there as the engine drafts it: step 1 reads
(x_a, g_{a−1}) attending to the context rows before a, step k reads the true token x_{a+k−1}
with the model's own output of step k − 1 — the same inputs the engine gives it after an accepted
prefix, so teacher forcing scores exactly what a T = 0 chain would accept.  An anchor with no row
before it (a = 0) drafts nothing, as in the engine.  The scores go to the one tally every
method's replay uses (:class:`~specforge.toolkit.replay.ReplayTally`).
"""

from __future__ import annotations

from typing import Any

import torch

from specforge.toolkit.replay import ReplayTally
from specforge_plugins.drafters.eagle3.model import Eagle3Model

__all__ = ["replay_chain"]

_ANCHORS = 64  # anchors a chain pass runs together: bounds the context keys copied per anchor


def replay_chain(model: Eagle3Model, features: list[Any], gamma: int) -> dict[str, Any]:
    """``{"top1": [per slot], "replay_tau", "rounds"}`` of ``model`` (bound) drafting ``gamma``
    tokens a round over ``features`` (:class:`~specforge.features.SequenceFeatures`)."""
    tally = ReplayTally(gamma)
    with torch.no_grad():
        for f in features:
            n, mask, ids = len(f), f.loss_mask.bool(), f.input_ids
            a = torch.nonzero(mask[1:]).reshape(-1)
            if len(a) == 0:
                continue
            positions = torch.arange(n)
            k, v, g = model.context_kv(f.taps.flatten(1), torch.cat([ids[1:], ids.new_zeros(1)]), positions)
            pos = a[:, None] + 1 + torch.arange(gamma)[None]
            labels = ids[pos.clamp(max=n - 1)]
            hit = torch.zeros(len(a), gamma, dtype=torch.bool)
            for lo in range(0, len(a), _ANCHORS):
                part = slice(lo, lo + _ANCHORS)
                anchors, want = a[part], labels[part]
                row = (anchors - 1).clamp_min(0)
                b = len(anchors)
                _, logits = model.chain(model.embed(ids[anchors]), g[row], row, k[None].expand(b, -1, -1, -1),
                                        v[None].expand(b, -1, -1, -1), positions[None] <= row[:, None], gamma,
                                        lambda j, _logits, want=want: model.embed(want[:, j]))
                pred = logits.argmax(-1)
                if model.vocab is not None:
                    pred = model.vocab.to_target(pred)
                hit[part] = (pred == want) & (anchors > 0)[:, None]
            tally.add(hit, (pos < n) & mask[pos.clamp(max=n - 1)])
    return tally.result()
