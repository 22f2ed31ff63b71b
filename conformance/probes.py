"""Probe cases: the pipelines in which each kind of component meets the mechanism it could break.

A drawn case of the pairwise-covering set certifies nothing when it cannot reach the mechanism —
a threshold above every confidence verifies nothing, a two-token horizon leaves no room for a
rejection after an accepted draft, T = 0 is a point mass.  So every component under test also runs
in *probe cases* built for its kind, around it only suite-owned parts whose behaviour is known:

========== ==================================================================================
kind       probe cases (horizon 4, vocabulary 8, T = 1 unless said)
========== ==================================================================================
verifier   ``shadow`` with a per-position spike (long accepted prefixes, rejections at every
           depth, residuals far apart between positions); ``shadow`` tilted by at most ±0.07
           per logit, at T = 1.5 (p/q close to 1 on both sides: acceptance just below certain,
           where a rule off by a few percent hides; not for a greedy-only verifier); the one-hot
           (deterministic-draft) path is met in the combinations with ``ngram``, under the
           same statistics; a verifier that verifies trees also meets ``random-tree`` twice:
           four top-k children of the anchor and two under each (every sibling's acceptance
           strictly between 0 and 1, up to three rejected siblings), and three i.i.d. children
           with two under each (repeated tokens among siblings, sampled q); a verifier that
           declares its rule is replayed there node by node; a verifier that samples also meets
           the spiky chain as a *mixed* case (:data:`PROBE_MIX`: greedy rows, T = 1 rows and
           T = 0.7 top-k 3 top-p 0.8 rows in every batch), each row replayed under its own
           settings
drafter    the drafter with ``rejection`` and ``fixed`` at T = 1, and at T = 0.8 with top-p 0.9
           (its reported q checked slot by slot by the draft-law statistic); a drafter that
           samples also in a mixed case (:data:`PROBE_MIX`, at half its N), where it must warp
           each row with that row's settings, or report the law it did use — paid for by its
           warped homogeneous case, then at half N too
confidence ``random`` (sequential, peaked) → the estimator → ``probe-median`` at batch 64: a slot is verified
           when its confidence is at least the batch's median there — so a confidence that reads
           x_k decides on x_k
calibrator the same, with ``probe-prev`` confidence and the calibrator between
scheduler  ``random`` → ``probe-prev`` (c_k a strong function of x_{k−1}, so a rule that reads a
           later slot reads the token) → the scheduler at batch 32, with the declared parameter
           set that makes the most undecided verify decisions per round (drafted slots × s(1 − s),
           s the share verified) in a short pilot run
========== ==================================================================================

The sample size and vocabulary come from a power calculation (:func:`size_case`).  The probe
components below are registered with the probe drafters and never enter the combinations.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from specforge import hookimpl
from specforge.components import DraftBlock
from specforge.config import DEFAULT_COMPONENTS
from specforge.plugins import PluginHost
from specforge.registry import ComponentKind
from specforge_conformance.drafters import SUITE_DRAFTERS
from specforge_conformance.exact import FAMILIES
from specforge_conformance.harness import CASE_THREADS, MIXED_SHARE, Case, pilot, shares
from specforge_conformance.stats import FitResult, detectable_tv, merge_cells

__all__ = ["PROBE_MIX", "PROBE_ONLY", "MedianScheduler", "PrevTokenConfidence", "probe_cases", "size_case"]

PROBE_ONLY = frozenset({"probe-prev", "probe-median"})  # suite parts, never certified themselves
HORIZON = 4
MAX_CELLS = 4096  # V^horizon: the sequence law of a probe stays resolvable at N = 2·10⁴
TARGET_TV = 0.09  # size_case doubles N when the sequence statistic cannot detect this (a safety net)
VOCABS = (8, 12, 16, 24)


class PrevTokenConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = Field(7, description="seed of the token → confidence table")


class PrevTokenConfidence:
    """c_k = t[x_{k−1}] (x_0 the anchor), t a fixed table spread over [0.05, 0.95].  Pre-token,
    as the contract requires — but a strong function of the previous token, so any rule that
    decides slot k from slot k+1 decides it from x_k."""

    def __init__(self, config: PrevTokenConfig | None = None) -> None:
        self.config = config or PrevTokenConfig()
        self.table: Tensor | None = None

    def bind(self, target) -> None:
        gen = torch.Generator().manual_seed(self.config.seed)
        v = target.vocab_size
        self.table = (0.05 + 0.9 * torch.randperm(v, generator=gen).to(torch.float32) / max(v - 1, 1))

    def estimate(self, block: DraftBlock) -> Tensor:
        r = block.tokens.shape[0]
        anchor = block.anchor if block.anchor is not None else torch.zeros(r, dtype=torch.long)
        prev = torch.cat([anchor.view(r, 1), block.tokens[:, :-1]], 1)
        return self.table[prev]


class MedianConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MedianScheduler:
    """Verify the leading slots whose confidence is at least the batch median at that slot (among
    requests that have it).  Causal: other requests' confidences do not depend on this request's
    x_k.  It puts the decision where the estimator's values vary, whatever their range."""

    def __init__(self, config: MedianConfig | None = None) -> None:
        self.config = config

    def schedule(self, confidence: Tensor, available: Tensor) -> Tensor:
        r, g = confidence.shape
        valid = torch.arange(g)[None, :] < available[:, None]
        c = torch.where(valid, confidence.to(torch.float64), torch.nan)
        median = torch.nanquantile(c, 0.5, dim=0, keepdim=True) if r else c
        keep = valid & (c >= median)
        return torch.cumprod(keep.to(torch.long), 1).sum(1)


@hookimpl
def specforge_register_confidence_estimators(register):
    register("probe-prev", PrevTokenConfidence, config=PrevTokenConfig, pre_token=True,
             description="TEST ONLY: a pre-token confidence that is a strong function of x_{k-1}")


@hookimpl
def specforge_register_schedulers(register):
    register("probe-median", MedianScheduler, config=MedianConfig, reads=("confidence",),
             description="TEST ONLY: verify while c_k is at least the batch median at slot k")


# --- the cases -----------------------------------------------------------------------------------

_DEFAULTS = {kind.value: (DEFAULT_COMPONENTS[kind], {}) for kind in ComponentKind
             if kind is not ComponentKind.VERIFIER}
_REJECTION = ("rejection", {})
_SPIKY = ("shadow", {"gamma": 3, "temperature": 1.0, "noise": 0.05, "spike": 0.3})
# The target's own law at T = 1.5 (the case's too: flatter laws, more distinct drafts, and the
# temperature path of the verifier) with every logit moved by at most ±0.07: p/q within
# [0.87, 1.15], so about half of the drafts are accepted with a probability just below 1 — where a
# rule that is off by a few percent hides from the output law (the acceptance statistic's fine
# bands are there; a tilt of 0.1 left the band 0.98–0.99 thin, 0.05 the band 0.9–0.95).
NEAR_T = 1.5
NEAR_ONE = ("shadow", {"gamma": 3, "temperature": NEAR_T, "noise": 0.0, "tilt": 0.07})
_SEQUENTIAL = ("random", {"gamma": 3, "sharpness": 2.0})
# Two trees.  Deterministic (top-k, one-hot q) children of the target's own perturbed law, four
# under the anchor and two under each: the acceptance of the j-th sibling is the residual's mass
# at its token — large for the first, strictly between 0 and 1 at every sibling — so each
# decision carries information.  And three iid children, two
# under each: repeated tokens among siblings and sampled q — but after one rejection a sibling
# drawn from the same q is accepted with probability 0 or 1 almost always (the residual lives
# where p > q), so that tree tests the walk's output law more than its individual decisions.
_TREES = (("random-tree", {"branching": [4, 2], "children": "top", "source": "target"}),
          ("random-tree", {"branching": [3, 2]}))
# The settings of the mixed probes' requests: a greedy row beside sampling rows in one round (where
# a one-hot law can leak into a sampling row, or a sampling law into a greedy one), a plain T = 1
# row, and a truncated one whose top-k and top-p remove tokens the others keep — so a row warped
# with another row's settings draws tokens its own law rules out, and fails at once.
PROBE_MIX = ((1.0, 0, 1.0), (0.0, 0, 1.0), (0.7, 3, 0.8))
# The batch of the selection probes: the median rule and the selection statistic need a batch of
# requests per round, and a round costs mostly per pass — the confidence and calibrator probes run
# at 64 (their 7 shipped cases: 40 CPU-s against 75 at 32, same N, one EPYC thread, 2026-12-07; the
# subtle `sampled-q` control stays caught there, test_conformance_power).  The schedulers' stay at
# 32: a hardware-aware scheduler spreads its token budget over the batch, and at 64 `async-topk`'s
# most selective parameter set verified 19 % of the drafts, too few for the case to count.
SELECTION_BATCH = 64
SCHEDULER_BATCH = 32


def _pipeline(**slots) -> dict:
    out = {**_DEFAULTS, "verifier": _REJECTION}
    out.update(slots)
    return out


def _example(host: PluginHost, kind: ComponentKind, name: str, seed: int) -> dict:
    examples = host.get(kind, name).metadata.examples or ({},)
    return dict(examples[seed % len(examples)])


def probe_cases(host: PluginHost, kind: ComponentKind, name: str, n: int, seed: int = 0) -> list[Case]:
    """The probe cases of component ``name`` of ``kind`` (empty for kinds without probes and for
    the suite's own parts), sized by :func:`size_case`."""
    if name in PROBE_ONLY:
        return []
    meta = host.get(kind, name).metadata
    mine = (name, _example(host, kind, name, seed))
    if kind is ComponentKind.VERIFIER:
        if not meta.lossless:
            return []
        cases = [Case(pipeline=_pipeline(drafter=_SPIKY, verifier=mine), batch=256)]
        if not meta.greedy_only:  # (at T = 0 every decision is certain: nothing lies near the threshold)
            cases.append(Case(pipeline=_pipeline(drafter=NEAR_ONE, verifier=mine), batch=256, temperature=NEAR_T))
        if meta.trees:  # and its walk over trees: rejected siblings, residual updates, subtrees
            # (at T = 0 — a greedy-only verifier — every decision is certain: one tree suffices)
            trees = _TREES[:1] if meta.greedy_only else _TREES
            # (batch 256: a round's cost is mostly per pass, not per row — 19 s vs 31 s a case at 64)
            cases += [Case(pipeline=_pipeline(drafter=tree, verifier=mine), batch=256) for tree in trees]
        if meta.greedy_only:
            cases = [replace(c, temperature=0.0) for c in cases]
        else:  # the batches a server runs: rows of different settings, each verified under its own
            cases.append(_mixed(Case(pipeline=_pipeline(drafter=_SPIKY, verifier=mine), batch=256)))
        # the chains and the top-k tree at the tier's N (their decisions carry the information), the
        # iid tree at half of it (its output law is most of what it tests)
        # (a mixed case's own target and seeds: its T = 1 rows must not replay the spiky case's requests)
        return [_finish(c, n // 2 if c.pipeline["drafter"] == _TREES[1] else n, seed,
                        "verifier mixed" if c.mix else "verifier") for c in cases]
    if kind is ComponentKind.DRAFTER:
        if name in SUITE_DRAFTERS:
            return []
        pipeline = _pipeline(drafter=mine)
        if meta.uses_correction_head:
            pipeline["correction_head"] = ("none", {})
        # The warped case at half N when a mixed case follows: that one's truncated rows (T = 0.7,
        # top-k 3, top-p 0.8) check a warped draft law too, so the mixed case is paid from here.
        warped = n if meta.deterministic else int(n * (1 - MIXED_SHARE))
        cases = [_finish(Case(pipeline=pipeline, batch=256), n, seed, "drafter"),
                 _finish(Case(pipeline=pipeline, batch=256, temperature=0.8, top_p=0.9), warped, seed + 1, "drafter")]
        if not meta.deterministic:  # a drafter that samples may warp its laws: with each row's own settings?
            # (at the share of N a combination's mixed case gets: its draft-law strata need no more)
            cases.append(_finish(_mixed(Case(pipeline=pipeline, batch=256)), int(n * MIXED_SHARE), seed + 2, "drafter"))
        return cases
    if kind is ComponentKind.CONFIDENCE:
        if not meta.pre_token:
            return []
        slots = _sequential_for(host, set(meta.needs_any))
        if slots is None:
            return []  # nothing registered feeds it; the covering set still pairs it
        return [_finish(Case(pipeline=_pipeline(**slots, confidence=mine, scheduler=("probe-median", {})),
                             batch=SELECTION_BATCH), n, seed, "confidence")]
    if kind is ComponentKind.CALIBRATOR:
        return [_finish(Case(pipeline=_pipeline(drafter=_SEQUENTIAL, confidence=("probe-prev", {}), calibrator=mine,
                                                scheduler=("probe-median", {})), batch=SELECTION_BATCH), n, seed,
                        "calibrator")]
    if kind is ComponentKind.SCHEDULER:
        cases = [_finish(Case(pipeline=_pipeline(drafter=_SEQUENTIAL, confidence=("probe-prev", {}),
                                                 scheduler=(name, dict(e))), batch=SCHEDULER_BATCH), n, seed,
                         "scheduler")
                 for e in (meta.examples or ({},))]
        return [_most_selective(cases, host)]
    return []


def _mixed(case: Case) -> Case:
    """``case`` with its requests at the settings of :data:`PROBE_MIX`."""
    t, k, p = PROBE_MIX[0]
    return replace(case, mix=PROBE_MIX, temperature=t, top_k=k, top_p=p)


def _most_selective(cases: list[Case], host: PluginHost) -> Case:
    """The case whose scheduler makes the most verify decisions that could have gone either way
    in a short pilot run: drafted slots per round × s(1 − s), s the share of them verified.  A
    parameter set under which it verifies everything or nothing decides nothing (a step curve
    that admits no draft at this batch size, a threshold above every confidence), and one whose
    draft gate runs most rounds plain decides little, whatever share of its few drafts it
    verifies."""
    if len(cases) == 1:
        return cases[0]

    def decisions(case: Case) -> float:
        result = pilot(case, host)
        s = shares(result)[0]
        return result.drafted / max(result.rounds, 1) * s * (1 - s)

    return max(cases, key=decisions)  # the first of equals


def _sequential_for(host: PluginHost, needs: set[str]) -> dict | None:
    """A sequential drafter (q_{k+1} depends on x_k) that fills one of ``needs``: the ``random``
    probe when the estimator reads q or logits, else a registered drafter that provides the field,
    with a non-identity correction head so that its laws are sequential too."""
    if not needs or needs & {"probs", "logits"}:
        return {"drafter": _SEQUENTIAL}
    for name in host.names(ComponentKind.DRAFTER):
        meta = host.get(ComponentKind.DRAFTER, name).metadata
        if name in SUITE_DRAFTERS or not needs & set(meta.provides):
            continue
        slots = {"drafter": (name, _example(host, ComponentKind.DRAFTER, name, 0))}
        if meta.uses_correction_head:
            heads = [h for h in host.names(ComponentKind.CORRECTION_HEAD)
                     if not host.get(ComponentKind.CORRECTION_HEAD, h).metadata.identity]
            if heads:
                slots["correction_head"] = (heads[0], _example(host, ComponentKind.CORRECTION_HEAD, heads[0], 0))
        return slots
    return None


def _finish(case: Case, n: int, seed: int, role: str) -> Case:
    """A well-conditioned target for the probe (seeded), sized by :func:`size_case`."""
    base = int.from_bytes(hashlib.sha256(f"{seed}:{role}:{case.combination.label()}".encode()).digest()[:4], "big")
    for attempt in range(50):
        candidate = replace(case, family=FAMILIES[(base + attempt) % len(FAMILIES)],
                            target_seed=(base + attempt) % 10_000, seed=(base * 7919 + attempt) % 2**40,
                            prompt=(3, 5, 7, 3, 5), threads=CASE_THREADS)
        candidate = size_case(candidate, n)
        if candidate.well_conditioned:
            return candidate
    raise RuntimeError(f"no well-conditioned target found for the probe of {case.combination.label()}")


def size_case(case: Case, n: int, horizon: int | None = None) -> Case:
    """Horizon, vocabulary and N from a power calculation.

    The horizon leaves room for a whole block and its bonus in the first round (γ + 1, at most 4);
    among the vocabularies whose V^horizon cells stay within :data:`MAX_CELLS`, the one whose
    sequence statistic has the smallest worst-case minimum detectable TV at N (a mixed case: that of
    its weakest sampling setting, at its share of N); N is the tier's, doubled when even that one
    exceeds :data:`TARGET_TV` — but not for a mixed case, whose per-setting sequence power is
    stated in the report rather than bought (the per-row mechanism statistics carry its power)."""
    gamma = int(dict(case.pipeline["drafter"][1]).get("gamma", 3)) if case.pipeline.get("drafter") else 1
    h = horizon or max(2, min(HORIZON, gamma + 1))
    sized = [replace(case, horizon=h, vocab=v, n=n) for v in VOCABS if v ** h <= MAX_CELLS]
    scored = [(_sequence_mde(c, n), c) for c in sized if c.well_conditioned]
    if not scored:
        return sized[0]  # the caller filters ill-conditioned cases
    mde, best = min(scored, key=lambda t: t[0])
    return best if mde <= TARGET_TV or best.mix else replace(best, n=2 * n)


def _sequence_mde(case: Case, n: int) -> float:
    """:func:`sequence_detectable` of ``case`` at N = ``n``: of its weakest setting that samples,
    at that setting's share of N (a greedy setting's point mass has no chi-square)."""
    share = n // len(case.settings)
    spread = [law.probs for law in case.laws() if int((law.probs > 0).sum()) > 1]
    return max((sequence_detectable(p, share) for p in spread), default=0.0)


def sequence_detectable(law: Tensor, n: int, alpha: float = 1e-6 / 120) -> float:
    """The sequence statistic's worst-case minimum detectable TV at ``n`` samples of ``law`` (one
    stage, at a typical fast-tier per-statistic level)."""
    group = merge_cells(law, n)
    df = max(int(group.max()) + 1 - 1, 1)
    return detectable_tv(FitResult(n, df + 1, 0.0, df, 1.0, 0.0, 0), alpha)
