"""The suite's statistics: p-values, cell merging, the impossible-cell rule, power."""

from __future__ import annotations

import math

import pytest
import torch

from specforge_conformance.stats import (
    chi2_isf,
    chi2_sf,
    goodness_of_fit,
    merge_cells,
    power,
    predicted_power,
)


@pytest.mark.parametrize(("x", "df", "p"), [(3.841458820694124, 1, 0.05), (18.307038053275146, 10, 0.05),
                                            (23.209251158954356, 10, 0.01)])
def test_chi2_sf_matches_tables(x, df, p):
    assert chi2_sf(x, df) == pytest.approx(p, rel=1e-9)
    assert chi2_isf(p, df) == pytest.approx(x, rel=1e-9)


def test_chi2_isf_reaches_tiny_levels():
    x = chi2_isf(1e-8, 300)
    assert chi2_sf(x, 300) == pytest.approx(1e-8, rel=1e-6)


def test_light_cells_are_pooled_and_impossible_cells_marked():
    probs = torch.tensor([0.5, 0.3, 0.1996, 0.0002, 0.0002, 0.0])
    group = merge_cells(probs, 1000)
    assert group[:3].tolist() == [0, 1, 2]
    # 0.0004 · 1000 = 0.4 < 5: the pool is folded into the lightest kept cell.
    assert group[3:5].tolist() == [2, 2] and group[5] == -1
    group = merge_cells(probs, 20_000)  # 4 expected each: too light alone, 8 together
    assert group[3:5].tolist() == [3, 3]


def test_a_sample_on_an_impossible_sequence_fails_alone():
    probs = torch.tensor([0.5, 0.5, 0.0])
    fit = goodness_of_fit(torch.tensor([500, 499, 1]), probs)
    assert fit.impossible == 1 and fit.rejects(1e-12)
    assert not goodness_of_fit(torch.tensor([500, 500, 0]), probs).rejects(1e-6)


def test_power_formula_matches_simulation():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(40, generator=gen, dtype=torch.float64) * 1.5, 0)
    alt = torch.softmax(p.log() + 0.08 * torch.randn(40, generator=gen, dtype=torch.float64), 0)
    n, alpha, trials = 4000, 0.01, 300
    predicted = predicted_power(alt, p, n, alpha)["power"]
    rejected = sum(
        goodness_of_fit(torch.bincount(torch.multinomial(alt, n, True, generator=gen), minlength=40), p).rejects(alpha)
        for _ in range(trials))
    # Binomial standard error at 300 trials is at most 0.029; allow four of them.
    assert abs(rejected / trials - predicted) < 0.12
    assert 0.1 < predicted < 0.99  # the test is informative only away from 0 and 1


def test_power_is_alpha_without_signal_and_grows_with_noncentrality():
    assert power(50, 0.0, 1e-3) == pytest.approx(1e-3)
    values = [power(50, lam, 1e-6) for lam in (10, 50, 100, 200)]
    assert values == sorted(values) and values[-1] > 0.99
    assert not math.isnan(power(400, 5000.0, 1e-7))
