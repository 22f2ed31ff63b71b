"""What every shipped verifier shares: input checks, the accepted-prefix count, the emitted row.

A verifier is described twice, on purpose: by its *white-box law* (``accept_probability`` and
``residual``, per position, on warped distributions) and by ``verify`` (batched, on raw logits and
uniforms).  Tests and the conformance suite compute exact laws from the former and check that the
latter realises them, so the generic ``verify`` below is written *in terms of* the two primitives:
accept draft token x_k iff ``u0_k < accept_probability(p_k, q_k, x_k)``; at the first rejection
emit a sample of ``residual(p_k, q_k, x_k)``, or a bonus sample of p at row ℓ_r when all ℓ_r are
accepted.  A verifier whose mechanism is not of that form (``match``) overrides ``_verify``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from specforge.components import VerifyOutput
from specforge.sampling import (
    SamplingParams,
    check_logits,
    check_probs,
    sample_with_uniform,
    warp,
)
from specforge.toolkit.trees import check_parents, verify_tree

__all__ = ["BaseVerifier", "VerifyInputs", "accepted_prefix", "gather_at", "greedy_outcome", "prepare"]


def gather_at(t: Tensor, x: Tensor) -> Tensor:
    """``t[..., x]`` elementwise: ``t`` is ``[..., V]``, ``x`` is ``[...]``; the leading
    dimensions broadcast against each other (``gather`` alone would not)."""
    if t.shape[:-1] == x.shape:  # the common case, without broadcast_shapes' Python-level cost
        return t.gather(-1, x.unsqueeze(-1)).squeeze(-1)
    shape = torch.broadcast_shapes(t.shape[:-1], x.shape)
    index = x.expand(shape).unsqueeze(-1)
    return t.expand(*shape, t.shape[-1]).gather(-1, index).squeeze(-1)


def accepted_prefix(accepted: Tensor, valid: Tensor) -> Tensor:
    """``[R]`` length of the leading run of accepted positions among the valid ones."""
    return torch.cumprod((accepted & valid).to(torch.long), dim=1).sum(dim=1)


@dataclass(frozen=True)
class VerifyInputs:
    """Checked inputs of one ``verify`` call, with every unused slot made harmless.

    ``logits`` has its unused rows (past ℓ_r) replaced by zeros when any row is not finite, and
    ``tokens`` its unused slots by id 0, so no garbage there can turn into NaN decisions or
    out-of-range gathers.  ``probs`` is
    left as given: its unused rows only ever reach masked-out comparisons.
    """

    logits: Tensor  # [R, G+1, V]
    tokens: Tensor  # [R, G] long
    probs: Tensor | None  # [R, G, V] in the dtype of logits, or None (one-hot q)
    lengths: Tensor  # [R] long
    valid: Tensor  # [R, G] bool: k < ℓ_r
    used: Tensor  # [R, G+1] bool: j ≤ ℓ_r
    uniforms: Tensor  # [R, G+1, 2]

    @property
    def gamma(self) -> int:
        return int(self.tokens.shape[1])


def prepare(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    lengths: Tensor,
    sampling: SamplingParams,
    uniforms: Tensor,
) -> VerifyInputs:
    """Validate shapes and values of a ``verify`` call and sanitise unused slots.

    The checks are those of docs/design/verification.md#errors-instead-of-wrong-tokens.
    """
    if target_logits.dim() != 3:
        shape = tuple(target_logits.shape)
        raise ValueError(f"target_logits must be [R, G+1, V], got shape {shape}")
    r, g1, v = target_logits.shape
    g = g1 - 1
    if g < 0:
        raise ValueError("target_logits needs at least one row per request (the bonus row)")
    device = target_logits.device
    if tuple(draft_tokens.shape) != (r, g):
        raise ValueError(f"draft_tokens must be [{r}, {g}], got {tuple(draft_tokens.shape)}")
    if draft_tokens.is_floating_point() or draft_tokens.is_complex():
        raise ValueError(f"draft_tokens must hold integer ids, got {draft_tokens.dtype}")
    if draft_probs is not None and tuple(draft_probs.shape) != (r, g, v):
        raise ValueError(f"draft_probs must be [{r}, {g}, {v}], got {tuple(draft_probs.shape)}")
    if tuple(lengths.shape) != (r,):
        raise ValueError(f"lengths must be [{r}], got {tuple(lengths.shape)}")
    if tuple(uniforms.shape) != (r, g1, 2):
        raise ValueError(f"uniforms must be [{r}, {g1}, 2], got {tuple(uniforms.shape)}")
    if len(sampling) != r:
        raise ValueError(f"sampling params describe {len(sampling)} requests, the batch has {r}")
    sampling.validate()

    lengths = lengths.to(device=device, dtype=torch.long)
    out_of_range = (lengths < 0) | (lengths > g)
    if bool(out_of_range.any()):
        i = int(out_of_range.nonzero()[0, 0])
        raise ValueError(f"request {i}: length {int(lengths[i])} is outside [0, {g}]")
    used = torch.arange(g1, device=device).unsqueeze(0) <= lengths.unsqueeze(1)
    valid = torch.arange(g, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    # One pass decides the common case: if every row sums to a finite number, no row holds NaN or
    # ±inf, so neither the detailed check nor the sanitising copy below is needed.
    all_finite = bool(torch.isfinite(target_logits.sum(-1)).all())
    if not all_finite:
        check_logits(target_logits, used, "target logits")

    tokens = draft_tokens.to(device=device, dtype=torch.long)
    oov = valid & ((tokens < 0) | (tokens >= v))
    if bool(oov.any()):
        i, k = (int(t) for t in oov.nonzero()[0])
        raise ValueError(
            f"request {i}, position {k}: draft token {int(tokens[i, k])} is outside the "
            f"vocabulary [0, {v})"
        )
    if draft_probs is not None:
        draft_probs = draft_probs.to(device=device, dtype=target_logits.dtype)
        check_probs(draft_probs, valid, "draft probabilities")

    return VerifyInputs(
        logits=target_logits if all_finite else torch.where(used.unsqueeze(-1), target_logits,
                                                            target_logits.new_zeros(())),
        tokens=torch.where(valid, tokens, torch.zeros_like(tokens)),
        probs=draft_probs,
        lengths=lengths,
        valid=valid,
        used=used,
        uniforms=uniforms.to(device),
    )


def greedy_outcome(inputs: VerifyInputs) -> VerifyOutput:
    """Verification at temperature 0: accept drafts while each is the row's arg-max, then emit the
    arg-max — the outcome every lossless verifier reaches when the target's law is the one-hot of
    its arg-max.  Top-k/top-p never remove the arg-max, and ``torch.argmax`` returns the first
    maximum, so this is :func:`~specforge.sampling.warp`'s T = 0 one-hot without building it."""
    best = inputs.logits.argmax(-1)
    n = accepted_prefix(best[:, : inputs.gamma] == inputs.tokens, inputs.valid)
    rows = torch.arange(best.shape[0], device=best.device)
    return VerifyOutput(num_accepted=n, next_token=best[rows, n])


class BaseVerifier(ABC):
    """A verifier defined by its per-position law; subclasses provide the two primitives.

    ``accept_probability(p, q, x)`` and ``residual(p, q, x)`` take warped target probabilities
    ``p`` ``[..., V]``, the draft law ``q`` ``[..., V]`` (``None`` = one-hot on ``x``) and draft
    ids ``x`` ``[...]``.
    """

    def __init__(self, config) -> None:
        self.config = config

    @abstractmethod
    def accept_probability(self, p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
        """``[...]`` probability that draft token ``x`` is accepted."""

    @abstractmethod
    def residual(self, p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
        """``[..., V]`` law of the emitted token given that ``x`` was rejected."""

    def verify(
        self,
        target_logits: Tensor,
        draft_tokens: Tensor,
        draft_probs: Tensor | None,
        lengths: Tensor,
        sampling: SamplingParams,
        uniforms: Tensor,
        parents: Tensor | None = None,
    ) -> VerifyOutput:
        """See :class:`specforge.components.Verifier`.  With ``parents`` (a token tree) the
        children of each node are tried in turn under this verifier's own per-position law
        (:func:`~specforge.toolkit.trees.verify_tree`)."""
        inputs = prepare(target_logits, draft_tokens, draft_probs, lengths, sampling, uniforms)
        if parents is None:
            return self._verify(inputs, sampling)
        parents = parents.to(device=inputs.tokens.device, dtype=torch.long)
        check_parents(parents, inputs.lengths)
        return verify_tree(self.accept_probability, self.residual, self.target_probs(inputs, sampling), inputs.tokens,
                           inputs.probs, parents, inputs.lengths, inputs.uniforms)

    def target_probs(self, inputs: VerifyInputs, sampling: SamplingParams) -> Tensor:
        """Warped target law of every row, checked on the rows that are used."""
        p = warp(inputs.logits, sampling)
        # Finite logits can still overflow under a small temperature; catch it before sampling.
        check_probs(p, inputs.used, "warped target probabilities")
        return p

    def _verify(self, inputs: VerifyInputs, sampling: SamplingParams) -> VerifyOutput:
        p = self.target_probs(inputs, sampling)
        g = inputs.gamma
        a = self.accept_probability(p[:, :g], inputs.probs, inputs.tokens)
        # Comparing the float64 uniform with the (possibly lower-precision) probability promotes
        # to float64, so a probability of exactly 1 accepts for every u in [0, 1).
        n = accepted_prefix(inputs.uniforms[:, :g, 0] < a, inputs.valid)
        rows = torch.arange(p.shape[0], device=p.device)
        law = p[rows, n]
        if g > 0:
            k = n.clamp(max=g - 1)
            x = inputs.tokens[rows, k]
            q = None if inputs.probs is None else inputs.probs[rows, k]
            rejected = (n < inputs.lengths).unsqueeze(-1)
            law = torch.where(rejected, self.residual(law, q, x), law)
        next_token = sample_with_uniform(law, inputs.uniforms[rows, n, 1])
        return VerifyOutput(num_accepted=n, next_token=next_token)
