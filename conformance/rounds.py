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
* **acceptance**, **emission** and **walk pairs** — for a verifier that declares its per-position
  law (``accept_probability`` and ``residual``, docs/reference/contracts.md), whether ``verify``
  realises it, on chains and token trees alike (a chain is the tree whose slot k hangs under slot
  k − 1): the walk is replayed along the path the verifier reports; each node it reaches is
  accepted with the declared probability on the law left by the siblings rejected before it
  (stratified by sibling index), the emitted token follows the law the walk ends with (the
  residual after the last rejected sibling, or the target at the bonus row; stratified by depth
  and rejected siblings), and consecutive events of one walk are independent (their randomised
  PITs uniform on the unit square);
* **cross-request** — the transforms of two neighbouring requests' draws in the same round
  (their k-th draft tokens, their emitted tokens), taken in id order — the order an inverse-CDF
  sampler uses, so that each tracks the uniform it was drawn with — must be independent:
  uniform on the unit square.

All PIT values are exactly U[0, 1) for a correct pipeline, whatever the laws are, because each is
the transform of a draw under the very law it was drawn from, given everything before it.  In a
mixed case (requests at different sampling settings in one batch) every row is replayed under its
own settings, and every statistic keeps the settings apart — each stratum above is split by the
setting of the row (of the two rows, for cross-request) — so that a rule that is wrong for one
setting only (the greedy rows, the top-k rows) is not diluted by the others.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from specforge.sampling import warp
from specforge_conformance.stats import FitResult, bernoulli_fit, pair_fit, pit, square_fit, uniformity_fit

__all__ = ["SETTING_STRIDE", "RoundRecorder", "declares_law"]

BONUS = 1000  # emission strata: depth·SIBLINGS + rejected siblings there, or BONUS + depth for a bonus token
SIBLINGS = 4  # counts of rejected siblings kept apart in emission strata; more share the last one
# acceptance strata: the first child tried, the second, the third and later together (a tree
# reaches its fourth child rarely, and a stratum of its own would be the weakest by far)
SIBLING_STRATA = 3
WALK_STRATA = 4  # walk-pair strata: the index of the pair's first event, the last one shared
EMITTED = -1  # cross-request stratum of emitted tokens (draft tokens: their slot k)
SETTING_STRIDE = 10_000  # a row at setting s has its strata moved by s·SETTING_STRIDE (apart from all others)


def declares_law(verifier: Any) -> bool:
    """Whether a verifier states its per-position law (the optional white-box contract)."""
    return callable(getattr(verifier, "accept_probability", None)) and callable(getattr(verifier, "residual", None))


class _Stream:
    """PIT values and their strata, accumulated round by round."""

    def __init__(self) -> None:
        self.values: list[Tensor] = []
        self.strata: list[Tensor] = []
        self.impossible = 0

    def add(self, law: Tensor, x: Tensor, strata: Tensor, u: Tensor) -> Tensor:
        """Record the PITs of ``x`` under ``law`` and return them."""
        if x.numel() == 0:
            return torch.zeros(0, dtype=torch.float64)
        v, bad = pit(law, x, u)
        self.values.append(v)
        self.strata.append(strata)
        self.impossible += int(bad.sum())
        return v

    def fit(self) -> FitResult:
        if not self.values:
            return uniformity_fit(torch.zeros(0), torch.zeros(0, dtype=torch.long), self.impossible)
        return uniformity_fit(torch.cat(self.values), torch.cat(self.strata), self.impossible)


class RoundRecorder:
    """Observes rounds; :meth:`fits` gives the mechanism statistics of everything seen.
    ``settings``: the (temperature, top-k, top-p) the case's requests use, by which the strata are
    split (a row at none of them gets one stratum more)."""

    def __init__(self, seed: int, settings: Sequence[tuple[float, int, float]] = ((1.0, 0, 1.0),)) -> None:
        self.gen = torch.Generator().manual_seed(seed)  # the PITs' own randomisation
        self.menu = torch.tensor(settings, dtype=torch.float64).reshape(-1, 3)
        self.draft = _Stream()
        self.selection = _Stream()
        self.emission = _Stream()
        self.accept_prob: list[Tensor] = []
        self.accepted: list[Tensor] = []
        self.sibling: list[Tensor] = []  # the accept events' sibling index (0: the first child tried)
        self.walk_pairs: list[Tensor] = []  # [m, 2] PITs of consecutive events of one walk
        self.walk_strata: list[Tensor] = []
        self.pairs: list[Tensor] = []  # [m, 2] id-ordered PITs of neighbouring rows' draws
        self.pair_strata: list[Tensor] = []  # their source: draft slot k, or EMITTED
        self.reported_probs = False
        self.law_declared = False
        self.tree_rounds = 0  # verify calls that walked a token tree

    def _u(self, n: int) -> Tensor:
        return torch.rand(n, generator=self.gen, dtype=torch.float64)

    def _setting(self, sampling) -> Tensor:
        """``[R]`` the index of each row's settings among the case's (their count: none of them)."""
        rows = torch.stack([sampling.temperature.to(torch.float64), sampling.top_k.to(torch.float64),
                            sampling.top_p.to(torch.float64)], 1)
        hit = (rows[:, None, :] == self.menu[None]).all(-1)
        return torch.where(hit.any(1), hit.to(torch.long).argmax(1), len(self.menu)) * SETTING_STRIDE

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
        setting = self._setting(ctx.sampling)
        self.draft.add(block.probs[rows, cols], block.tokens[rows, cols], cols + setting[rows], self._u(rows.numel()))
        for k in range(g):
            self._pair(block.probs[:, k], block.tokens[:, k], drafted[:, k], k, setting)

    def _pair(self, law: Tensor, x: Tensor, live: Tensor, stratum: int, setting: Tensor) -> None:
        """Pairs (2j, 2j+1) of rows whose draw is real, as id-ordered PITs (stratified by the
        settings of both rows too)."""
        r = (x.shape[0] // 2) * 2
        both = live[0:r:2] & live[1:r:2]
        if not bool(both.any()):
            return
        v, _ = pit(law[:r], x[:r], self._u(r), by_id=True)
        self.pairs.append(torch.stack([v[0:r:2][both], v[1:r:2][both]], 1))
        pair = setting[0:r:2] * (len(self.menu) + 1) + setting[1:r:2]
        self.pair_strata.append(stratum + pair[both])

    def on_verify(self, verifier, logits: Tensor, tokens: Tensor, probs: Tensor | None, lengths: Tensor,
                  sampling, out, parents: Tensor | None = None) -> None:
        g = tokens.shape[1]
        lengths = lengths.to(torch.long)
        self.tree_rounds += parents is not None
        setting = self._setting(sampling)
        if probs is not None and g:
            rows, cols = (torch.arange(g)[None, :] < lengths[:, None]).nonzero(as_tuple=True)
            self.selection.add(probs[rows, cols], tokens[rows, cols], cols + setting[rows], self._u(rows.numel()))
        if not self.law_declared:
            return
        p = warp(logits, sampling)  # each row under its own settings
        if parents is None:  # a chain is the tree whose node j hangs under node j − 1
            parents = (torch.arange(g) - 1).expand(tokens.shape[0], g)
        law = self._replay(verifier, p, tokens, probs, parents.to(torch.long), lengths, out, setting)
        self._pair(law, out.next_token, torch.ones(len(law), dtype=torch.bool), EMITTED, setting)

    def _replay(self, verifier, p: Tensor, tokens: Tensor, probs: Tensor | None, parents: Tensor, lengths: Tensor,
                out, setting: Tensor) -> Tensor:
        """Walk the verified tree again along the path ``out`` reports, under the verifier's own
        declared rule (docs/design/verification.md#multi-draft-trees): the children of the node
        the walk stands on are tried in index order, child j against the law left by the siblings
        rejected before it.  Every tried node feeds *acceptance* (its declared probability, whether
        it was accepted, its sibling index); the emitted token feeds *emission* under the law the
        walk ends with; each event's randomised PIT and the next one's feed *walk pairs*.  A
        reported path the walk cannot take (a node that was never tried) is an impossible draw.
        Returns the emission law ``[R, V]``."""
        r, g = tokens.shape
        rows = torch.arange(r)
        n = out.num_accepted.to(torch.long)
        path = out.path
        if path is None:
            path = torch.where(torch.arange(g)[None, :] < n[:, None], torch.arange(g)[None, :], -1)
        path = path.to(torch.long)
        cur = torch.full((r,), -1, dtype=torch.long)
        depth = torch.zeros(r, dtype=torch.long)
        tried = torch.zeros(r, dtype=torch.long)  # children of the current node tried (and rejected) so far
        law = p[:, 0].clone()
        last = torch.full((r,), float("nan"), dtype=torch.float64)  # the walk's previous event's PIT
        events = torch.zeros(r, dtype=torch.long)
        for j in range(g):
            child = (j < lengths) & (parents[:, j] == cur)
            if not bool(child.any()):
                continue
            x = tokens[:, j]
            q = None if probs is None else probs[:, j]
            a = verifier.accept_probability(law, q, x).to(torch.float64).clamp(0.0, 1.0)
            nxt = path[rows, depth.clamp(max=g - 1)]
            accept = child & (depth < n) & (nxt == j)
            reject = child & ~accept
            self.accept_prob.append(a[child])
            self.accepted.append(accept[child])
            self.sibling.append((tried.clamp(max=SIBLING_STRATA - 1) + setting)[child])
            w = self._u(r)
            self._event(torch.where(accept, a * w, a + (1 - a) * w), child, last, events, setting)
            if bool(reject.any()):
                law = torch.where(reject[:, None], verifier.residual(law, q, x), law)
                tried = tried + reject.to(torch.long)
            if bool(accept.any()):
                law = torch.where(accept[:, None], p[:, j + 1], law)
                cur = torch.where(accept, j, cur)
                depth = depth + accept.to(torch.long)
                tried = torch.where(accept, 0, tried)
        self.emission.impossible += int((depth != n).sum())  # the reported path left the walk
        strata = torch.where(tried > 0, depth * SIBLINGS + tried.clamp(max=SIBLINGS - 1), BONUS + depth)
        v = self.emission.add(law, out.next_token, strata + setting, self._u(r))
        if r:
            self._event(v, torch.ones(r, dtype=torch.bool), last, events, setting)
        return law

    def _event(self, v: Tensor, live: Tensor, last: Tensor, events: Tensor, setting: Tensor) -> None:
        """One more event of the walk for the ``live`` rows: pair its PIT with the row's previous
        one, stratified by the previous event's index (known before either was drawn)."""
        both = live & ~torch.isnan(last)
        if bool(both.any()):
            self.walk_pairs.append(torch.stack([last[both], v[both]], 1))
            self.walk_strata.append((events[both] - 1).clamp(max=WALK_STRATA - 1) + setting[both])
        last[live] = v[live].to(torch.float64)
        events[live] += 1

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
            sib = torch.cat(self.sibling) if self.sibling else torch.zeros(0, dtype=torch.long)
            out["acceptance"] = bernoulli_fit(prob, hit, strata=sib)
            out["emission"] = self.emission.fit()
            out["walk pairs"] = (square_fit(torch.cat(self.walk_pairs), torch.cat(self.walk_strata)) if self.walk_pairs
                                 else square_fit(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)))
        return out


class _Observer:
    """Passes everything to the plug-in it wraps.  Its public methods are also bound on the
    observer itself: from Python 3.12 on, ``isinstance`` against a runtime-checkable protocol
    (the optional methods of :mod:`specforge.protocols`: ``bind``, ``release``, …) looks them
    up statically, past ``__getattr__``, and would find none — the engine would then never bind
    the wrapped drafter."""

    def __init__(self, inner: Any, recorder: RoundRecorder) -> None:
        self._inner, self._recorder = inner, recorder
        for name in dir(type(inner)):  # methods only: a property is not evaluated here
            if name.startswith("_") or name in type(self).__dict__:
                continue
            static = inspect.getattr_static(inner, name, None)
            if inspect.isfunction(static) or isinstance(static, (staticmethod, classmethod)):
                self.__dict__[name] = getattr(inner, name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _ObservedDrafter(_Observer):
    def draft(self, ctx):
        block = self._inner.draft(ctx)
        self._recorder.on_draft(block, ctx)
        return block


class _ObservedVerifier(_Observer):
    def verify(self, target_logits, draft_tokens, draft_probs, lengths, sampling, uniforms, parents=None):
        tree = {} if parents is None else {"parents": parents}
        out = self._inner.verify(target_logits, draft_tokens, draft_probs, lengths, sampling, uniforms, **tree)
        self._recorder.on_verify(self._inner, target_logits, draft_tokens, draft_probs, lengths, sampling, out,
                                 parents=parents)
        return out
