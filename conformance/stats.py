"""Goodness of fit of an empirical sequence law against the exact one, and the test's power.

Pearson's chi-square on cells whose expected count is at least 5; the lighter cells are pooled
into one (and that pool into the lightest kept cell while it is still under 5).  A sample in a
cell of probability exactly 0 — a sequence the target can never produce, e.g. outside top-k — is
a failure on its own, whatever the statistic says.  p-values come from the regularised upper
incomplete gamma function, the power from the non-central chi-square as a Poisson mixture; both
in float64 without scipy.

The mechanism statistics (docs/conformance.md#what-each-statistic-sees) are chi-squares too:

* :func:`pit` / :func:`uniformity_fit` — a token drawn from a law that is known row by row (the
  draft law q_k a drafter reports, the residual a verifier declares) has a randomised probability
  integral transform that is exactly U[0, 1), whatever the rows are; its histogram, per stratum
  (position, rejection position), is tested against the flat one;
* :func:`bernoulli_fit` — acceptance events with declared probabilities a_i: per band of a
  (:data:`ACCEPT_BANDS`, fine just below 1) and stratum (a tree's sibling index),
  (Σ accepted − Σ a)² / Σ a(1 − a), summed, is χ² with one degree of freedom per band;
* :func:`pair_fit` / :func:`square_fit` — pairs of PITs that must be independent uniforms: their
  distance (shared random numbers), or their cell on a grid of the unit square (any dependence).

Every :class:`FitResult` carries its *information* I: a deviation of size t (total variation on
the test's cells, or the acceptance-probability shift of :func:`bernoulli_fit`) gives the test a
non-centrality λ ≥ I·t².  :func:`detectable_tv` turns that into the smallest t the test catches
with probability ≥ 99 % at its level — the minimum detectable effect the suite reports;
:func:`band_detectable` does the same for one band of acceptance probabilities.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

__all__ = ["ACCEPT_BANDS", "DETECT", "Band", "FitResult", "band_detectable", "band_label", "bernoulli_fit", "chi2_isf",
           "chi2_sf", "conditional_fit", "detectable_tv", "goodness_of_fit", "impossible_detectable", "merge_cells",
           "noncentrality", "pair_fit", "pit", "power", "predicted_power", "square_fit", "total_variation",
           "uniformity_fit"]

MIN_EXPECTED = 5.0
DETECT = 0.99  # the detection probability a stated minimum detectable effect refers to
PIT_BINS = 16


def chi2_sf(x: float, df: int) -> float:
    """P(χ²_df > x)."""
    if x <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


@functools.lru_cache(maxsize=4096)
def chi2_isf(alpha: float, df: int) -> float:
    """The x with P(χ²_df > x) = alpha (bisection on :func:`chi2_sf`; remembered, since
    :func:`detectable_tv` asks for the same few levels thousands of times)."""
    lo, hi = 0.0, float(df) + 10.0
    while chi2_sf(hi, df) > alpha:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def power(df: int, lam: float, alpha: float) -> float:
    """P(non-central χ²_df(λ) > the level-alpha critical value): the chance a test with
    non-centrality λ fails.  Poisson(λ/2) mixture of central chi-squares, summed over the
    terms that carry its mass."""
    crit = chi2_isf(alpha, df)
    if lam <= 0:
        return alpha
    half = lam / 2
    spread = 12 * math.sqrt(half) + 30
    j = torch.arange(max(0, int(half - spread)), int(half + spread) + 1, dtype=torch.float64)
    log_w = -half + j * math.log(half) - torch.lgamma(j + 1)
    tails = torch.special.gammaincc((df + 2 * j) / 2, torch.full_like(j, crit / 2))
    return float((log_w.exp() * tails).sum().clamp(0, 1))


def total_variation(p: Tensor, q: Tensor) -> float:
    return float((p.to(torch.float64) - q.to(torch.float64)).abs().sum() / 2)


def merge_cells(probs: Tensor, n: int, min_expected: float = MIN_EXPECTED) -> Tensor:
    """``[C]`` group id of every cell with positive probability (−1 for impossible cells).

    Cells with expected count ≥ ``min_expected`` keep their own group; the rest share one pooled
    group, which is folded into the lightest kept group if it is itself too light.
    """
    probs = probs.to(torch.float64)
    heavy = probs * n >= min_expected
    group = torch.full(probs.shape, -1, dtype=torch.long)
    kept = heavy.nonzero().squeeze(1)
    group[kept] = torch.arange(kept.numel())
    light = (probs > 0) & ~heavy
    if bool(light.any()):
        pooled = float(probs[light].sum()) * n
        if pooled >= min_expected or kept.numel() == 0:
            group[light] = kept.numel()
        else:
            group[light] = int(probs[kept].argmin())
    return group


# Bands of the declared acceptance probability a that :func:`bernoulli_fit` tests one by one (inner
# edges).  Under the rejection rule a = min(1, p/q), so below 1 they are bands of p/q: coarse where
# a moves much of the output law, fine just below 1, where a rule that is off by a few percent
# (a tolerance on the wrong side of the comparison) moves the whole-sequence law little and the
# acceptance rate a lot — at p/q = 0.95 a 5 % error turns 0.95 into 1.
ACCEPT_BANDS = (0.25, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99)


@dataclass(frozen=True)
class Band:
    """One band of declared acceptance probabilities [lo, hi) in one stratum of a
    :func:`bernoulli_fit`: how often its events happened against how often they should have.

    ``information`` I_b: a shift t of the acceptance rate of this band alone gives the test a
    non-centrality λ = I_b·t² (n_b²/V_b for a band tested on its own; n_b²/V_pool for one tested
    in the pool of light bands; 0 for one too light to be tested at all)."""

    stratum: int
    lo: float
    hi: float
    n: int
    declared: float  # mean declared acceptance probability of its events
    observed: float  # the share of them that happened
    information: float

    @property
    def label(self) -> str:
        return band_label(self.lo, self.hi)


def band_label(lo: float, hi: float) -> str:
    return f"{lo:g}–{hi:g}"


@dataclass(frozen=True)
class FitResult:
    """Outcome of one goodness-of-fit test."""

    n: int
    cells: int  # groups after merging
    statistic: float  # Pearson X²
    df: int
    p_value: float
    tv: float  # total variation between the empirical and the exact law (all cells)
    impossible: int  # samples that landed on probability-0 sequences
    information: float | None = None  # I with λ ≥ I·t² for a deviation t; None: 4·n (Pearson, TV)
    bands: tuple[Band, ...] = ()  # bernoulli_fit: each band of declared probabilities on its own

    @property
    def info(self) -> float:
        return 4.0 * self.n if self.information is None else self.information

    def rejects(self, alpha: float) -> bool:
        return self.impossible > 0 or self.p_value < alpha

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> FitResult:
        """The inverse of :meth:`to_dict` (keys it does not know, like a report's ``detectable``,
        are left out)."""
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        bands = tuple(Band(**{k: v for k, v in b.items() if k in Band.__dataclass_fields__})
                      for b in known.pop("bands", ()))
        return cls(**known, bands=bands)


def goodness_of_fit(counts: Tensor, probs: Tensor) -> FitResult:
    """Test observed ``counts`` ``[C]`` against the exact law ``probs`` ``[C]``."""
    counts = counts.to(torch.float64)
    probs = probs.to(torch.float64)
    n = int(counts.sum())
    if n == 0:
        raise ValueError("no samples to test")
    group = merge_cells(probs, n)
    impossible = int(counts[group < 0].sum())
    g = int(group.max()) + 1 if bool((group >= 0).any()) else 0
    observed = torch.zeros(g, dtype=torch.float64).index_add_(0, group[group >= 0], counts[group >= 0])
    expected = torch.zeros(g, dtype=torch.float64).index_add_(0, group[group >= 0], probs[group >= 0]) * n
    df = max(g - 1, 1)
    if g <= 1:  # a point mass: nothing to compare beyond the impossible cells
        statistic, p_value = 0.0, 1.0
    else:
        statistic = float(((observed - expected) ** 2 / expected).sum())
        p_value = chi2_sf(statistic, df)
    return FitResult(n, g, statistic, df, p_value, total_variation(counts / n, probs), impossible)


def conditional_fit(groups: Iterable[tuple[Tensor, Tensor]]) -> FitResult:
    """One chi-square over several conditional laws: each group is (counts ``[C]``, law ``[C]``)
    of the draws that share a condition (a prompt, a prefix, a sampling setting); each is tested by
    :func:`goodness_of_fit` and the statistics and degrees of freedom are summed.  ``n`` counts
    the draws of the groups that had two cells or more; ``tv`` is their mean total variation
    weighted by draws.  A deviation whose draw-weighted mean TV is t gives λ ≥ 4·n·t²
    (Cauchy–Schwarz within a group, Jensen across them): the information is the one of
    :func:`goodness_of_fit`, 4·n."""
    statistic, df, n, cells, tv, impossible = 0.0, 0, 0, 0, 0.0, 0
    for counts, probs in groups:
        fit = goodness_of_fit(counts, probs)
        impossible += fit.impossible
        if fit.cells < 2:
            continue
        statistic += fit.statistic
        df += fit.cells - 1
        cells += fit.cells
        n += fit.n
        tv += fit.tv * fit.n
    if df == 0:
        return FitResult(n, cells, 0.0, 1, 1.0, 0.0, impossible, 0.0)
    return FitResult(n, cells, statistic, df, chi2_sf(statistic, df), tv / n, impossible)


def noncentrality(alternative: Tensor, probs: Tensor, n: int) -> tuple[float, int, float]:
    """(λ, df, m) of the test at sample size ``n`` when the samples really follow
    ``alternative``: λ = n·Σ_g (π_g − p_g)² / p_g over the merged groups, and m the mass the
    alternative puts on probability-0 sequences (each such sample fails the test by itself)."""
    probs = probs.to(torch.float64)
    alternative = alternative.to(torch.float64)
    group = merge_cells(probs, n)
    g = int(group.max()) + 1
    pi = torch.zeros(g, dtype=torch.float64).index_add_(0, group[group >= 0], alternative[group >= 0])
    p = torch.zeros(g, dtype=torch.float64).index_add_(0, group[group >= 0], probs[group >= 0])
    return float(n * ((pi - p) ** 2 / p).sum()), max(g - 1, 1), float(alternative[group < 0].sum())


def predicted_power(alternative: Tensor, probs: Tensor, n: int, alpha: float) -> dict[str, float]:
    """Chance that the test at level ``alpha`` fails on ``n`` samples from ``alternative``."""
    lam, df, impossible = noncentrality(alternative, probs, n)
    miss = (1 - power(df, lam, alpha)) * (1 - impossible) ** n
    return {"noncentrality": lam, "df": df, "impossible_mass": impossible, "power": 1 - miss}


# --- mechanism statistics -------------------------------------------------------------------------


def pit(law: Tensor, x: Tensor, u: Tensor, by_id: bool = False) -> tuple[Tensor, Tensor]:
    """Randomised probability integral transform of tokens ``x`` ``[M]`` under rows ``law``
    ``[M, V]``: F(x⁻) + u·law(x), with the tokens of each row ordered by decreasing probability
    (ties by id), so a law drawn sharper than declared piles values near 0 and a flatter one
    near 1 — or, ``by_id``, in id order, the order an inverse-CDF sampler uses, so that the value
    tracks the uniform the token was drawn with.  Returns (values ``[M]`` in [0, 1), ``[M]``
    bool: law(x) = 0, an impossible draw)."""
    law = law.to(torch.float64)
    law = law / law.sum(-1, keepdim=True).clamp(min=1e-300)
    x = x.to(torch.long).unsqueeze(-1)
    if by_id:
        lo = (torch.cumsum(law, -1) - law).gather(-1, x).squeeze(-1)
    else:
        order = torch.sort(-law, dim=-1, stable=True).indices
        rank = torch.argsort(order, dim=-1)
        ordered = law.gather(-1, order)
        before = torch.cumsum(ordered, -1) - ordered
        lo = before.gather(-1, rank.gather(-1, x)).squeeze(-1)
    px = law.gather(-1, x).squeeze(-1)
    return (lo + u.to(torch.float64) * px).clamp(0.0, 1.0 - 1e-12), px <= 0


def pair_fit(pairs: Tensor, strata: Tensor) -> FitResult:
    """Test that ``pairs`` ``[M, 2]`` of PIT values are independent uniforms, aimed at random
    numbers shared or misrouted between requests, which put the two values close together:
    for independent uniforms D = |v₁ − v₂| has density 2(1 − d), so W = 1 − (1 − D)² is U[0, 1);
    W is tested per stratum by :func:`uniformity_fit` (a reused uniform piles W near 0)."""
    d = (pairs[:, 0].to(torch.float64) - pairs[:, 1].to(torch.float64)).abs()
    return uniformity_fit(1 - (1 - d) ** 2, strata)


def _strata_bins(counts: list[int], bins: int) -> list[int]:
    return [min(bins, int(c // MIN_EXPECTED)) for c in counts]


def uniformity_fit(values: Tensor, strata: Tensor, impossible: int = 0, bins: int = PIT_BINS) -> FitResult:
    """Chi-square test that ``values`` are U[0, 1) within each stratum.

    A stratum with m values gets min(bins, m/5) equal-width bins (expected count ≥ 5); strata too
    small for two bins are pooled into one (the values are uniform in every stratum, so in their
    union too)."""
    values = values.to(torch.float64)
    strata = strata.to(torch.long)
    n = int(values.numel())
    if n == 0:
        return FitResult(0, 0, 0.0, 1, 1.0, 0.0, impossible, 0.0)
    ids, inverse, counts = torch.unique(strata, return_inverse=True, return_counts=True)
    nb = _strata_bins(counts.tolist(), bins)
    small = torch.tensor([b < 2 for b in nb])
    pooled = small[inverse]
    groups = [(inverse == i) for i in range(len(ids)) if not small[i]]
    if bool(pooled.any()):
        groups.append(pooled)
    statistic, df, cells, dev = 0.0, 0, 0, 0.0
    for mask in groups:
        v = values[mask]
        b = min(bins, int(v.numel() // MIN_EXPECTED))
        if b < 2:
            continue
        observed = torch.bincount((v * b).to(torch.long).clamp(max=b - 1), minlength=b).to(torch.float64)
        expected = v.numel() / b
        statistic += float(((observed - expected) ** 2).sum() / expected)
        dev += float((observed - expected).abs().sum())
        df += b - 1
        cells += b
    p_value = chi2_sf(statistic, df) if df else 1.0
    return FitResult(n, cells, statistic, max(df, 1), p_value, dev / (2 * n), impossible)


def bernoulli_fit(prob: Tensor, outcome: Tensor, strata: Tensor | None = None,
                  edges: tuple[float, ...] = ACCEPT_BANDS) -> FitResult:
    """Test that events ``outcome`` ``[M]`` (bool) happen with the declared ``prob`` ``[M]``.

    An event that happens at probability 0, or fails at probability 1, is impossible.  The rest
    are grouped in bands of their probability (``edges``: :data:`ACCEPT_BANDS`) — within each
    stratum when ``strata`` ``[M]`` are given (a tree's sibling index, so that a rule broken for
    the third sibling only is not diluted by the first); each band with Σ a(1 − a) ≥ 2.5
    contributes one z² = (Σ happened − Σ a)² / Σ a(1 − a), the others are pooled into one more
    when that pool is large enough.  The TV reported is the mean |observed − declared|
    acceptance rate.  A shift t of every probability of one stratum gives λ = t²·Σ_b n_b² / V_b
    over that stratum's bands; the information of the test is the smallest of those (the
    stratum a bug would be hardest to see in).  Every band is also reported on its own
    (:attr:`FitResult.bands`, with its information: :func:`band_detectable`)."""
    a = prob.to(torch.float64).clamp(0.0, 1.0)
    hit = outcome.to(torch.bool)
    impossible = int(((a <= 0) & hit).sum() + ((a >= 1) & ~hit).sum())
    live = (a > 0) & (a < 1)
    a, hit = a[live], hit[live].to(torch.float64)
    n = int(a.numel())
    if n == 0:
        return FitResult(0, 0, 0.0, 1, 1.0, 0.0, impossible, 0.0)
    bins = len(edges) + 1
    ids, layer = (torch.zeros(1, dtype=torch.long), torch.zeros_like(a, dtype=torch.long)) if strata is None else \
        torch.unique(strata.to(torch.long)[live], return_inverse=True)
    cells = int(layer.max()) + 1
    b = layer * bins + torch.bucketize(a, torch.tensor(edges, dtype=torch.float64), right=True)
    size = cells * bins
    obs = torch.zeros(size, dtype=torch.float64).index_add_(0, b, hit)
    exp = torch.zeros(size, dtype=torch.float64).index_add_(0, b, a)
    var = torch.zeros(size, dtype=torch.float64).index_add_(0, b, a * (1 - a))
    cnt = torch.bincount(b, minlength=size).to(torch.float64)
    of = torch.arange(size) // bins  # each bin's stratum
    keep = var >= 2.5
    rest = ~keep & (cnt > 0)
    pooled = bool(rest.any()) and float(var[rest].sum()) >= 2.5
    o, e, v, c, s = obs[keep], exp[keep], var[keep], cnt[keep], of[keep]
    if pooled:
        # the pool's shift counts for no single stratum: it carries a stratum of its own
        o, e, v, c = (torch.cat([t, u[rest].sum().reshape(1)]) for t, u in ((o, obs), (e, exp), (v, var), (c, cnt)))
        s = torch.cat([s, torch.tensor([cells])])
    if v.numel() == 0:
        return FitResult(n, 0, 0.0, 1, 1.0, 0.0, impossible, 0.0)
    statistic = float(((o - e) ** 2 / v).sum())
    df = int(v.numel())
    per_stratum = torch.zeros(cells + 1, dtype=torch.float64).index_add_(0, s, c ** 2 / v)[:cells]
    seen = per_stratum[per_stratum > 0]
    info = float(seen.min()) if seen.numel() else 0.0
    pool_var = float(var[rest].sum()) if pooled else math.inf
    bounds = (0.0, *edges, 1.0)
    bands = tuple(
        Band(int(ids[j // bins]), bounds[j % bins], bounds[j % bins + 1], int(cnt[j]), float(exp[j] / cnt[j]),
             float(obs[j] / cnt[j]), float(cnt[j] ** 2 / (var[j] if keep[j] else pool_var)))
        for j in cnt.nonzero().squeeze(1).tolist())
    return FitResult(n, df, statistic, df, chi2_sf(statistic, df), float((o - e).abs().sum()) / n, impossible, info,
                     bands)


def square_fit(pairs: Tensor, strata: Tensor, side: int = 4) -> FitResult:
    """Test that ``pairs`` ``[M, 2]`` of PIT values are independent uniforms on the unit square,
    whatever the dependence: ``(⌊side·v₁⌋ + v₂)/side`` is U[0, 1) exactly when v₂ is uniform
    within every column of v₁, and :func:`uniformity_fit`'s side² bins (per stratum) are then the
    cells of a side × side grid.  (:func:`pair_fit` looks only at |v₁ − v₂|, where shared random
    numbers show; this one sees any joint law that is not the product.)"""
    v1, v2 = pairs[:, 0].to(torch.float64), pairs[:, 1].to(torch.float64)
    return uniformity_fit(((v1 * side).floor().clamp(max=side - 1) + v2) / side, strata, bins=side * side)


def band_detectable(fit: FitResult, band: Band, alpha: float, screen: float | None = None, factor: int = 10,
                    detect: float = DETECT) -> float:
    """The smallest shift of the acceptance rate of ``band`` alone (one band of a
    :func:`bernoulli_fit`) that the whole statistic detects with probability ≥ ``detect``: as
    :func:`detectable_tv`, with the band's information and the statistic's degrees of freedom."""
    return _detectable(band.information, fit.df, alpha, screen, factor, detect)


def detectable_tv(fit: FitResult, alpha: float, screen: float | None = None, factor: int = 10,
                  detect: float = DETECT) -> float:
    """The smallest deviation t (in the test's own units: TV on its cells, or an acceptance
    shift) that the test detects with probability ≥ ``detect``.

    With ``screen``, the two-stage rule of the suite: a statistic with p < ``screen`` at n samples
    is measured again on ``factor``·n fresh samples and fails if p < ``alpha`` there; the chance
    of detection is then the product of the two stages' powers.  Degrees of freedom are those of
    the first stage.  ``inf`` when the test saw no data."""
    return _detectable(fit.info, fit.df, alpha, screen, factor, detect)


def impossible_detectable(n: int, detect: float = DETECT) -> float:
    """The smallest deviation t from a point mass detected with probability ≥ ``detect`` in ``n``
    draws: every draw off the point is impossible and fails at once, so 1 − (1 − t)^n ≥ detect."""
    return 1.0 - (1.0 - detect) ** (1.0 / n) if n > 0 else math.inf


@functools.lru_cache(maxsize=65536)
def _detectable(info: float, df: int, alpha: float, screen: float | None, factor: int, detect: float) -> float:
    """:func:`detectable_tv` of a test with this information and df (remembered: a report asks
    for each case's effects several times — its table, its per-kind summary, its JSON)."""
    if info <= 0:
        return math.inf

    def detected(t: float) -> float:
        lam = info * t * t
        if screen is None:
            return power(df, lam, alpha)
        return power(df, lam, screen) * power(df, factor * lam, alpha)

    lo, hi = 0.0, 1e-3
    while detected(hi) < detect:
        hi *= 2
        if hi > 1e3:
            return math.inf
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if detected(mid) < detect else (lo, mid)
    return hi
