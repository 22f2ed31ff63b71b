"""Goodness of fit of an empirical sequence law against the exact one, and the test's power.

Pearson's chi-square on cells whose expected count is at least 5; the lighter cells are pooled
into one (and that pool into the lightest kept cell while it is still under 5).  A sample in a
cell of probability exactly 0 — a sequence the target can never produce, e.g. outside top-k — is
a failure on its own, whatever the statistic says.  p-values come from the regularised upper
incomplete gamma function, the power from the non-central chi-square as a Poisson mixture; both
in float64 without scipy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

__all__ = ["FitResult", "chi2_isf", "chi2_sf", "goodness_of_fit", "merge_cells", "noncentrality", "power", "predicted_power",
           "total_variation"]

MIN_EXPECTED = 5.0


def chi2_sf(x: float, df: int) -> float:
    """P(χ²_df > x)."""
    if x <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def chi2_isf(alpha: float, df: int) -> float:
    """The x with P(χ²_df > x) = alpha (bisection on :func:`chi2_sf`)."""
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

    def rejects(self, alpha: float) -> bool:
        return self.impossible > 0 or self.p_value < alpha

    def to_dict(self) -> dict:
        return asdict(self)


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
