"""What the suite sees inside each round: the mechanism statistics' raw material.

The harness hands the engine a drafter and a verifier wrapped in :class:`RoundRecorder`'s
observers.  They change nothing — every call goes to the plug-in, every result comes back as it
was — but they look at each round's draft block, verify lengths and verify outcome, and keep a
few numbers per slot (never the tensors):

* **draft law** — for every drafted slot, the randomised PIT of x_k under the q_k the drafter
  reports.  A drafter that samples from another law than it reports fails here directly, however
  rarely its tokens reach the output;
* **selection** — the same PIT on the slots the scheduler chose to verify.  A verify decision
  that depends on x_k itself (a confidence that reads the token, a scheduler or calibrator that
  reads a later slot, whose confidence depends on x_k) makes verified tokens follow another law
  than q_k (paper Appendix A);
* **acceptance** and **emission** — for a verifier that declares its per-position law
  (``accept_probability`` and ``residual``, docs/reference/contracts.md), whether ``verify``
  realises it: each reached slot is accepted with probability a(x_k), and the emitted token
  follows the residual at the first rejection (stratified by its position) or the target at the
  bonus row (stratified by ℓ);
* **cross-request** — the transforms of two neighbouring requests' draws in the same round
  (their k-th draft tokens, their emitted tokens), taken in id order — the order an inverse-CDF
  sampler uses, so that each tracks the uniform it was drawn with — must be independent:
  uniform on the unit square.

All PIT values are exactly U[0, 1) for a correct pipeline, whatever the laws are, because each is
the transform of a draw under the very law it was drawn from, given everything before it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from specforge.sampling import warp
from specforge_conformance.stats import FitResult, bernoulli_fit, pair_fit, pit, uniformity_fit

__all__ = ["RoundRecorder", "declares_law"]

BONUS = 1000  # emission strata: the rejection position k (0-based), or BONUS + ℓ for a bonus token
EMITTED = -1  # cross-request stratum of emitted tokens (draft tokens: their slot k)


def declares_law(verifier: Any) -> bool:
    """Whether a verifier states its per-position law (the optional white-box contract)."""
    return callable(getattr(verifier, "accept_probability", None)) and callable(getattr(verifier, "residual", None))


class _Stream:
    """PIT values and their strata, accumulated round by round."""

    def __init__(self) -> None:
        self.values: list[Tensor] = []
        self.strata: list[Tensor] = []
        self.impossible = 0

    def add(self, law: Tensor, x: Tensor, strata: Tensor, u: Tensor) -> None:
        if x.numel() == 0:
            return
        v, bad = pit(law, x, u)
        self.values.append(v)
        self.strata.append(strata)
        self.impossible += int(bad.sum())

    def fit(self) -> FitResult:
        if not self.values:
            return uniformity_fit(torch.zeros(0), torch.zeros(0, dtype=torch.long), self.impossible)
        return uniformity_fit(torch.cat(self.values), torch.cat(self.strata), self.impossible)


class RoundRecorder:
    """Observes rounds; :meth:`fits` gives the mechanism statistics of everything seen."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)  # the PITs' own randomisation
        self.draft = _Stream()
        self.selection = _Stream()
        self.emission = _Stream()
        self.accept_prob: list[Tensor] = []
        self.accepted: list[Tensor] = []
        self.pairs: list[Tensor] = []  # [m, 2] id-ordered PITs of neighbouring rows' draws
        self.pair_strata: list[Tensor] = []  # their source: draft slot k, or EMITTED
        self.reported_probs = False
        self.law_declared = False

    def _u(self, n: int) -> Tensor:
        return torch.rand(n, generator=self.gen, dtype=torch.float64)

    # -- observers -----------------------------------------------------------------------------

    def wrap(self, drafter: Any, verifier: Any) -> tuple[Any, Any]:
        self.law_declared = declares_law(verifier)
        return (None if drafter is None else _ObservedDrafter(drafter, self)), _ObservedVerifier(verifier, self)

    def on_draft(self, block, ctx) -> None:
        if block.probs is None or block.tokens.shape[1] == 0:
            return
        self.reported_probs = True
        g = block.tokens.shape[1]
        drafted = torch.arange(g)[None, :] < torch.minimum(block.lengths.to(torch.long), ctx.max_tokens)[:, None]
        rows, cols = drafted.nonzero(as_tuple=True)
        self.draft.add(block.probs[rows, cols], block.tokens[rows, cols], cols, self._u(rows.numel()))
        for k in range(g):
            self._pair(block.probs[:, k], block.tokens[:, k], drafted[:, k], k)

    def _pair(self, law: Tensor, x: Tensor, live: Tensor, stratum: int) -> None:
        """Pairs (2j, 2j+1) of rows whose draw is real, as id-ordered PITs."""
        r = (x.shape[0] // 2) * 2
        both = live[0:r:2] & live[1:r:2]
        if not bool(both.any()):
            return
        v, _ = pit(law[:r], x[:r], self._u(r), by_id=True)
        self.pairs.append(torch.stack([v[0:r:2][both], v[1:r:2][both]], 1))
        self.pair_strata.append(torch.full((int(both.sum()),), stratum, dtype=torch.long))

    def on_verify(self, verifier, logits: Tensor, tokens: Tensor, probs: Tensor | None, lengths: Tensor,
                  sampling, out, tree: bool = False) -> None:
        g = tokens.shape[1]
        lengths = lengths.to(torch.long)
        if probs is not None and g:
            rows, cols = (torch.arange(g)[None, :] < lengths[:, None]).nonzero(as_tuple=True)
            self.selection.add(probs[rows, cols], tokens[rows, cols], cols, self._u(rows.numel()))
        # Acceptance and emission replay the chain rule position by position; a tree round's walk
        # is checked by the law of its output (sequence, independence, cross-request) instead.
        if not self.law_declared or tree:
            return
        n = out.num_accepted.to(torch.long)
        p = warp(logits, sampling)
        r = torch.arange(p.shape[0])
        if g:
            a = verifier.accept_probability(p[:, :g], probs, tokens)
            reached = torch.arange(g)[None, :] < torch.minimum(n + 1, lengths)[:, None]
            self.accept_prob.append(a[reached].detach())
            self.accepted.append((torch.arange(g)[None, :] < n[:, None])[reached])
        law = p[r, n]
        rejected = n < lengths
        if g and bool(rejected.any()):
            k = n.clamp(max=g - 1)
            q = None if probs is None else probs[r, k]
            law = torch.where(rejected[:, None], verifier.residual(law, q, tokens[r, k]), law)
        strata = torch.where(rejected, n, BONUS + lengths)
        self.emission.add(law, out.next_token, strata, self._u(len(r)))
        self._pair(law, out.next_token, torch.ones(len(r), dtype=torch.bool), EMITTED)

    # -- results -------------------------------------------------------------------------------

    def fits(self) -> dict[str, FitResult]:
        """The statistics that apply to what was seen (a name is absent when nothing fed it)."""
        out = {}
        if self.reported_probs or self.law_declared:
            out["cross-request"] = (pair_fit(torch.cat(self.pairs), torch.cat(self.pair_strata)) if self.pairs
                                    else pair_fit(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)))
        if self.reported_probs:
            out["draft law"] = self.draft.fit()
            out["selection"] = self.selection.fit()
        if self.law_declared:
            prob = torch.cat(self.accept_prob) if self.accept_prob else torch.zeros(0)
            hit = torch.cat(self.accepted) if self.accepted else torch.zeros(0, dtype=torch.bool)
            out["acceptance"] = bernoulli_fit(prob, hit)
            out["emission"] = self.emission.fit()
        return out


class _ObservedDrafter:
    def __init__(self, inner: Any, recorder: RoundRecorder) -> None:
        self._inner, self._recorder = inner, recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def draft(self, ctx):
        block = self._inner.draft(ctx)
        self._recorder.on_draft(block, ctx)
        return block


class _ObservedVerifier:
    def __init__(self, inner: Any, recorder: RoundRecorder) -> None:
        self._inner, self._recorder = inner, recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def verify(self, target_logits, draft_tokens, draft_probs, lengths, sampling, uniforms, parents=None):
        tree = {} if parents is None else {"parents": parents}
        out = self._inner.verify(target_logits, draft_tokens, draft_probs, lengths, sampling, uniforms, **tree)
        self._recorder.on_verify(self._inner, target_logits, draft_tokens, draft_probs, lengths, sampling, out,
                                 tree=parents is not None)
        return out
