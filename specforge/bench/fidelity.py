"""How close a bf16 rendering of a target stays to its float32 model, teacher-forced.

Dense bf16 weights and native 4-bit blocks (``target.weights``) are two roundings of the same file;
neither is the float32 model transformers decodes it to.  This measures both on the same token
sequences: for every position of a prompt and its continuation, whether the variant's arg-max is
float32's arg-max, and the KL divergence from float32's next-token law.  The reference runs each
sequence in one pass, the variants in passes of a few tokens (the size decoding runs), so it
costs seconds to a minute, not a decoding run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from specforge.runtime import TargetModel
from specforge.passes import VarlenBatch

__all__ = ["rendering_fidelity"]


@torch.inference_mode()
def _logits(target: TargetModel, ids: Sequence[int], chunk: int) -> torch.Tensor:
    # Passes of ``chunk`` tokens, the size of decode and verify passes: the path the engine's
    # decoding takes (native weights use another kernel for bigger passes).
    cache, out = target.new_cache(1, len(ids)), []
    for start in range(0, len(ids), chunk):
        piece = list(ids[start:start + chunk])
        batch = VarlenBatch.build([piece], [0], [start])
        out.append(target.forward(batch, cache, torch.arange(len(piece))).logits)
    return torch.cat(out)


def rendering_fidelity(variants: Mapping[str, TargetModel], sequences: Sequence[Sequence[int]],
                       reference: TargetModel, chunk: int = 4) -> dict[str, Any]:
    """``{name: {top1_agreement, mean_kl, max_kl}, positions}`` of every variant against
    ``reference``'s float32 Hugging Face forward (its oracle) over ``sequences``, the variants
    run ``chunk`` tokens a pass."""
    agree = {name: 0 for name in variants}
    kls: dict[str, list[torch.Tensor]] = {name: [] for name in variants}
    positions = 0
    for ids in sequences:
        exact = reference.reference_logits(ids).log_softmax(-1)
        top = exact.argmax(-1)
        positions += len(ids)
        for name, target in variants.items():
            logp = _logits(target, ids, chunk).log_softmax(-1)
            agree[name] += int((logp.argmax(-1) == top).sum())
            kls[name].append((exact.exp() * (exact - logp)).sum(-1))
    result: dict[str, Any] = {"positions": positions}
    for name in variants:
        kl = torch.cat(kls[name]) if kls[name] else torch.zeros(1)
        result[name] = {"top1_agreement": round(agree[name] / max(positions, 1), 4),
                        "mean_kl": float(f"{kl.mean().item():.3g}"), "max_kl": float(f"{kl.max().item():.3g}")}
    return result
